"""The native matmul on GGUF block weights (Q4_0, Q4_1, Q8_0): built on first use, checked, then loaded.

``block_matmul(x, blocks, qtype)`` computes y [M, N] = x [M, K] W^T with W kept in the file's own blocks, float32
activations and accumulation and exact dequantization (w = d q + m per 32 weights), each output element summed in
one fixed order whatever M, the row's neighbours and the thread count (gguf_blocks.cpp says how). It reads each
weight row once for all M rows, so a 5-row verify pays the weight bytes of a one-row step.

``block_matmul_q8(x, pack_q8(blocks, qtype), qtype, n)`` (gguf_q8.cpp, ``KernelConfig.gguf_activations = "q8"``)
quantizes each row's activations per 32-block to 8 bits as llama.cpp does for these formats and takes exact integer
dot products (AVX-512 VNNI; a scalar path defines the bits) on weights repacked 16 output columns to a register:
~0.6x the float32 path's step and cost per extra row, row-invariant the same way, another model than float32
activations.

Build: ``g++`` compiles gguf_blocks.cpp and gguf_q8.cpp against torch's headers and libraries into one plain shared
library of torch operators (no pybind, no ninja, no Python headers), cached in the user cache directory keyed by
the sources,
torch's version and the compiler; the threads are torch's own (``at::parallel_for`` on torch's OpenMP runtime,
the ``libgomp.so.1`` torch has loaded), never a second team. Before the library is first loaded into this process,
a subprocess loads it and checks it (exact dequantization, results against a float64 reference, a row alone ==
the row inside M rows) on this CPU, so a crash or an illegal instruction can only kill that subprocess; a pass
is remembered per library and CPU. Where anything fails (no compiler, a build error, a failed check) the engine
logs why once and the callers keep torch's path (workers/quantized_linear.py). ``python -m
workers.kernels.gguf_blocks`` builds and checks ahead of time (a warm step; it prints the library's path).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_blocks.cpp")  # float32 activations
# + 8-bit activations, the layers' small ops, row attention: one library
SOURCES = [SOURCE, *(SOURCE.with_name(f) for f in ("gguf_q8.cpp", "layer_glue.cpp", "row_attention.cpp"))]
HEADER = SOURCE.with_name("gguf_blocks.h")  # what both share
ACTIVATIONS = ("f32", "q8")  # KernelConfig.gguf_activations
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml's type ids, as the kernel takes them
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # bytes per 32-weight block
# "skewed": the M-dependent test-only variant; "avx512vnni": the "q8" path (the float32 path runs its AVX-512 code)
ISA = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3, "skewed": 99}
BUILD_TIMEOUT_S = 300  # one g++ run (~20-40 s on a loaded 2-core machine)
CHECK_TIMEOUT_S = 120  # the subprocess check, torch's import included
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-w"]


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("SPECSERVE_KERNEL_CACHE") or user_cache_dir("specserve")) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    sources = b"".join(p.read_bytes() for p in [*SOURCES, HEADER])
    key = hashlib.sha256(sources + torch.__version__.encode() + version.encode()
                         + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"gguf_blocks-{key}.so"


def build() -> Path:
    """The compiled library (built now unless cached); raises with the compiler's message when it cannot."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++ / c++ / $CXX)")
    lib = _library_path(cxx)
    if lib.exists():
        return lib
    from torch.utils.cpp_extension import include_paths, library_paths

    lib.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libdirs = library_paths()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
               *map(str, SOURCES),
               "-o", str(out), *(f"-L{p}" for p in libdirs), *(f"-Wl,-rpath,{p}" for p in libdirs),
               "-lc10", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent builder's library is as good as ours
    return lib


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = os.uname().machine
    return hashlib.sha256(info.encode()).hexdigest()[:12]


def check_in_subprocess(lib: Path, module: str = "workers.kernels.gguf_blocks", tag: str = "ok") -> None:
    """Raise unless a subprocess (``python -m MODULE --check LIB``) loaded ``lib`` and its checks passed on this CPU
    (remembered per library and CPU by a marker beside it, named with ``tag``): a crash or a wrong bit there only
    fails that subprocess."""
    marker = lib.with_name(f"{lib.name}.{tag}-{_cpu_key()}")
    if marker.exists():
        return
    done = subprocess.run([sys.executable, "-m", module, "--check", str(lib)],
                          capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                          cwd=str(Path(__file__).resolve().parents[2]))
    if done.returncode != 0:
        raise RuntimeError(f"the kernel's check failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-1500:]}")
    marker.touch()


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the native kernel is built, checked and loaded (False once, with one warning, when it is not)."""
    if os.environ.get("SPECSERVE_GGUF_KERNEL", "1") == "0":
        return False
    try:
        lib = build()
        check_in_subprocess(lib)
        torch.ops.load_library(str(lib))
    except Exception as e:  # noqa: BLE001 - any failure means the torch path, said once
        log.warning("GGUF block kernel unavailable, using torch's int4 path and float32 head: %s", e)
        return False
    return True


def block_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, isa: str = "auto",
                 activations: str = "f32") -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W = ``blocks`` [N, K / 32 * block bytes] uint8 of ``qtype``;
    ``activations`` "q8": x quantized per row and 32-block to 8 bits (packs the blocks first: tests, one-offs)."""
    if activations == "q8":
        return block_matmul_q8(x, pack_q8(blocks, qtype), qtype, blocks.shape[0], isa)
    return torch.ops.specserve_gguf.mm(x, blocks, qtype, -1 if isa == "auto" else ISA[isa])


def held_matmul(x: torch.Tensor, held: torch.Tensor, qtype: int, n: int, activations: str) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, n] float32, W ``held`` as the engine keeps it: the file's blocks ("f32"), or
    packed by ``pack_q8`` ("q8")."""
    if activations == "q8":
        return block_matmul_q8(x, held, qtype, n)
    return block_matmul(x, held, qtype)


def pack_q8(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """File blocks [N, bytes] -> the "q8" kernel's layout [ceil(N / 16), K / 32, bytes] uint8 (gguf_q8.cpp)."""
    return torch.ops.specserve_gguf.pack_q8(blocks, qtype)


def block_matmul_q8(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, isa: str = "auto") -> torch.Tensor:
    """x [M, K] float32, quantized per row and 32-block to 8 bits, @ W^T -> [M, n] float32 (W packed by pack_q8)."""
    if isa == "auto":
        isa = "avx512vnni" if best_isa() == "avx512vnni" else "scalar"
    return torch.ops.specserve_gguf.mm_q8(x, packed, qtype, n, ISA[isa])


def q8_isas() -> list[str]:
    """The paths the "q8" activations run on here (the scalar one everywhere; it defines the bits)."""
    return ["scalar", "avx512vnni"] if best_isa() == "avx512vnni" else ["scalar"]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K] int8, d [M, K / 32] float32) as the "q8" kernel quantizes it."""
    return torch.ops.specserve_gguf.quantize_q8(x)


def quantize_activations_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> d q [M, K] float32 by torch ops: the "q8" activations, independently (d = max|x| / 127
    rounded to float16, q = round-half-even(x / d))."""
    b = x.reshape(x.shape[0], -1, 32)  # [M, G, 32]
    d = b.abs().amax(-1, keepdim=True) / 127  # [M, G, 1]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127)
    return (d.half().float() * q).reshape(x.shape)


def block_rows(blocks: torch.Tensor, ids: torch.Tensor, qtype: int) -> torch.Tensor:
    """Rows ``ids`` [T] of W, dequantized -> [T, K] float32 (an embedding lookup)."""
    return torch.ops.specserve_gguf.rows(blocks, ids, qtype)


@functools.lru_cache(maxsize=1)
def best_isa() -> str:
    return {v: k for k, v in ISA.items()}[torch.ops.specserve_gguf.best_isa()]


def dequantize_reference(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """blocks [N, B] uint8 -> W [N, K] float32 by torch ops (w = d q + m): the kernel's weights, independently."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])  # [N, G, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, G, 1]
    if qtype == QTYPES["Q8_0"]:
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [N, G, 32]
        return (d * q).reshape(n, -1)
    nib = b[..., 4:] if qtype == QTYPES["Q4_1"] else b[..., 2:]  # [N, G, 16]
    q = torch.cat([nib & 0x0F, nib >> 4], -1).float()  # [N, G, 32]
    if qtype == QTYPES["Q4_1"]:
        return (d * q + b[..., 2:4].contiguous().view(torch.float16).float()).reshape(n, -1)
    return (d * (q - 8)).reshape(n, -1)


def random_blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """Random valid blocks [N, K / 32 * block bytes] uint8 (scales ~0.01, finite)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    heads = 4 if qtype == QTYPES["Q4_1"] else 2
    scales = (torch.rand(n, k // 32, heads // 2, generator=g) * 0.02 - 0.01).half()  # d (and m)
    raw[..., :heads] = scales.view(torch.uint8).reshape(n, k // 32, heads)
    return raw.reshape(n, -1)


def self_check() -> None:
    """The checks the subprocess runs before the engine loads the library (raises AssertionError)."""
    g = torch.Generator().manual_seed(1)
    f32_isas = [i for i in ("scalar", "avx2", "avx512") if ISA[i] <= ISA[best_isa()]]
    for (name, qtype), acts in ((f, a) for f in QTYPES.items() for a in ACTIVATIONS):
        isas = q8_isas() if acts == "q8" else f32_isas
        blocks = random_blocks(43, 96, qtype)  # N = 43: passes of 4 and 2 weight rows and a lone one
        w = dequantize_reference(blocks, qtype)  # [43, 96]
        assert torch.equal(block_rows(blocks, torch.arange(43), qtype), w), f"{name}: dequantization"
        x = torch.randn(11, 96, generator=g)
        xa = quantize_activations_reference(x) if acts == "q8" else x
        ref = (xa.double() @ w.double().t()).float()
        for isa in isas:
            y = block_matmul(x, blocks, qtype, isa, acts)
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4, msg=f"{name} {acts} {isa}: values")
            for m in range(1, 11):
                assert torch.equal(block_matmul(x[m - 1:m + 1], blocks, qtype, isa, acts)[1], y[m]), \
                    f"{name} {acts} {isa}: rows"
            assert torch.equal(y, block_matmul(x, blocks, qtype, "scalar", acts)), f"{name} {acts} {isa}: paths differ"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        torch.ops.load_library(sys.argv[2])
        self_check()
        print(f"ok ({best_isa()})")
        return
    print(f"{build()}: {'checked and loaded' if available() else 'unavailable (see the warning)'}")


if __name__ == "__main__":
    main()
