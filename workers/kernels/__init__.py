"""Row-invariant kernels: a row's numbers do not depend on which other rows share the forward.

Why: greedy with speculation must equal greedy without, and a seeded request must give the same text whatever
else is batched with it. A verify scores K+1 (or tree-size) rows of a request where a decode step scores one, a
decode step at batch 16 has 16 rows where a lone request has one, and a prompt chunk may share its forward with
other requests' rows. Float sums are not associative, so a kernel whose summation order depends on the number of
rows (M), on a row's position among them or on key padding gives a row different bits in different batches.

Per path (CPU, torch 2.13, MKL / oneDNN; each claim is a test in tests/test_row_invariance.py):
- float32 / bfloat16 linear layers (``row_linear.row_invariant_linear``): BLAS is called only with row counts a
  probe showed to give every row the bits of one base shape, [gemm_rows, K] x [K, N] (``row_chunks``: checked
  per kernel, weight shape, dtype and thread count on first use), zero-padded up to an admitted count, on a fresh
  aligned copy of the rows. Where every count is admitted (oneDNN on most shipped shapes) a call is one whole-M
  call; elsewhere the count is padded (oneDNN at K = 1,536 sums a lone row in another order: it runs as 2 rows).
- GGUF block weights (Q4_0 / Q4_1 / Q8_0, the tied embedding / head included): the native kernel
  (``gguf_blocks``, a C++ extension built on first use) sums each output in one fixed order whatever M, the
  row's neighbours, the thread count and the SIMD path, by construction; where it does not build, torch's packed
  int4 kernel (workers/quantized_linear.py), which sums each row alone too, and the float32 head below.
- the output head: one gemv per row over fixed weight slices (workers/row_invariant.py) when it is big and
  memory-bound, the fixed-shape chunks above when it is small (``KernelConfig.head_gemv_bytes``).
- attention: on an AVX-512 CPU where the library builds, every float32 row of a forward in one native call per
  layer (``row_attention.native_attention``, row_attention.cpp), each (row, head) summed alone in an order fixed
  by its own key count; elsewhere (bfloat16, no AVX-512, ``SPECSERVE_ROW_ATTENTION=0``) each query row as its own
  one-query SDPA call over exactly its visible keys (workers/row_invariant.py ``RowAttention``), rows whose keys
  are prefixes of one length sharing calls of group sizes a probe showed give each row those bits.
- embedding, RMSNorm, RoPE, SiLU, residual adds, softmax and sampling: elementwise or per-row reductions (the
  4-bit layers' in ``layer_glue``, each row alone in a fixed order).
- tensor parallelism: the all-reduce adds the ranks' partial rows elementwise; with 2 ranks the sum is
  commutative, so exact; with more, the collective's order per element must not depend on the tensor's size
  (gloo's ring splits by size: not guaranteed beyond 2 ranks).

The thread count: the fixed-shape calls gave the same bits at 1 and 2 threads on the shipped shapes, but BLAS
may split a shape differently with other thread counts, so the same request on a machine with other core counts
may differ; within a run each role keeps its thread count.

GPU (written, not verified here: no GPU on the test machine). The same fixed-shape chunking holds for cuBLAS as
long as one algorithm serves every call of a shape (no split-K chosen by heuristics for small M, no
``CUBLAS_WORKSPACE_CONFIG``-dependent reduction order: set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and
``torch.use_deterministic_algorithms(True)``). SDPA on CUDA (flash / memory-efficient) splits keys by the
number of queries and sequences, so a per-row call there is invariant but slow; vLLM's batch-invariant mode
instead uses kernels with a fixed split size along K and along the keys (FlexAttention / Triton). Until such
kernels are wired here, seeded reproducibility on a GPU is "same batch, same bits", as vLLM documents for its
default mode.
"""
