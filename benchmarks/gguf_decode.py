"""Batch-1 greedy decode speed on one GGUF file: specserve's float32 expansion vs its packed 4-bit weights,
transformers ``generate`` on the same file, and llama.cpp (``llama_cpp``) when it is installed
(``pip install llama-cpp-python``, or the ``bench`` extra; it builds llama.cpp from source, a few minutes).

    python -m benchmarks.gguf_decode --target smollm2 --max-tokens 64 --repeats 3 --llama-cpp-threads 1,2

Each mode generates ``--max-tokens`` tokens greedily from the same chat-formatted prompt, EOS ignored; the
modes run in turns, ``--repeats`` times, and the best run of each is reported (on a shared machine the best
run is the one least disturbed by other work). Besides wall-clock tok/s, tok/s per CPU-second of this
process is printed: with one thread and the engine in-process, it is what an idle core would give (apart
from memory-bandwidth contention), which makes runs on a busy machine comparable. Also printed: the weight
bytes one decode step reads, and the time per step a memory bandwidth of ``--bandwidth-gbs`` would need for
them (the floor a memory-bound batch-1 step cannot beat). Mode ``specserve_shipped`` runs a packaged target as
shipped, with speculation (``--modes specserve_q4,specserve_shipped,llama_cpp``: plain, speculative and llama.cpp
side by side).

``--profile``: instead, one model forward at a time under ``torch.profiler`` (the 4-bit target by default): a
one-row decode step and a 5-row chain verify (``--profile-rows``) after a prompt, the time of each op class
per forward against the weight-bytes floor (docs/performance.md, "Verify cost")::

    OMP_NUM_THREADS=1 python -m benchmarks.gguf_decode --profile --target smollm2 --profile-rows 1,5

``--profile --compare-kernels``: the wall time of those forwards with the row-invariant kernels and with the plain
ones, alternating (any model: a GGUF file or a checkpoint directory)::

    OMP_NUM_THREADS=1 python -m benchmarks.gguf_decode --profile --compare-kernels \
        --target engine/default_models/target --profile-rows 1,5,8 --repeats 7

``--profile --compare-native``: the 4-bit target with torch's path and the native GGUF kernel with float32 and 8-bit
activations, alternating (each row count also as a ratio to the first, e.g. ``--profile-rows 1,4,5,8``).
``--profile --compare-attention``: one model (any), its forwards with the native row attention and with one SDPA
call per query row (``SPECSERVE_ROW_ATTENTION=0``), alternating (workers/kernels/row_attention.py).
(``--dtype bfloat16``: a float checkpoint in bfloat16; ``--batch-rows``: the rows are one-row decode steps of
that many sequences, a batch's decode step; ``--cpu-time``: CPU ms instead of wall, on a loaded machine.)
``--profile --compare-glue``: the 4-bit target's layers as torch ops vs as the glued native calls
(workers/kernels/layer_glue.py), one model switched back and forth; mode ``specserve_q4_noglue`` decodes without
them (a "median" column beside the best tok/s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from workers.gguf_loader import resolve_model_path

PROMPT = "Explain in a few sentences why the sky is blue."


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers a forward reads (a tied head counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.dim() < 2:  # norms, RoPE tables: negligible
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def gguf_weight_bytes(path: str, packed: bool, native: bool = False, q8: bool = False) -> int:
    """Bytes of the matrices specserve holds for a GGUF file, from the file's tensor table: with ``packed``
    (``--quantization gguf``) the decoder layers' Q4_0 / Q4_1 weights stay 4-bit, 20 bytes per 32 weights (16 of
    nibbles, a bfloat16 scale and zero: workers/quantized_linear.py); every other matrix (the token embedding, the
    head) is expanded to float32. ``native`` (the native block kernel, workers/kernels/gguf_blocks.py): every
    Q4_0 / Q4_1 / Q8_0 matrix, the tied embedding / head included, stays as the file stores it; ``q8`` (its 8-bit
    activations): repacked with the output rows padded to 16, the embedding as the file stores it, and the head
    both ways. As the floor's bytes read a step, leave ``q8`` False: a step reads one copy."""
    from gguf import GGMLQuantizationType, GGUFReader

    four_bit = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
    if packed and native:
        blocks = four_bit + (GGMLQuantizationType.Q8_0,)
        tensors = [t for t in GGUFReader(path).tensors if len(t.shape) > 1 and min(t.shape) > 1]
        tied = not any(t.name == "output.weight" for t in tensors)

        def held(t: Any) -> int:
            if t.tensor_type not in blocks:
                return 4 * int(t.n_elements)
            if not q8:
                return int(t.n_bytes)
            n = int(t.shape[-1])  # output rows (the file lists the row length first)
            repacked = -(-n // 16) * 16 * (int(t.n_bytes) // n)
            if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
                return int(t.n_bytes) + repacked  # the head keeps the file's blocks too (its .weight, the embedding)
            return int(t.n_bytes) if t.name == "token_embd.weight" else repacked

        return sum(held(t) for t in tensors)
    return sum(int(t.n_elements) // 32 * 20 if packed and t.tensor_type in four_bit and t.name.startswith("blk.")
               else 4 * int(t.n_elements)
               for t in GGUFReader(path).tensors if len(t.shape) > 1 and min(t.shape) > 1)


@contextlib.contextmanager
def native_kernel(on: bool, activations: str | None = None) -> Iterator[None]:
    """Models loaded inside use the native GGUF kernel (where it builds; with ``activations`` "f32" / "q8" when
    given, else KernelConfig's) or, ``on`` False, torch's path."""
    from workers.kernels import gguf_blocks

    saved = {k: os.environ.get(k) for k in ("SPECSERVE_GGUF_KERNEL", "SPECSERVE_GGUF_ACTIVATIONS")}
    os.environ["SPECSERVE_GGUF_KERNEL"] = "1" if on else "0"
    if activations:
        os.environ["SPECSERVE_GGUF_ACTIVATIONS"] = activations
    gguf_blocks.available.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        gguf_blocks.available.cache_clear()


def specserve_runner(path: str, quantization: str, prompt: list[int], n: int, native: bool = True,
                     activations: str | None = None) -> tuple[Callable[[], int], int]:
    """``native``: False loads with the native block kernel switched off (torch's int4 path, the float32 head);
    ``activations``: the native kernel's ("f32" / "q8"; None: KernelConfig's)."""
    from engine import LLM
    from workers.kernels import gguf_blocks

    with native_kernel(native, activations):
        llm = LLM(path, None, quantization=quantization, num_kv_tokens=1024, max_num_seqs=1)
        used = quantization == "gguf" and gguf_blocks.available()
    return _timed_generate(llm, prompt, n), gguf_weight_bytes(path, quantization == "gguf", used)


def _timed_generate(llm: Any, prompt: list[int], n: int) -> Callable[[], int]:
    """After a warm-up, a call that decodes ``n`` tokens greedily from ``prompt`` (EOS ignored) and returns how many."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return lambda: len(llm.generate([prompt], params)[0].token_ids)


def shipped_runner(target: str, path: str, prompt: list[int], n: int) -> tuple[Callable[[], int], int]:
    """``target`` as ``specserve generate --target NAME`` runs it: a packaged target's default speculative config
    (its shipped draft, adaptive depth), so speculation and llama.cpp's plain decode compare in one run."""
    from engine import LLM
    from engine.core.config import packaged_default_draft
    from workers.kernels import gguf_blocks

    if packaged_default_draft(target) is None:
        raise SystemExit(f"mode specserve_shipped needs a packaged target's short name (e.g. smollm2), got {target!r}")
    llm = LLM(target, None, num_kv_tokens=1024, max_num_seqs=1)
    return _timed_generate(llm, prompt, n), gguf_weight_bytes(path, True, gguf_blocks.available())


def hf_runner(path: str, prompt: list[int], n: int) -> tuple[Callable[[], int], int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out.shape[1] - ids.shape[1]

    run()
    return run, weight_bytes(model)


def llama_cpp_runner(path: str, prompt: list[int], n: int, threads: int) -> tuple[Callable[[], int], int]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=512, verbose=False)

    def run() -> int:
        llm.reset()
        count = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == n:
                break
        return count

    run()
    return run, os.path.getsize(path)


# torch op -> what it is, for the profile's classes (anything else: "elementwise, norms, RoPE")
OP_CLASSES = {
    "aten::_weight_int4pack_mm_for_cpu": "int4 matmuls",
    "specserve_gguf::mm": "block matmuls (native)", "specserve_gguf::mm_q8": "block matmuls (native)",
    "specserve_gguf::rows": "copies, casts, gathers",
    "specserve_gguf::layer_front": "layer glue (native: norms, RoPE, silu)",
    "specserve_gguf::layer_back": "layer glue (native: norms, RoPE, silu)",
    "specserve_gguf::add_rms_norm": "layer glue (native: norms, RoPE, silu)",
    "aten::mv": "output head (gemv per row)", "aten::addmv": "output head (gemv per row)",
    "aten::mm": "float matmuls", "aten::addmm": "float matmuls", "mkldnn::_linear_pointwise": "float matmuls",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "specserve_gguf::row_attention": "attention (native, all rows)",
    "aten::copy_": "copies, casts, gathers", "aten::index_select": "copies, casts, gathers",
    "aten::cat": "copies, casts, gathers", "aten::index_copy_": "copies, casts, gathers",
    "aten::zeros": "copies, casts, gathers", "aten::empty": "allocation", "aten::empty_strided": "allocation",
}


def _prompted_runner(path: str, quantization: str | None,
                     dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, Any, list[int], list[int]]:
    """(model, runner with PROMPT prefilled, its block table, PROMPT's ids); ``dtype`` overrides the engine's
    choice for a float checkpoint."""
    from workers.gguf_metadata import is_gguf
    from workers.input_batch import SeqForward
    from workers.loader import checkpoint_dtype, load_model, load_tokenizer
    from workers.model_runner import ModelRunner
    from workers.worker_base import auto_dtype

    if dtype is None and not is_gguf(path):
        dtype = auto_dtype(checkpoint_dtype(path), torch.device("cpu"))  # as the engine
    model = load_model(path, dtype=dtype, quantization=quantization)
    cfg = model.config
    runner = ModelRunner(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 33, 16, cfg.dtype, "cpu")
    table = list(range(1, 33))
    tok = load_tokenizer(path)
    if tok is None:  # a draft without a tokenizer of its own: any 40 ids
        prompt = [i % cfg.vocab_size for i in range(100, 140)]
    elif tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    else:
        prompt = tok.encode(PROMPT)
    runner.forward([SeqForward(table, 0, list(range(-1, len(prompt) - 1)), prompt)])
    return model, runner, table, prompt


def _chain(table: list[int], base: int, rows: int, batch: bool = False) -> list[Any]:
    """One sequence's verify chain of ``rows`` nodes, or (``batch``) ``rows`` one-row decode steps (timing only:
    they share the one block table, so each writes the same KV slot)."""
    from workers.input_batch import SeqForward

    if batch:
        return [SeqForward(table, base, [-1], [17 + i], logit_nodes=[0]) for i in range(rows)]
    return [SeqForward(table, base, list(range(-1, rows - 1)), [17 + i for i in range(rows)],
                       logit_nodes=list(range(rows)))]


def _median_ms(runner: Any, seqs: list[Any], steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    import statistics

    walls = []
    for _ in range(steps + 2):
        start = clock()
        runner.forward(seqs)
        walls.append(clock() - start)
    return statistics.median(walls[2:]) * 1e3


def profile_forwards(path: str, quantization: str | None, rows_list: list[int], steps: int) -> list[dict]:
    """Per forward of ``rows`` chain rows after the prompt: wall ms (unprofiled, median) and self ms per op
    class (profiled); "outside torch ops" is the wall time the ops' self times do not account for (Python,
    dispatch, the profiler's own share excluded)."""
    _, runner, table, prompt = _prompted_runner(path, quantization)
    out = []
    for rows in rows_list:
        seqs = _chain(table, len(prompt), rows)
        wall_ms = _median_ms(runner, seqs, steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.forward(seqs)
        classes: dict[str, float] = {}
        for ev in prof.key_averages():
            name = OP_CLASSES.get(ev.key, "elementwise, norms, RoPE")
            classes[name] = classes.get(name, 0.0) + ev.self_cpu_time_total / 1e3 / steps
        classes["outside torch ops"] = max(0.0, wall_ms - sum(classes.values()))
        out.append({"rows": rows, "wall_ms": wall_ms, "classes_ms": classes})
    return out


def compare_kernels(path: str, quantization: str | None, rows_list: list[int], steps: int, repeats: int,
                    dtype: torch.dtype | None = None, batch: bool = False, cpu_time: bool = False) -> None:
    """Wall ms per forward with the row-invariant kernels and with the plain ones (F.linear, batched SDPA, GEMM
    head), alternating ``repeats`` times in this process; medians. ``batch``: rows are one-row decode steps of
    that many sequences instead of one sequence's verify chain. ``cpu_time``: this process's CPU time instead of
    the wall (one thread: the forward's own time, which a loaded machine's time-sharing leaves out)."""
    import statistics

    model, runner, table, prompt = _prompted_runner(path, quantization, dtype)
    flagged = [m for m in model.modules() if hasattr(m, "row_invariant")]  # the model and its float linears
    walls: dict[tuple[int, bool], list[float]] = {}
    for _ in range(repeats):
        for on in (False, True):
            for m in flagged:
                m.row_invariant = on
            for rows in rows_list:
                seqs = _chain(table, len(prompt), rows, batch)
                clock = time.process_time if cpu_time else time.perf_counter
                walls.setdefault((rows, on), []).append(_median_ms(runner, seqs, steps, clock))
    shape = "sequences decoding one row each" if batch else "rows of one verify chain"
    print(f"{'CPU' if cpu_time else 'wall'} ms per forward after a {len(prompt)}-token prompt ({shape}, "
          f"{next(model.parameters()).dtype}), "
          f"medians of {repeats} alternating runs")
    print(f"{'rows':>5} {'plain':>8} {'row-invariant':>14} {'ratio':>6}")
    for rows in rows_list:
        a, b = (statistics.median(walls[(rows, on)]) for on in (False, True))
        print(f"{rows:>5} {a:>8.2f} {b:>14.2f} {b / a:>6.2f}")


def compare_native(path: str, rows_list: list[int], steps: int, repeats: int, cpu_time: bool = False) -> None:
    """ms per forward of the 4-bit target with torch's path (int4 kernel, float32 head) and the native GGUF kernel
    with float32 and with 8-bit activations, all loaded in this process and alternated ``repeats`` times; medians."""
    import statistics

    variants = {"torch": (False, None), "native f32": (True, "f32"), "native q8": (True, "q8")}
    runs = {}
    for name, (native, acts) in variants.items():
        with native_kernel(native, acts):
            runs[name] = _prompted_runner(path, "gguf")
    clock = time.process_time if cpu_time else time.perf_counter
    ms: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for name, (_, runner, table, prompt) in runs.items():
            for rows in rows_list:
                ms.setdefault((name, rows), []).append(_median_ms(runner, _chain(table, len(prompt), rows), steps,
                                                                  clock))
    used = {name: runs[name][0].quant_report.activations if runs[name][0].quant_report.native else "-" for name in runs}
    print(f"{'CPU' if cpu_time else 'wall'} ms per forward (rows of one verify chain), medians of {repeats} "
          f"alternating runs; activations in use: {used}")
    print(f"{'rows':>5}" + "".join(f"{name:>12}" for name in runs)
          + "".join(f" {name + ' / 1st':>15}" for name in runs))
    med = {key: statistics.median(v) for key, v in ms.items()}
    for rows in rows_list:
        print(f"{rows:>5}" + "".join(f"{med[(name, rows)]:>12.2f}" for name in runs)
              + "".join(f" {med[(name, rows)] / med[(name, rows_list[0])]:>15.2f}" for name in runs))


def compare_glue(path: str, rows_list: list[int], steps: int, repeats: int, cpu_time: bool = False) -> None:
    """ms per forward of the 4-bit target on the native kernel with its layers as torch ops and as the glued
    native calls (workers/kernels/layer_glue.py), one model in this process switched back and forth ``repeats``
    times; medians."""
    import statistics

    model, runner, table, prompt = _prompted_runner(path, "gguf")
    clock = time.process_time if cpu_time else time.perf_counter
    ms: dict[tuple[bool, int], list[float]] = {}
    try:
        for _ in range(repeats):
            for glue in (False, True):
                if model.model.set_glue(glue) != glue:
                    raise SystemExit("the glued layers do not apply to this model (no native kernel?)")
                for rows in rows_list:
                    ms.setdefault((glue, rows), []).append(_median_ms(runner, _chain(table, len(prompt), rows),
                                                                      steps, clock))
    finally:
        model.model.set_glue()
    print(f"{'CPU' if cpu_time else 'wall'} ms per forward (rows of one verify chain), medians of {repeats} "
          f"alternating runs of {steps} forwards; activations {model.quant_report.activations}")
    print(f"{'rows':>5} {'torch ops':>10} {'glued':>8} {'glued / torch':>14}")
    for rows in rows_list:
        a, b = (statistics.median(ms[(glue, rows)]) for glue in (False, True))
        print(f"{rows:>5} {a:>10.2f} {b:>8.2f} {b / a:>14.2f}")
def compare_attention(path: str, quantization: str | None, rows_list: list[int], steps: int, repeats: int,
                      dtype: torch.dtype | None = None, batch: bool = False, cpu_time: bool = False) -> None:
    """ms per forward with the native row attention and with one SDPA call per query row, one model, alternating
    ``repeats`` times in this process; medians (``batch``, ``cpu_time``: as ``compare_kernels``)."""
    import statistics

    _, runner, table, prompt = _prompted_runner(path, quantization, dtype)
    clock = time.process_time if cpu_time else time.perf_counter
    ms: dict[tuple[str, int], list[float]] = {}
    saved = os.environ.get("SPECSERVE_ROW_ATTENTION")
    try:
        for _ in range(repeats):
            for name, flag in (("sdpa per row", "0"), ("native", "1")):
                os.environ["SPECSERVE_ROW_ATTENTION"] = flag
                for rows in rows_list:
                    ms.setdefault((name, rows), []).append(_median_ms(runner, _chain(table, len(prompt), rows, batch),
                                                                      steps, clock))
    finally:
        os.environ.pop("SPECSERVE_ROW_ATTENTION", None)
        if saved is not None:
            os.environ["SPECSERVE_ROW_ATTENTION"] = saved
    med = {key: statistics.median(v) for key, v in ms.items()}
    names = ("sdpa per row", "native")
    print(f"{'CPU' if cpu_time else 'wall'} ms per forward after a {len(prompt)}-token prompt "
          f"({'sequences decoding one row each' if batch else 'rows of one verify chain'}), medians of {repeats} "
          f"alternating runs")
    print(f"{'rows':>5}" + "".join(f"{n:>14}" for n in names) + "".join(f" {n + ' / 1st':>20}" for n in names)
          + f" {'native / sdpa':>14}")
    for rows in rows_list:
        print(f"{rows:>5}" + "".join(f"{med[(n, rows)]:>14.2f}" for n in names)
              + "".join(f" {med[(n, rows)] / med[(n, rows_list[0])]:>20.2f}" for n in names)
              + f" {med[('native', rows)] / med[('sdpa per row', rows)]:>14.2f}")


def print_profile(path: str, quantization: str | None, rows_list: list[int], steps: int, gbs: float) -> list[dict]:
    results = profile_forwards(path, quantization, rows_list, steps)
    from workers.kernels.gguf_blocks import available

    packed = quantization != "none"
    floor_ms = (gguf_weight_bytes(path, packed, packed and available()) / (gbs * 1e9) * 1e3
                if path.endswith(".gguf") else 0)
    names = sorted({k for r in results for k in r["classes_ms"]}, key=lambda k: -results[0]["classes_ms"].get(k, 0))
    print(f"ms per forward (median of {steps}; classes: profiled self time); weight-bytes floor {floor_ms:.2f} ms "
          f"at {gbs:g} GB/s")
    print(f"{'':<30}" + "".join(f"{str(r['rows']) + ' row(s)':>12}" for r in results))
    print(f"{'wall':<30}" + "".join(f"{r['wall_ms']:>12.2f}" for r in results))
    for name in names:
        print(f"{name:<30}" + "".join(f"{r['classes_ms'].get(name, 0.0):>12.2f}" for r in results))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gguf_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", help="a *.gguf file or a short name (default: smollm2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (specserve, transformers)")
    ap.add_argument("--llama-cpp-threads", default="1,2",
                    help="llama.cpp n_threads, comma-separated: one llama_cpp row per value")
    ap.add_argument("--modes", default="specserve_fp32,specserve_q4,transformers,llama_cpp",
                    help="comma-separated; llama_cpp (alias llamacpp) needs pip install llama-cpp-python; "
                         "specserve_q4_torch: the 4-bit target without the native kernel; "
                         "specserve_q4_f32 / _q8: with it, float32 / 8-bit activations; specserve_shipped: "
                         "a packaged target with its default speculation (its shipped draft, adaptive)")
    ap.add_argument("--bandwidth-gbs", type=float, default=25.0, help="memory bandwidth for the floor")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="profile single forwards instead (module doc)")
    ap.add_argument("--profile-rows", default="1,5", help="chain rows per profiled forward, comma-separated")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--compare-kernels", action="store_true",
                    help="with --profile: time each forward with the row-invariant and the plain kernels instead")
    ap.add_argument("--quantization", default=None, help="for --profile: gguf (default for a Q4 file) or none")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="with --compare-kernels, a float checkpoint in this dtype (default: the engine's choice)")
    ap.add_argument("--compare-native", action="store_true", help="with --profile: native GGUF kernel vs torch's")
    ap.add_argument("--compare-glue", action="store_true",
                    help="with --profile: the 4-bit target's layers as torch ops vs glued native calls")
    ap.add_argument("--compare-attention", action="store_true",
                    help="with --profile: native row attention vs one SDPA call per query row, one model")
    ap.add_argument("--batch-rows", action="store_true",
                    help="with --compare-kernels: rows are one-row decode steps of that many sequences")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --compare-kernels / --compare-native: CPU time per forward instead of wall")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.target)
    if args.profile and args.compare_native:
        compare_native(path, [int(r) for r in args.profile_rows.split(",")], args.profile_steps, args.repeats,
                       args.cpu_time)
        return 0
    if args.profile and args.compare_glue:
        compare_glue(path, [int(r) for r in args.profile_rows.split(",")], args.profile_steps, args.repeats,
                     args.cpu_time)
        return 0
    if args.profile and args.compare_attention:
        compare_attention(path, args.quantization, [int(r) for r in args.profile_rows.split(",")],
                          args.profile_steps, args.repeats, args.dtype and getattr(torch, args.dtype),
                          args.batch_rows, args.cpu_time)
        return 0
    if args.profile and args.compare_kernels:
        compare_kernels(path, args.quantization, [int(r) for r in args.profile_rows.split(",")],
                        args.profile_steps, args.repeats, args.dtype and getattr(torch, args.dtype), args.batch_rows,
                        args.cpu_time)
        return 0
    if args.profile:
        rows = print_profile(path, args.quantization, [int(r) for r in args.profile_rows.split(",")],
                             args.profile_steps, args.bandwidth_gbs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "profile": rows}, f, indent=1)
        return 0
    from workers.loader import load_tokenizer

    tok = load_tokenizer(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    n = args.max_tokens
    runners: dict[str, tuple[Callable[[], int], int]] = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        if mode == "specserve_fp32":
            runners[mode] = specserve_runner(path, "none", prompt, n)
        elif mode == "specserve_q4":
            runners[mode] = specserve_runner(path, "gguf", prompt, n)
        elif mode == "specserve_q4_torch":  # the native kernel switched off: torch's int4 path, float32 head
            runners[mode] = specserve_runner(path, "gguf", prompt, n, native=False)
        elif mode == "specserve_q4_noglue":  # the native kernel, the layers as torch ops (no layer_glue.py)
            with mock.patch.dict(os.environ, {"SPECSERVE_LAYER_GLUE": "0"}):
                runners[mode] = specserve_runner(path, "gguf", prompt, n)
        elif mode in ("specserve_q4_f32", "specserve_q4_q8"):  # the native kernel with these activations
            runners[mode] = specserve_runner(path, "gguf", prompt, n, activations=mode.rpartition("_")[2])
        elif mode == "specserve_shipped":  # with speculation, as shipped (the target's default draft, adaptive)
            runners[mode] = shipped_runner(args.target, path, prompt, n)
        elif mode == "transformers":
            runners[mode] = hf_runner(path, prompt, n)
        elif mode in ("llama_cpp", "llamacpp"):
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama_cpp: not installed (pip install llama-cpp-python); skipped", flush=True)
                continue
            for threads in (int(t) for t in args.llama_cpp_threads.split(",")):
                runners[f"llama_cpp_t{threads}"] = llama_cpp_runner(path, prompt, n, threads)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        print(f"{mode}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    rates: dict[str, list[float]] = {}  # every run's tok/s: the median column
    for _ in range(args.repeats):
        for mode, (run, _) in runners.items():
            start, cpu = time.perf_counter(), time.process_time()
            tokens = run()
            best[mode] = max(best.get(mode, 0.0), tokens / (time.perf_counter() - start))
            best_cpu[mode] = max(best_cpu.get(mode, 0.0), tokens / (time.process_time() - cpu))
            rates.setdefault(mode, []).append(tokens / (time.perf_counter() - start))
    print(f"\nbatch 1, greedy, {n} tokens, {args.threads} torch thread(s) (llama_cpp_tN: N threads), "
          f"best of {args.repeats}; prompt {len(prompt)} "
          f"tokens; floor = weight bytes / {args.bandwidth_gbs:g} GB/s")
    print(f"{'mode':<20} {'tok/s':>7} {'median':>7} {'tok/cpu-s':>9} {'cpu ms/tok':>10} {'weights MB':>10} "
          f"{'floor ms':>9}")
    rows = []
    for mode, (_, nbytes) in runners.items():
        floor_ms = nbytes / (args.bandwidth_gbs * 1e9) * 1e3
        print(f"{mode:<20} {best[mode]:>7.1f} {statistics.median(rates[mode]):>7.1f} {best_cpu[mode]:>9.1f} "
              f"{1e3 / best_cpu[mode]:>10.2f} "
              f"{nbytes / 1e6:>10.1f} {floor_ms:>9.2f}")
        rows.append({"mode": mode, "tok_s": best[mode], "tok_s_median": statistics.median(rates[mode]),
                     "tok_per_cpu_s": best_cpu[mode], "weight_bytes": nbytes,
                     "floor_ms": floor_ms})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
