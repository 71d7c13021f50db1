"""Which dtype packed layers multiply in: fp32 (exact products of the stored weights) or bf16 where the CPU has it.

A packed layer rebuilds its weight from the codes on every call; in fp32 the rebuilt weight and the GEMM cost at
least the fp32 layer's GEMM. The codes (at most 8 bits) are exact in bf16, and on CPUs with AMX (Intel Sapphire
Rapids and later) a bf16 GEMM ran 3.3x (13 tokens) to 7x (640 tokens) faster than fp32 for MiniLM's 1536 x 384
layers, with half the bytes to rebuild (benchmarks/history/2026-12-06-issue-46-session9.md). On CPUs without bf16
instructions (AVX2 only) the same GEMM is emulated and slower: ``"auto"`` keeps fp32 there.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import PackedLinear
from .tt import PackedTTLinear

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX-512 BF16): where ``"auto"`` picks bf16."""
    cpu = torch.cpu
    return bool(cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported())


def set_compute_dtype_(model: nn.Module, dtype: torch.dtype | str | None) -> torch.dtype | None:
    """Make every packed layer of ``model`` run its GEMM in ``dtype`` and return the dtype set.

    ``torch.bfloat16`` / ``torch.float16``: in calls of at least ``linear.LOW_PRECISION_MIN_ROWS`` tokens (64;
    ``tt.LOW_PRECISION_MIN_ROWS``, 384, for TT / low-rank layers: below them bf16 measured slower) each layer's
    input is rounded to it, the rebuilt weight is in it (the codes exactly; where a row has several groups, the
    scale and its product with the code each rounded), the products accumulate in fp32 and the output (rounded to
    ``dtype``) comes back in the input's dtype, bias and per-row scale applied in it: with bf16 about 3e-3 of the
    output's norm (2^-9 per rounding), far below the int4 grid's error. ``None``: the input's dtype (fp32: the
    exact products of the stored weights; the default). ``"auto"``: bf16 if ``bf16_native()``, else None. The rest
    of the model is untouched; the setting is not in the ``state_dict`` (set it again after ``load_tensorized``)."""
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ValueError(f'dtype must be torch.bfloat16, torch.float16, None or "auto"; got {dtype!r}')
        dtype = torch.bfloat16 if bf16_native() else None
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f'dtype must be torch.bfloat16, torch.float16, None or "auto"; got {dtype!r}')
    layers = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedTTLinear))]
    if not layers:
        raise ValueError(
            "the model has no packed layer (PackedLinear / PackedTTLinear): pack it first "
            "(comera_fx.packed.pack_linears_, compress_ with DistillConfig(pack=True), or load_tensorized)"
        )
    for layer in layers:
        if dtype is None:
            layer.__dict__.pop("compute_dtype", None)
        else:
            layer.compute_dtype = dtype
    return dtype
