"""A C++ kernel that multiplies by int4 / int8 codes without rebuilding the weight (``cpu_kernel.cpp``).

Why: at few tokens a packed layer's weight rebuild costs as much as its GEMM (MiniLM's 8x student ran 1.09-1.16x
the fp32 teacher at batch 1, benchmarks/history/2026-12-06-issue-46-session9.md). The kernel widens each block of
16 rows' codes once per tile of tokens and multiplies in registers: on an AVX-512 CPU (Zen 4, 1 thread) it ran
0.66-0.97x the dense fp32 ``F.linear`` of the same weight at 13-640 tokens, and the 8x student encoded in 0.63-0.65x
the teacher's time at batch 1 (benchmarks/history/2026-12-07-issue-46-session10.md).

Built on first use with the system C++ compiler (the one Inductor uses; ``$CXX`` or ``c++``; about a second) into a
cache directory (``$COMERA_FX_KERNEL_CACHE``, else ``~/.cache/comera_fx``), keyed by the source, flags and compiler,
and called through ``ctypes``: an AVX-512 build, or an AVX2 one (``isa()``). Where the CPU has neither or the build
fails, ``library()`` is None (one warning names why) and the packed layers keep their rebuild path.
``COMERA_FX_CPU_KERNEL=0`` turns it off, ``=avx2`` picks the AVX2 build on an AVX-512 CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
#: -fopenmp: the library's parallel loops bind to libgomp.so.1, which torch has already loaded (its pool, its
#: thread count).
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp")
#: The two builds of the source, by the instruction set the CPU has (``torch.backends.cpu.get_cpu_capability``).
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mfma"), "avx2": ("-mavx2", "-mfma")}
#: Output rows a block of the kernel's layout holds (``PackedLinear`` holds codes and scales in such blocks).
ROW_BLOCK = 16
#: Whether packed layers call the kernel where it runs (False: their rebuild path, as on a CPU without AVX2).
USE_KERNEL = True

_lock = threading.Lock()
_state: dict = {}


def isa() -> str | None:
    """The build this process uses: "avx512" or "avx2" by the CPU, "avx2" on either where
    ``COMERA_FX_CPU_KERNEL=avx2``; None where ``USE_KERNEL`` is off, ``COMERA_FX_CPU_KERNEL=0``, or the CPU has
    neither (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can lower)."""
    setting = os.environ.get("COMERA_FX_CPU_KERNEL", "1")
    if not USE_KERNEL or setting == "0":
        return None
    found = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())
    return "avx2" if setting == "avx2" and found else found


def enabled() -> bool:
    """Whether the kernel may be used at all (``isa()``)."""
    return isa() is not None


def _cache_dir() -> Path:
    root = os.environ.get("COMERA_FX_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "comera_fx"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build(compiler: str, target: str) -> Path:
    """The shared library for this source, ``target``'s flags and compiler: from the cache, else compiled into it
    (written to a temporary name and renamed, so processes building at once never load a half-written file)."""
    flags = FLAGS + ISA_FLAGS[target]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, compiler, version]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"packed_{target}_{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        run = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
        os.replace(built, path)
    return path


def library() -> ctypes.CDLL | None:
    """The loaded kernel for ``isa()``, built on first call; None where ``isa()`` is None or the build failed
    (warned once, with the reason)."""
    target = isa()
    if target is None:
        return None
    if target in _state:
        return _state[target]
    with _lock:
        if target not in _state:
            _state[target] = _load(target)
    return _state[target]


#: The library's functions and their arguments (cpu_kernel.cpp), a letter each: i int, q int64, p pointer.
SIGNATURES = {
    "comera_packed_product": "ipqqppqqppqqqi",
    "comera_packed_unpack": "ipqpqiqqi",
    "comera_dense_product": "pqqpqppqi",
    "comera_packed_dequantize": "ipqpqp",
}
_C_TYPES = {"i": ctypes.c_int, "q": ctypes.c_int64, "p": ctypes.c_void_p}


def _load(target: str) -> ctypes.CDLL | None:
    compiler = _compiler()
    try:
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set $CXX)")
        lib = ctypes.CDLL(str(_build(compiler, target)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warnings.warn(
            f"comera_fx: the packed layers' CPU kernel is unavailable ({error}); they rebuild their weights "
            "instead (slower at few tokens). Set COMERA_FX_CPU_KERNEL=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    for name, letters in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = None
        function.argtypes = [_C_TYPES[letter] for letter in letters]
    return lib


#: The fewest multiply-adds (tokens x rows x features) a call needs for its tiles to be split over
#: ``torch.get_num_threads()`` threads; fewer run on the calling thread. Why: on 2 threads a 384 x 384 int4 layer
#: at 5 tokens (0.74 M) took 13 us split against 20 alone (dense fp32: 32), at 13 tokens 30 against 49.
PARALLEL_MIN_MACS = 500_000


def _threads(macs: int) -> int:
    """Threads for a call of ``macs`` multiply-adds (``PARALLEL_MIN_MACS``)."""
    return torch.get_num_threads() if macs >= PARALLEL_MIN_MACS else 1


def split_bias(bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(the bias for the kernel to add, the bias for the caller to add after): after, where autograd records the
    bias's gradient (the kernel is invisible to autograd), else inside as contiguous fp32."""
    if bias is None:
        return None, None
    if torch.is_grad_enabled() and bias.requires_grad:
        return None, bias
    return bias.detach().float().contiguous(), None


def product(
    lib: ctypes.CDLL, bits: int, x: Tensor, codes: Tensor, scales: Tensor, kgroup: int, bias: Tensor | None
) -> Tensor:
    """``x`` (tokens × K, contiguous fp32 on the CPU) times the weight of ``codes`` / ``scales`` in the blocked
    layout (``cpu_kernel.cpp``), plus ``bias``: a new (tokens × N) tensor; on ``torch.get_num_threads()`` threads
    from ``PARALLEL_MIN_MACS`` multiply-adds."""
    tokens, features = x.shape
    blocks = codes.shape[0]
    out = x.new_empty(tokens, blocks * ROW_BLOCK)
    lib.comera_packed_product(
        bits,
        x.data_ptr(),
        tokens,
        features,
        codes.data_ptr(),
        scales.data_ptr(),
        scales.shape[1],
        kgroup,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.shape[1],
        0,
        blocks,
        _threads(tokens * out.shape[1] * features),
    )
    return out


def can_unpack(bits: int, features: int, dtype: torch.dtype) -> bool:
    """Whether ``unpack`` takes a layer of ``bits`` and ``features`` inputs into ``dtype``."""
    width = features // 2 if bits == 4 else features
    return width % 16 == 0 and dtype in (torch.float32, torch.bfloat16)


def unpack(
    lib: ctypes.CDLL, bits: int, codes: Tensor, features: int, out: Tensor, first: int, last: int, halves: int = 0
) -> Tensor:
    """Row blocks ``first:last`` of blocked ``codes`` as floats into ``out`` (their rows; fp32 or bf16, columns
    contiguous): ``PackedLinear._code_grid``'s values (``halves`` 1 / 2: only the low / high int4 codes),
    transposed out of the blocks in registers. Why: ATen's strided byte copies out of the blocks took 2-4x longer
    than the rebuild from codes held row by row (benchmarks/history/2026-12-07-issue-46-session10.md)."""
    if out.stride(1) != 1:
        raise ValueError("unpack writes rows with contiguous columns")
    lib.comera_packed_unpack(
        bits,
        codes.data_ptr(),
        features,
        out.data_ptr(),
        out.stride(0),
        out.dtype == torch.bfloat16,
        first,
        last,
        halves,
    )
    return out


def dequantize(lib: ctypes.CDLL, bits: int, codes: Tensor, scales: Tensor, group: int, out: Tensor) -> Tensor:
    """``pack``'s stored ``codes`` (uint8 bytes; int8 codes viewed as bytes) times ``scales`` (fp32, one per
    ``group`` codes) into ``out`` (contiguous fp32, its numel codes; a multiple of 16, as ``group``): one pass
    where ATen took four (``PackedTTLinear``'s dequantized cores)."""
    if out.numel() % 16 or group % 16 or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("dequantize writes a contiguous fp32 tensor of whole groups of a multiple of 16")
    lib.comera_packed_dequantize(bits, codes.data_ptr(), out.numel(), scales.data_ptr(), group, out.data_ptr())
    return out


def dense_product(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x`` (tokens × K) times ``weight`` (K × N, row-major; N a multiple of 16), plus ``bias``, all contiguous
    fp32 on the CPU: the kernel's tiles over a dense operand (``PackedTTLinear``'s low-rank products)."""
    tokens, features = x.shape
    columns = weight.shape[1]
    if weight.shape[0] != features or columns % ROW_BLOCK:
        raise ValueError(f"dense_product: {tuple(x.shape)} times {tuple(weight.shape)}")
    out = x.new_empty(tokens, columns)
    lib.comera_dense_product(
        x.data_ptr(),
        tokens,
        features,
        weight.data_ptr(),
        columns,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        columns,
        _threads(tokens * columns * features),
    )
    return out
