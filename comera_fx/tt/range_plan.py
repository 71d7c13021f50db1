"""One contraction plan for a whole range of batch sizes (``plan_for_range``), and its use under ``torch.export``.

A TT product picks its plan per interval of the batch size (``layers.choose_plan``), and under ``torch.export`` each
comparison at a breakpoint would become a guard that export turns into a constraint error or an assertion in the
program (the program then refuses sizes in the declared range). So while exporting, a symbolic batch size gets the
plan that ``plan_for_range`` picks for the whole range its symbols are declared over: no comparison, no guard.
``comera_fx.export`` pins the same plans and checks the range's ends besides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import sympy
import torch
from torch.utils._sympy.numbers import int_oo

from . import plan as planner
from .layout import TTLayout

#: The upper end a symbolic size without a declared max is planned to. The cost model is linear in the batch size,
#: so past a few thousand the choice no longer changes; this only keeps the search finite.
UNBOUNDED_BATCH = 2**31 - 1


@dataclass(frozen=True)
class RangePlan:
    """The plan pinned for batch sizes ``lo <= b <= hi`` of one TT product, and what pinning costs: at every size
    in the range its modelled cost is at most ``worst_ratio`` times the best plan's there (attained at
    ``worst_at``); 1.0 means one plan is the cheapest on the whole range."""

    plan: planner.Plan
    lo: int
    hi: int
    worst_ratio: float
    worst_at: int

    def __str__(self) -> str:
        return (
            f"{self.plan} for {self.lo} <= b <= {self.hi}: at most {self.worst_ratio:.3g}x the best plan's "
            f"modelled cost (at b = {self.worst_at})"
        )


def plan_for_range(layout: TTLayout, op: str, lo: int, hi: int, *, launch=0) -> RangePlan:
    """The one plan for ``x @ M`` (``op="matmul"``) or ``x @ Mᵀ`` over batch sizes ``lo..hi`` that minimises the
    worst ratio of its cost to the best plan's cost, by the inference cost model (forward only). ``launch``: a
    kernel launch's cost on the device the product runs on (``planner.device_launch(device)``; 0 on a CPU).

    Exact, not sampled: every cost is linear in b and the best is their lower envelope, so on each envelope piece a
    candidate's ratio is monotone and its worst lies at a piece's integer ends.
    """
    lo = max(int(lo), 1)  # an empty batch costs nothing under any plan
    hi = max(int(hi), lo)
    return _plan_for_range(layout, op, lo, hi, launch)


@functools.lru_cache(maxsize=1024)
def _plan_for_range(layout: TTLayout, op: str, lo: int, hi: int, launch) -> RangePlan:
    envelope = planner.plan(layout, op=op, bounds=(lo, hi), backward=False, launch=launch)
    ends = sorted(
        {end for piece in envelope.pieces for end in (piece.first, piece.last) if end is not None and lo <= end <= hi}
        | {lo, hi}
    )
    best = [min(_cost(piece.plan, b) for piece in envelope.pieces) for b in ends]
    choices = []
    for piece in envelope.pieces:
        ratios = [_cost(piece.plan, b) / low if low > 0 else Fraction(1) for b, low in zip(ends, best)]
        worst = max(range(len(ends)), key=ratios.__getitem__)
        choices.append((ratios[worst], -piece.first, piece.plan, ends[worst]))
    ratio, _, chosen, at = min(choices, key=lambda c: c[:2])  # a tie goes to the plan of larger sizes
    planner.prepare_plan(chosen)  # build the plan's instructions now, outside any traced region
    return RangePlan(chosen, lo, hi, float(ratio), at)


def _cost(chosen: planner.Plan, batch: int) -> Fraction:
    c0, c1 = chosen.weighted_cost
    return c0 + c1 * batch


def finite(bound) -> bool:
    """False for torch's integer infinity (an undeclared max) and sympy's."""
    return bound not in (int_oo, -int_oo, sympy.oo, -sympy.oo)


def symbolic_range(batch: torch.SymInt) -> tuple[int, int | None]:
    """(lo, hi) of a symbolic batch size: the bounds its symbols are declared over; hi None when unbounded."""
    node = batch.node
    bounds = node.shape_env.bound_sympy(node.expr)
    lo = int(bounds.lower) if finite(bounds.lower) else 1
    return lo, int(bounds.upper) if finite(bounds.upper) else None


def export_plan(envelope: "planner.PlanEnvelope", batch: torch.SymInt) -> planner.Plan:
    """The plan a TT product runs for a symbolic batch size while ``torch.export`` traces it: ``plan_for_range``
    over the size's declared range (to ``UNBOUNDED_BATCH`` without a max), so that no guard is emitted. The launch
    cost is the envelope's: that of the device the product runs on."""
    lo, hi = symbolic_range(batch)
    layout, op = envelope.network.layout, envelope.network.op
    return plan_for_range(layout, op, lo, UNBOUNDED_BATCH if hi is None else hi, launch=envelope.model.launch).plan
