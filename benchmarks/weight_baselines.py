"""Weight bytes and weight fake-quantization of BERT encoders: the baselines bench_distill.py compares a compressed
model with at equal bytes. A benchmark helper: the library counts stored bytes with
``comera_fx.quantize.stored_bytes(model, prefix)``.

A user choosing how to shrink a pretrained encoder compares methods by the bytes its weights take, not by
parameter counts: int8 weights are 4x fewer bytes than fp32 at the same parameter count. These helpers count
the bytes of a model's weight matrices (dense fp32, low-rank factors, TT cores, and the same stored as int8 or
int4 with fp32 scales per group) and round weights to such a grid in place (fake-quantization: the model still
runs in float, with exactly the values the quantized storage would give), so the quality of each storage is
measured by the same evaluation code.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera_fx.quantize import fake_quant, quantized_bytes

ENCODER_PREFIX = "bert.encoder."  # the weights compared: a Hugging Face BERT's encoder layers


def encoder_weights(model: nn.Module, prefix: str = ENCODER_PREFIX) -> dict[str, Tensor]:
    """The weight tensors the compression methods act on: every parameter under ``prefix`` with two or more
    dimensions (dense linear weights, low-rank factors, TT cores); biases, LayerNorms and rank gates (1-D) are
    not counted (they are the same few KiB for every method)."""
    return {name: p for name, p in model.named_parameters() if name.startswith(prefix) and p.dim() >= 2}


def weight_bytes(
    model: nn.Module, bits: int = 32, group_size: int | None = None, prefix: str = ENCODER_PREFIX, per_row: bool = False
) -> int:
    """Bytes of the weights of ``encoder_weights(model, prefix)`` stored at ``bits`` bits with a scale per group
    of ``group_size`` (``per_row``: one scale per row of the tensor viewed as (shape[0], -1), i.e. per output
    channel of a linear weight)."""
    total = 0
    for p in encoder_weights(model, prefix).values():
        group = p[0].numel() if per_row else group_size
        total += quantized_bytes(p.numel(), bits, group)
    return total


@torch.no_grad()
def fake_quant_(
    model: nn.Module, bits: int, group_size: int | None = None, prefix: str = ENCODER_PREFIX, per_row: bool = False
) -> nn.Module:
    """``fake_quant`` every tensor of ``encoder_weights(model, prefix)`` in place (grouping as in
    ``weight_bytes``); returns ``model``."""
    for p in encoder_weights(model, prefix).values():
        p.copy_(fake_quant(p, bits, p[0].numel() if per_row else group_size))
    return model
