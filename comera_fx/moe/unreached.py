"""Zero gradients for the experts a forward did not reach.

A forward that runs only the routed experts (``TTExperts``' loop, a weight-space module reading ``P[e]`` through a
``LazyBank``) leaves the other experts' cores out of the autograd graph, so they get no gradient (None), where
the dense model's 3D weight got one with zero rows for them. Code that expects a gradient for every parameter at
every step then fails on the converted model though it ran on the dense one: ``DistributedDataParallel`` at its
defaults (``find_unused_parameters=False``) stops at the next iteration ("Expected to have finished reduction in
the prior iteration ...") as soon as one rank's batch misses an expert. ``tie_unreached`` makes those cores part
of the graph: the output is unchanged, and the backward gives each a zero gradient, as the dense weight does.
``RankAdaptive`` reads a zero gradient as it reads a missing one (the expert keeps its ranks, docs/moe.md).

Compiled code ties them too (Dynamo traces the Function); a compiled weight-space module reads the whole bank,
so every expert is in its graph anyway.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class _ZeroGradients(torch.autograd.Function):
    """y = x; the backward gives every other input a zero gradient."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.save_for_backward(*params)
        return x.detach()  # the same memory, and not a view: the caller may modify it in place (plan.autograd)

    @staticmethod
    def backward(ctx, dy):
        return (dy, *(torch.zeros_like(p) for p in ctx.saved_tensors))


def tie_unreached(out, params: Iterable[Tensor]):
    """``out`` (a tensor, or a tuple / list whose first tensor is tied) with ``params`` in its autograd graph, each
    getting a zero gradient; ``out`` itself when grad is off or nothing requires grad."""
    params = [p for p in params if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return out
    if isinstance(out, Tensor):
        return _ZeroGradients.apply(out, *params)
    if isinstance(out, (tuple, list)):
        for i, item in enumerate(out):
            if isinstance(item, Tensor) and item.is_floating_point():
                items = list(out)
                items[i] = _ZeroGradients.apply(item, *params)
                return type(out)(items) if type(out) in (tuple, list) else out
    return out


def expert_parameters(bank, experts: set[int]) -> list[Tensor]:
    """The parameters of ``bank`` (a ``TTExpertBank`` or ``SharedTTExpertBank``) that only ``experts`` read: their
    own cores and gates; a shared chain's only when it is all of them (any expert reaches the whole chain)."""
    from .bank import TTExpertBank

    if isinstance(bank, TTExpertBank):
        return [p for e in sorted(experts) for p in bank[e].parameters()]
    return list(bank.parameters()) if len(experts) == len(bank) else []
