"""Small where it runs: linear layers held as int8 / int4 codes in memory, not as fp32 weights on a grid.

``quantize_`` / ``apply_formats_`` round a weight onto a grid but keep it in fp32 (4 bytes a weight in RAM for a
weight stored in 1 or ½). ``PackedLinear`` holds only the codes (int8; int4 two to a byte; int3 as int4) and one fp32
scale per group. On a CPU with AVX-512 or AVX2 its eager fp32 calls that record no gradient go to ``cpu_kernel``, a C++
kernel (compiled on first use) that widens the codes inside the product, so no weight is built; for that the layer
holds codes and scales in blocks of 16 output rows. Otherwise (no such CPU or no compiler, traced calls, gradients,
bf16 compute) it rebuilds the weight of one layer at a time inside its forward, in eager inference into one buffer per
thread that every layer shares (``REUSE_WORKSPACE``; its size is the largest layer's weight, capped).

Why not torch's int kernels: ``aten._weight_int4pack_mm_for_cpu`` and ``aten._weight_int8pack_mm`` exist in the
pinned torch 2.13 CPU build, give exactly these products, and were measured 6-74x slower than the fp32 GEMM with
fp32 activations on this project's 2-core machines (benchmarks/history/2026-12-05-issue-46.md and
2026-12-07-issue-46-session10.md); unpacking the codes and calling the fp32 GEMM costs 1.07x the fp32 layer at
2048 rows and 1.6-2.2x at 8; ``cpu_kernel`` took 0.66-0.97x (13-640 rows, 1 thread). torchao was not used:
0.18.0 imports against the pinned torch, but its int4 weight-only path needs a further package (``mslk``).

The grid is ``comera_fx.quantize``'s: row-major groups of ``group_size`` weights with symmetric codes. A group that
divides the input width is a group of input features of one output channel; a group that is a multiple of it spans
whole rows (one scale per row, repeated). Other group sizes are refused.

``state_dict`` holds the portable form (the codes as ``comera_fx.quantize.pack`` stores them, the scales per group),
so ``save_tensorized`` / ``load_tensorized`` keep the layer packed (never building the fp32 weight on load).

``PackedTTLinear`` does the same for a ``TTLinear`` whose cores ``quantize_`` put on a grid: each core is held as
its stored codes and scales (exactly the bytes ``save_tensorized`` writes for it), the cores are dequantized on each
call (they are small: a rank-64 TT layer of MiniLM's 384 x 384 attention has 57 k core weights, the dense one 147 k),
all cores in one pass when they share a grid and whole groups, and the product runs the planner's inference plan,
as ``TTLinear`` does (a low-rank layer's eager calls: two ``cpu_kernel`` products where it runs). It never uses
``tt.merged``'s cached fp32 forms, which would hold fp32 factors larger than the codes.

``set_compute_dtype_(model, torch.bfloat16)`` (or ``"auto"``: bf16 where the CPU multiplies it natively) makes the
packed layers rebuild their weights in bf16 and multiply in bf16 (fp32 accumulation, fp32 output) for calls of at
least ``linear.LOW_PRECISION_MIN_ROWS`` tokens (``tt.LOW_PRECISION_MIN_ROWS`` for TT layers); the default
multiplies in the input's dtype (fp32: exact products of the stored weights).

The package: ``cpu_kernel`` (the C++ kernel and its build), ``workspace`` (the shared per-thread buffers),
``linear`` (``PackedLinear``), ``tt``
(``PackedTTLinear``), ``convert`` (swapping modules in a model, and the save / load manifests), ``compute`` (the
compute dtype).
"""

from .compute import bf16_native, set_compute_dtype_
from .convert import (
    install_packed,
    pack_linears_,
    packed_from_quantized,
    packed_manifest,
    packed_modules,
    packed_tt_from_quantized,
    packed_tt_manifest,
)
from .linear import SCALES_SUFFIX, PackedLinear, kernel_group, packable, reference_weight
from .tt import PackedTTLinear, dequantize_stored, tt_core_specs
from .workspace import workspace_bytes

__all__ = [
    "SCALES_SUFFIX",
    "PackedLinear",
    "PackedTTLinear",
    "bf16_native",
    "dequantize_stored",
    "install_packed",
    "kernel_group",
    "pack_linears_",
    "packable",
    "packed_from_quantized",
    "packed_manifest",
    "packed_modules",
    "packed_tt_from_quantized",
    "packed_tt_manifest",
    "reference_weight",
    "set_compute_dtype_",
    "tt_core_specs",
    "workspace_bytes",
]
