"""Optional Triton fast paths for TT-matrix embedding lookups, gated core merges and the low-rank chain of a TT
linear, with an aten fallback.

Entry points (same results as the functions of ``comera_fx.tt.ops`` they replace)::

    take_rows(index, cores, layout, gates=None, dedup=False)      # ops.take_rows(index, gate_cores(...), layout)
    gated_ttm_merge(cores, gates, row_modes, col_modes, ranks)    # ops.ttm_merge(gate_cores(...) ...)
    lowrank_product(x, left, right, bias=None)                     # x @ left @ right + bias
    tt_chain_product(x, cores, layout, op, bias=None)              # a TT-format matrix's product via the above

The fused merge is off by default (``FUSED_MERGE``; aten's gate + merge was faster on an H200); pass
``fused=True`` to run it. TT linears use the fused chain only with ``FUSED_CHAIN`` on (not yet timed on a GPU).

Each call picks a path with ``kernel_path``: the Triton kernels (registered as ``torch.library.triton_op`` ops
``comera_fx::ttm_lookup`` / ``ttm_lookup_backward`` / ``gated_merge`` / ``lowrank_chain``, so Inductor sees and
inlines them) run when triton imports and every tensor is on CUDA, or, for tests, on CPU under
``TRITON_INTERPRET=1``. Everywhere else
(CPU, no triton, unsupported dtype or layout, ``ENABLED = False`` / ``COMERA_FX_KERNELS=0``) the aten code of
``comera_fx.tt.ops`` runs. Importing this package imports neither triton nor the kernels: ``_load`` does that on
the first call that could use them. See docs/kernels.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..layout import TTFormat, TTLayout

__all__ = [
    "ENABLED",
    "FUSED_CHAIN",
    "FUSED_MERGE",
    "chain_applies",
    "gated_ttm_merge",
    "kernel_path",
    "lowrank_product",
    "take_rows",
    "triton_available",
    "tt_chain_product",
]

#: Master switch; also off when the environment sets COMERA_FX_KERNELS=0.
ENABLED = os.environ.get("COMERA_FX_KERNELS", "1") != "0"

#: Whether ``gated_ttm_merge`` runs its fused Triton kernel by default. Off: on an H200 the fused merge lost to
#: aten's gate + merge at both sizes timed (forward + backward of the two halves: 1.47 vs 1.16 ms for 32000×768
#: r 32, 1.24 vs 0.87 ms for 50257×1024 r 64; benchmarks/RESULTS.md, the H200 section). The lookup kernel stays.
FUSED_MERGE = False

#: Whether TT linears run ``x @ L @ R`` as the fused Triton chain (``tt_chain_product``) where it can run. Off until
#: a GPU timing shows it pays: it saves a launch forward and one backward per TT linear, which only matters where a
#: step is launch-bound, and no GPU has timed it yet (benchmarks/gpu_check.py does). Tests switch it on.
FUSED_CHAIN = False

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Beyond these half-chain sizes one (B_L × r)(r × B_R) GEMM per token no longer fits a few tiles; aten then runs.
_MAX_HALF_COLS = 4096
_MAX_RANK = 1024
# The fused chain holds a (64 × r) tile of x @ L in registers; _lowrank.MAX_RANK, kept here so that deciding
# never imports triton.
_MAX_CHAIN_RANK = 128

_impl: ModuleType | None = None
_chain_impl: ModuleType | None = None
_impl_error: str | None = None


def _load() -> ModuleType | None:
    """Import triton and define the ops, once; None (with the reason in ``_impl_error``) if that fails. Returns the
    lookup / merge module; the low-rank chain's module is ``_chain_impl``, loaded with it."""
    global _impl, _chain_impl, _impl_error
    if _impl is None and _impl_error is None:
        try:
            from . import _lowrank, _triton
        except Exception as exc:  # ImportError without triton; anything else triton raises on a broken install
            _impl_error = f"{type(exc).__name__}: {exc}"
        else:
            _impl, _chain_impl = _triton, _lowrank
    return _impl


def triton_available() -> bool:
    """Whether triton imports and the kernels are defined (imports triton on first call)."""
    return _load() is not None


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@torch.compiler.assume_constant_result
def _path_for_device(device_type: str) -> str:
    """'triton' or 'aten' for tensors of this device type; a trace-time constant under torch.compile."""
    if not ENABLED:
        return "aten"
    if device_type == "cuda":
        return "triton" if _load() is not None else "aten"
    if device_type == "cpu" and _interpret_requested():
        impl = _load()  # CPU tensors only work if triton was imported in interpret mode
        return "triton" if impl is not None and impl.interpreted() else "aten"
    return "aten"


def kernel_path(*tensors: Tensor) -> str:
    """'triton' when the kernels can run on these tensors, else 'aten'."""
    devices = {t.device.type for t in tensors}
    if len(devices) != 1 or any(t.is_floating_point() and t.dtype not in _SUPPORTED_DTYPES for t in tensors):
        return "aten"
    return _path_for_device(devices.pop())


# ------------------------------------------------------------------------------------------ low-rank chain


def chain_applies(x: Tensor, cores: Sequence[Tensor], layout: TTLayout, *, fused: bool | None = None) -> bool:
    """Whether a TT product of ``layout`` on ``x`` runs as the fused chain: ``FUSED_CHAIN`` (or ``fused``), the TT
    format (row cores then column cores, so the chain is ``x @ L @ R``), a middle rank the kernel holds in
    registers, and the Triton path for these tensors."""
    if not (FUSED_CHAIN if fused is None else fused) or layout.format is not TTFormat.TT:
        return False
    return layout.ranks[len(layout.row_modes)] <= _MAX_CHAIN_RANK and kernel_path(x, *cores) == "triton"


def tt_chain_product(x: Tensor, cores: Sequence[Tensor], layout: TTLayout, op: str, bias: Tensor | None = None):
    """``x @ M`` (op "matmul") or ``x @ Mᵀ`` ("matmul_t") (+ bias) of a TT-format matrix with (gated) ``cores``:
    each half of the chain merged by aten (weight-sized, batch-free), then ``lowrank_product``."""
    left, right = ops.tt_factors(cores, layout)
    if op == "matmul_t":
        left, right = right.t(), left.t()
    elif op != "matmul":
        raise ValueError(f"op must be 'matmul' or 'matmul_t', got {op!r}")
    return lowrank_product(x, left, right, bias)


def lowrank_product(x: Tensor, left: Tensor, right: Tensor, bias: Tensor | None = None, *, programs: int = 0):
    """``x @ left @ right (+ bias)`` over the last dim of ``x``: one fused Triton kernel (``comera_fx::lowrank_chain``)
    where the kernels run on these tensors and the rank fits, else aten's two GEMMs with the bias in the second.
    ``programs``: the least number of Triton programs (0: twice the device's multiprocessors)."""
    tensors = (x, left, right) + ((bias,) if bias is not None else ())
    same_dtype = len({t.dtype for t in tensors}) == 1
    if not same_dtype or left.shape[1] > _MAX_CHAIN_RANK or kernel_path(*tensors) != "triton":
        return F.linear(x @ left, right.t(), bias)
    _load()
    flat = x.reshape(-1, x.shape[-1])
    out, _ = _chain_impl.lowrank_chain(flat, left, right, bias, programs)
    return out.reshape(*x.shape[:-1], right.shape[1])


# ------------------------------------------------------------------------------------------- gated core merge


def gated_ttm_merge(
    cores: Sequence[Tensor],
    gates: Sequence[Tensor],
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    *,
    fused: bool | None = None,
) -> Tensor:
    """``ops.ttm_merge`` of the gated cores: core k is scaled by ``gates[k]`` on its right bond; ``gates`` has one
    entry per core, or one fewer (the last core ungated). Result (r_first, A, B, r_last) as ``ops.ttm_merge``.
    ``fused``: run the fused Triton kernel where it can run (default ``FUSED_MERGE``: off, aten was faster)."""
    if len(gates) not in (len(cores), len(cores) - 1):
        raise ValueError(f"{len(cores)} cores need {len(cores) - 1} or {len(cores)} gates, got {len(gates)}")
    if not (FUSED_MERGE if fused is None else fused) or kernel_path(*cores, *gates) != "triton":
        return ops.ttm_merge(_gate_chain(cores, gates), row_modes, col_modes, ranks)
    impl = _load()
    acc = cores[0]
    big_a, big_b = row_modes[0], col_modes[0]
    for k in range(1, len(cores)):
        a, b = row_modes[k], col_modes[k]
        # (r0·A·B, r_k)·diag(g_{k-1}) @ (r_k, a·b·r') stored as (r0, A, a, B, b·r'): one kernel, no gated copy.
        acc = impl.gated_merge(acc.reshape(-1, ranks[k]), gates[k - 1], cores[k].reshape(ranks[k], -1), big_b, a)
        big_a, big_b = big_a * a, big_b * b
    acc = acc.reshape(ranks[0], big_a, big_b, ranks[-1])
    if len(gates) == len(cores):  # the chain's own right bond (a half chain cut at a gated bond)
        acc = acc * gates[-1]
    return acc


def _gate_chain(cores: Sequence[Tensor], gates: Sequence[Tensor]) -> list[Tensor]:
    return [core * gate for core, gate in zip(cores, gates)] + list(cores[len(gates) :])


# ------------------------------------------------------------------------------------------------ row lookups


def take_rows(
    index: Tensor,
    cores: Sequence[Tensor],
    layout: TTLayout,
    gates: Sequence[Tensor] | None = None,
    *,
    dedup: bool = False,
) -> Tensor:
    """M[index] -> (*index.shape, cols), as ``ops.take_rows``, never building M.

    ``gates=None``: the cores are already gated (what ``ops.take_rows`` takes). With ``gates`` (one per internal
    bond), the cores are raw and the gates are folded in by the kernels (merge and lookup), never as a separate
    pass over the cores. ``dedup=True`` looks up each distinct id once (``torch.unique`` + inverse); skipped while
    compiling, where the number of distinct ids would be a data-dependent shape.
    """
    tensors = list(cores) + list(gates or [])
    use_kernel = (
        layout.format is TTFormat.TTM
        and len(layout.row_modes) > 1
        and kernel_path(*tensors) == "triton"
        and index.device == cores[0].device
        and not index.is_floating_point()
        and _lookup_fits(layout)
    )
    if not use_kernel:
        gated = cores if gates is None else ops.gate_cores(list(cores), list(gates), layout)
        if dedup and not torch.compiler.is_compiling() and index.numel() > 0:
            unique, inverse = torch.unique(index.reshape(-1), return_inverse=True)
            return ops.take_rows(unique, gated, layout)[inverse].reshape(index.shape + (layout.cols,))
        return ops.take_rows(index, gated, layout)
    impl = _load()
    d = len(layout.row_modes)
    h = (d + 1) // 2
    ranks, rows_m, cols_m = layout.ranks, layout.row_modes, layout.col_modes
    a_left, b_left = math.prod(rows_m[:h]), math.prod(cols_m[:h])
    a_right, b_right = math.prod(rows_m[h:]), math.prod(cols_m[h:])
    r = ranks[h]
    if gates is None:
        left = ops.ttm_merge(cores[:h], rows_m[:h], cols_m[:h], ranks[: h + 1])
        right = ops.ttm_merge(cores[h:], rows_m[h:], cols_m[h:], ranks[h:])
        middle = None
    else:  # gates[h-1] sits on the bond the lookup contracts: the lookup kernel applies it
        left = gated_ttm_merge(cores[:h], gates[: h - 1], rows_m[:h], cols_m[:h], ranks[: h + 1])
        right = gated_ttm_merge(cores[h:], gates[h:], rows_m[h:], cols_m[h:], ranks[h:])
        middle = gates[h - 1]
    left = left.reshape(a_left, b_left, r)
    right = right.reshape(r, a_right, b_right).permute(1, 0, 2)  # (A_R, r, B_R); the op makes it contiguous
    flat = index.reshape(-1)
    if dedup and not torch.compiler.is_compiling() and flat.numel() > 0:
        unique, inverse = torch.unique(flat, return_inverse=True)
        out = F.embedding(inverse, impl.ttm_lookup(unique, left, right, middle, layout.cols))
    else:
        out = impl.ttm_lookup(flat, left, right, middle, layout.cols)
    return out.reshape(index.shape + (layout.cols,))


def _lookup_fits(layout: TTLayout) -> bool:
    h = (len(layout.row_modes) + 1) // 2
    return (
        math.prod(layout.col_modes[:h]) <= _MAX_HALF_COLS
        and math.prod(layout.col_modes[h:]) <= _MAX_HALF_COLS
        and layout.ranks[h] <= _MAX_RANK
    )
