"""The budget schedule of ``RankAdaptive`` (its default): pure integer and float math, no tensors.

Three phases over a horizon measured as progress p ∈ [0, 1] (steps done / ``total_steps``, or seconds /
``budget_seconds``), as AdaLoRA's budget schedule:

* warm-up, p ≤ p_i = ``warmup``: the size stays at S_0 (importance is measured, nothing is removed);
* decay, p_i < p < p_e = 1 − ``final``: S(p) = S_T + (S_0 − S_T) · (1 − (p − p_i) / (p_e − p_i))³;
* final window, p ≥ p_e: S = S_T; the model fine-tunes at its final ranks.

Pruning happens at ``prunes`` points p_k = p_i + k · (p_e − p_i) / prunes, k = 1 … prunes (the last one is p_e,
where the budget is S_T). ``allocate`` decides which rank slices go: greedily the one with the least importance
per parameter it frees, across every layer at once, until the size is within the budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WARMUP, DECAY, FINAL = "warmup", "decay", "final"


@dataclass(frozen=True)
class BudgetSchedule:
    """S(p) from ``initial`` (S_0) to ``target`` (S_T) in parameters; ``warmup`` and ``final`` are fractions of
    the horizon; ``prunes`` points in the decay window."""

    initial: float
    target: float
    warmup: float = 0.1
    final: float = 0.2
    prunes: int = 10

    def __post_init__(self) -> None:
        for name in ("warmup", "final"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"RankAdaptive: {name}_fraction must be a float in [0, 1); got {value!r}")
        if self.warmup + self.final >= 1:
            raise ValueError(
                f"RankAdaptive: warmup_fraction + final_fraction must be < 1 (the decay needs a "
                f"window); got {self.warmup} + {self.final}"
            )
        if not (isinstance(self.prunes, int) and not isinstance(self.prunes, bool) and self.prunes >= 1):
            raise ValueError(f"RankAdaptive: prunes must be an int >= 1; got {self.prunes!r}")

    @property
    def decay_start(self) -> float:
        return self.warmup

    @property
    def decay_end(self) -> float:
        return 1.0 - self.final

    def budget(self, progress: float) -> float:
        """The scheduled size S(p)."""
        p_i, p_e = self.decay_start, self.decay_end
        if progress <= p_i:
            return float(self.initial)
        if progress >= p_e:
            return float(self.target)
        x = (progress - p_i) / (p_e - p_i)
        return self.target + (self.initial - self.target) * (1.0 - x) ** 3

    def phase(self, progress: float) -> str:
        if progress <= self.decay_start:
            return WARMUP
        return DECAY if progress < self.decay_end else FINAL

    def prune_points(self) -> tuple[float, ...]:
        """p_1 < … < p_prunes = p_e."""
        p_i, p_e = self.decay_start, self.decay_end
        return tuple(
            p_e if k == self.prunes else p_i + (p_e - p_i) * k / self.prunes for k in range(1, self.prunes + 1)
        )

    def prune_steps(self, total_steps: int) -> tuple[int, ...]:
        """With a horizon in steps: the steps (counted from 1) at which the prune points are first reached
        (p = step / total_steps >= p_k); points that fall on the same step are pruned once."""
        return tuple(sorted({max(1, math.ceil(p * total_steps - 1e-9)) for p in self.prune_points()}))


# ---------------------------------------------------------------------------------------------------- allocation


def tt_size(mids: Sequence[int], internal_ranks: Sequence[int]) -> int:
    """Cores + gates of a TT chain whose core k holds mids[k] entries per (left rank, right rank) pair; 0 once a
    bond has rank 0 (the matrix is zero and every core is emptied)."""
    if any(r == 0 for r in internal_ranks):
        return 0
    ranks = (1, *internal_ranks, 1)
    return sum(ranks[k] * m * ranks[k + 1] for k, m in enumerate(mids)) + sum(internal_ranks)


@dataclass(frozen=True)
class LayerSlices:
    """One TT matrix as ``allocate`` sees it: ``mids[k]`` = the product of core k's mode sizes, and per internal
    bond the importance of each of its slices; no bond goes below ``floor`` slices (0: the matrix may be zeroed)."""

    mids: tuple[int, ...]
    importance: tuple[tuple[float, ...], ...]
    floor: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(len(imp) for imp in self.importance)


def allocate(layers: Sequence[LayerSlices], budget: float, fixed: int = 0) -> list[tuple[tuple[int, ...], ...]]:
    """Which slices to keep so that ``fixed`` + the layers' size <= ``budget``: per layer, per bond, the kept
    slice indices (ascending).

    Greedy: while over the budget, remove, among the least important remaining slice of every bond above its
    floor, the one with the smallest importance / parameters freed (every slice of a bond frees the same number:
    r_{k-1}·mids[k] + mids[k+1]·r_{k+1} + 1 at the current ranks, or the whole matrix when it is the bond's last).
    Stops early when every bond is at its floor (the result is then above the budget). Ties go to the first
    layer and bond in order, so the result is deterministic.
    """
    order = [
        [sorted(range(len(imp)), key=lambda i, imp=imp: (imp[i], i)) for imp in layer.importance] for layer in layers
    ]
    removed = [[0] * len(layer.importance) for layer in layers]
    ranks = [list(layer.ranks) for layer in layers]
    sizes = [tt_size(layer.mids, r) for layer, r in zip(layers, ranks)]
    total = fixed + sum(sizes)
    while total > budget:
        best = None  # (score, layer, bond, new size)
        for j, layer in enumerate(layers):
            if sizes[j] == 0:
                continue
            for k, r in enumerate(ranks[j]):
                if r <= layer.floor:
                    continue
                smaller = ranks[j][:k] + [r - 1] + ranks[j][k + 1 :]
                new_size = tt_size(layer.mids, smaller)
                score = layer.importance[k][order[j][k][removed[j][k]]] / (sizes[j] - new_size)
                if best is None or score < best[0]:
                    best = (score, j, k, new_size)
        if best is None:
            break
        _, j, k, new_size = best
        removed[j][k] += 1
        ranks[j][k] -= 1
        if new_size == 0:
            ranks[j] = [0] * len(ranks[j])
            removed[j] = [len(imp) for imp in layers[j].importance]
        total += new_size - sizes[j]
        sizes[j] = new_size
    return [
        tuple(tuple(sorted(order[j][k][removed[j][k] :])) for k in range(len(layer.importance)))
        for j, layer in enumerate(layers)
    ]
