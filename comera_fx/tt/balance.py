"""Rescale the cores of a TT chain to one entry size without changing the matrix they represent.

Why: (whitened) TT-SVD leaves every core but one orthonormal, entries about 1/sqrt(its size), and puts the whole
norm of the weight into the remaining core. AdamW moves every entry by about the learning rate whatever its size,
so per step the orthonormal cores change by a far larger share of themselves than the core holding the norm: the
product's update is dominated by a few cores (for a low-rank product x·L·R of a 384 × 1536 weight, R's entries are
~1/40, L's ~10× larger). Scaling core k by α_k with ∏ α_k = 1 leaves the product, the gates and every per-group
int grid (scales follow the absolute maximum) as they were, and equal RMS entries give every core the same relative
step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def balancing_factors(rms: Sequence[float]) -> list[float]:
    """α_k with ∏ α_k = 1 and α_k · rms_k the same for every k (their geometric mean). A zero entry size (an
    all-zero core: the product is zero whatever the others hold) leaves every factor at 1."""
    if not rms:
        return []
    if any(not math.isfinite(r) or r < 0 for r in rms):
        raise ValueError(f"entry sizes must be finite and >= 0; got {list(rms)}")
    if min(rms) == 0:
        return [1.0] * len(rms)
    target = math.exp(sum(math.log(r) for r in rms) / len(rms))
    return [target / r for r in rms]


@torch.no_grad()
def balance_cores_(model: nn.Module) -> int:
    """Rescale the cores of every TT matrix in ``model`` (modules with ``cores`` and ``gates`` parameter lists) in
    place to one RMS entry per chain (``balancing_factors``); the matrices are unchanged up to float rounding.
    Returns how many chains were rescaled. Meant for a student about to be trained; ``compress_`` does not call it
    (in the 8× and 16× MiniLM runs of 2026-12-06 it tied the unbalanced start: benchmarks/history). Optimizer state
    of the cores, if any, no longer fits them."""
    count = 0
    for module in model.modules():
        cores = getattr(module, "cores", None)
        if not isinstance(cores, nn.ParameterList) or not isinstance(getattr(module, "gates", None), nn.ParameterList):
            continue
        tensors = list(cores)
        if len(tensors) < 2:
            continue
        rms = [float(c.detach().double().pow(2).mean().sqrt()) for c in tensors]
        factors = balancing_factors(rms)
        if all(f == 1.0 for f in factors):
            continue
        for core, factor in zip(tensors, factors):
            core.mul_(factor)
        count += 1
    return count
