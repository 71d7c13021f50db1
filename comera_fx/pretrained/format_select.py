"""The multiple-choice knapsack behind ``choose_formats``: one candidate per layer, the least summed error that fits
the byte budget. Pure functions of the candidates' (bytes, error), so they are tested without a model."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

#: the TT formats' core grids (bits per core entry)
CORE_BITS = {"tt": 8, "tt4": 4, "lr": 8, "lr4": 4}
#: TT formats whose chain has a fixed number of modes per side: "lr" / "lr4" are the low-rank product
#: (in × r)(r × out), a TT with one mode per side; "tt" / "tt4" take the plan's ``num_modes``.
FIXED_MODES = {"lr": 1, "lr4": 1}


def modes_of(format: str, num_modes: int | None) -> int | None:
    """The modes per side a TT format is built with (``num_modes``: the plan's, for "tt" / "tt4")."""
    return FIXED_MODES.get(format, num_modes)


@dataclass(frozen=True)
class FormatChoice:
    """One way to store one layer: ``format`` (``"int8"``, ``"int4"``, ``"tt"`` / ``"tt4"``: TT at ``max_rank``
    with int8 / int4 cores, ``"lr"`` / ``"lr4"``: the same with one mode per side, a rank-``max_rank`` product),
    its grid's ``group_size``, the bytes it takes and its relative output error."""

    fqn: str
    format: str
    max_rank: int | None
    bytes: int
    error: float
    group_size: int = 64

    def label(self) -> str:
        if self.format in CORE_BITS:
            shape = "lr" if self.format in FIXED_MODES else "tt"
            return f"{shape} r{self.max_rank} int{CORE_BITS[self.format]}"
        return f"{self.format} g{self.group_size}"


def lower_hull(candidates: list[FormatChoice]) -> list[FormatChoice]:
    """The lower convex hull of (bytes, error), bytes ascending: the candidates a greedy upgrade should visit."""
    pareto: list[FormatChoice] = []
    for c in sorted(candidates, key=lambda c: (c.bytes, c.error)):
        if not pareto or c.error < pareto[-1].error:
            pareto.append(c)
    hull: list[FormatChoice] = []
    for c in pareto:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]  # drop b when it lies on or above the segment a -> c
            if (b.error - a.error) * (c.bytes - a.bytes) >= (c.error - a.error) * (b.bytes - a.bytes):
                hull.pop()
            else:
                break
        hull.append(c)
    return hull


def select_on_hulls(hulls: dict[str, list[FormatChoice]], budget: int) -> dict[str, int]:
    """Index into each layer's hull (``lower_hull``) of its chosen candidate: start every layer at its smallest, then
    take the step with the most error saved per extra byte while it fits (a step that does not fit is passed over;
    smaller steps of other layers may still). Optimal whenever the budget falls on one of the steps' running
    totals (the knapsack's LP relaxation is then integral); otherwise within one step of it."""
    chosen = {fqn: 0 for fqn in hulls}
    spent = sum(h[0].bytes for h in hulls.values())
    heap: list[tuple[float, str]] = []

    def push(fqn: str) -> None:
        hull, at = hulls[fqn], chosen[fqn]
        if at + 1 < len(hull):
            gain = (hull[at].error - hull[at + 1].error) / (hull[at + 1].bytes - hull[at].bytes)
            heapq.heappush(heap, (-gain, fqn))

    for fqn in hulls:
        push(fqn)
    while heap:
        _, fqn = heapq.heappop(heap)
        hull, at = hulls[fqn], chosen[fqn]
        extra = hull[at + 1].bytes - hull[at].bytes
        if spent + extra > budget:
            continue
        chosen[fqn], spent = at + 1, spent + extra
        push(fqn)
    return chosen


def select(candidates: dict[str, list[FormatChoice]], budget: int) -> dict[str, FormatChoice]:
    """The choice per layer: ``select_on_hulls``, then the bytes it left spent on single swaps (any candidate,
    hull or not) that lower the summed error most, while one fits. No single swap that fits improves the result."""
    hulls = {fqn: lower_hull(found) for fqn, found in candidates.items()}
    chosen = {fqn: hulls[fqn][at] for fqn, at in select_on_hulls(hulls, budget).items()}
    left = budget - sum(c.bytes for c in chosen.values())
    while True:
        swaps = [
            (chosen[fqn].error - c.error, fqn, c)
            for fqn, found in candidates.items()
            for c in found
            if c.bytes - chosen[fqn].bytes <= left and c.error < chosen[fqn].error
        ]
        if not swaps:
            return chosen
        _, fqn, c = max(swaps, key=lambda s: s[0])
        left -= c.bytes - chosen[fqn].bytes
        chosen[fqn] = c
