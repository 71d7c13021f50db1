"""The budget schedule's prune decision: the ranks every layer keeps, from the bonds' measured importance.

Each layer's rank directions get an importance (``importance.slice_importance``: the bond's sensitivity split by
its singular values) and a floor (``min_rank``; 0 with the reason when the layer may go to rank 0); ``allocate``
then removes, across all layers at once, the directions with the least importance per parameter freed until the
size fits. Nothing here changes a tensor: ``RankAdaptive`` rounds the matrices to the ranks decided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..tt.inventory import MatrixEntry
from ..tt.layers import TTMatrix
from .importance import slice_importance
from .rank_config import BudgetConfig
from .schedule import LayerSlices, allocate
from .shrink import bond_singular_values


def _mids(tt: TTMatrix) -> tuple[int, ...]:
    return tuple(math.prod(core.shape[1:-1]) for core in tt.cores)


def floor_of(importance: float, mean: float, config: BudgetConfig) -> tuple[int, str]:
    """A layer's rank floor, and why it is 0 when it is ("" otherwise): ``min_rank``, unless ``min_rank=0`` or the
    layer's importance is below ``rank0_below`` × the mean layer importance."""
    if config.min_rank == 0:
        return 0, f"min_rank=0 (importance {importance:.3g}, mean layer importance {mean:.3g})"
    if config.rank0_below > 0 and importance < config.rank0_below * mean:
        return 0, (
            f"importance {importance:.3g} < rank0_below {config.rank0_below:g} × mean layer importance {mean:.3g}"
        )
    return config.min_rank, ""


def plan_prune(
    entries: Sequence[MatrixEntry],
    sensitivity: dict[str, Sequence[float]],
    layer_importance: dict[str, float],
    config: BudgetConfig,
    size: float,
    fixed: int,
) -> tuple[list[list[int]], dict[str, str]]:
    """The internal ranks each of ``entries`` keeps so that the TT size (plus ``fixed``, the matrices not pruned)
    is <= ``size``, or every bond is at its floor; and, per layer allowed to go to rank 0, the reason."""
    mean = sum(layer_importance.values()) / max(len(entries), 1)
    layers, reasons = [], {}
    for m in entries:
        floor, why = floor_of(layer_importance[m.name], mean, config)
        if why:
            reasons[m.name] = why
        sigmas = [sig.tolist() for sig in bond_singular_values(m.tt)]
        ranks = m.tt.live_layout.internal_ranks
        importance = tuple(slice_importance(s, sig, r) for s, sig, r in zip(sensitivity[m.name], sigmas, ranks))
        layers.append(LayerSlices(_mids(m.tt), importance, floor))
    return [[len(kept) for kept in keep] for keep in allocate(layers, size, fixed)], reasons
