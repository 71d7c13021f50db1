"""The reviewers' baselines for RMM, for benchmarks only: other ways to shrink what a linear layer saves for backward.

Both keep the forward exact and the input gradient exact (dX = dY·W); only the weight gradient uses the compressed
copy of the input x (tokens × features, leading dims flattened):

* ``TopKLinearFunction`` (DropIT-style): keep the k largest |x| entries of the whole input (values fp32 + int32 flat
  indices, 8 bytes per kept entry), zeros elsewhere; dW = dYᵀ·x̃ (biased: small entries are dropped, not rescaled).
  At a saved-bytes budget of ρ × the exact input, k = ρ/2 × numel.
* ``Int8LinearFunction``: x quantized per token (row) to int8 with an absmax scale (round to nearest), 1 byte per
  entry + 4 per row, ≈ 0.25 × the exact input; dW = dYᵀ·dequant(x).

``CompressedLinear`` wraps an existing ``nn.Linear`` (same parameters) with one of them; ``compress_linears_``
swaps the modules a filter picks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, keep_fraction: float):
        x2 = x.reshape(-1, x.shape[-1])
        k = max(1, int(keep_fraction * x2.numel()))
        flat = x2.reshape(-1)
        idx = flat.abs().topk(k, sorted=False).indices
        ctx.save_for_backward(flat[idx].contiguous(), idx.to(torch.int32), weight)
        ctx.x_shape = tuple(x2.shape)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        values, idx, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).reshape(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            sparse = torch.zeros(ctx.x_shape[0] * ctx.x_shape[1], dtype=values.dtype, device=values.device)
            sparse[idx.long()] = values
            dw = dy2.t() @ sparse.view(ctx.x_shape)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class Int8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        scale = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(x2 / scale).clamp_(-127, 127).to(torch.int8)
        ctx.save_for_backward(q, scale.to(torch.float32), weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        q, scale, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).reshape(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ (q.to(dy2.dtype) * scale.to(dy2.dtype)) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class CompressedLinear(nn.Module):
    """An ``nn.Linear``'s parameters with a compressed saved input: ``method`` "topk" (``budget`` = saved bytes as a
    fraction of the exact input's) or "int8"."""

    def __init__(self, linear: nn.Linear, method: str, budget: float | None = None):
        super().__init__()
        if method not in ("topk", "int8"):
            raise ValueError(f"method must be 'topk' or 'int8', got {method!r}")
        if method == "topk" and not (budget and 0 < budget <= 1):
            raise ValueError(f"topk needs budget in (0, 1] (saved bytes / exact input bytes), got {budget!r}")
        self.weight, self.bias = linear.weight, linear.bias
        self.method, self.budget = method, budget

    def forward(self, x):
        if not (torch.is_grad_enabled() and self.training):
            return F.linear(x, self.weight, self.bias)
        if self.method == "topk":
            return TopKLinearFunction.apply(x, self.weight, self.bias, self.budget / 2)  # 8 bytes per kept entry
        return Int8LinearFunction.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, method={self.method}, budget={self.budget}"


def compress_linears_(model: nn.Module, method: str, budget: float | None, filter_fn) -> list[str]:
    """Replace every ``nn.Linear`` that ``filter_fn(module, fqn)`` accepts; returns their FQNs."""
    targets = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and filter_fn(m, fqn)]
    for fqn, module in targets:
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child,
                CompressedLinear(module, method, budget))
    return [fqn for fqn, _ in targets]
