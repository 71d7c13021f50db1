"""What ``plan()`` returns: the cheapest plan on each interval of the batch size (``PlanEnvelope``,
``EnvelopePiece``), and ``plan()`` itself, the planner's entry point.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fractions import Fraction

import sympy

from ..layout import TTLayout
from .cost import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, CostModel, _num, device_launch
from .network import TTNetwork, build_network
from .plans import BATCH, Plan, _as_rational, _pretty
from .subset_dp import _check_bounds, _crossing, search


@dataclass(frozen=True)
class EnvelopePiece:
    """On lo <= b <= hi (exact rationals; hi is sympy.oo when unbounded) ``plan`` is cheapest, at ``cost``.

    ``first`` / ``last`` are the integer batch sizes it is chosen for (last None when unbounded; first > last when
    the piece holds no integer). A tie at an integer breakpoint goes to the later piece.
    """

    lo: sympy.Rational
    hi: sympy.Expr
    first: int
    last: int | None
    plan: Plan
    cost: sympy.Expr

    def holds(self, batch: int) -> bool:
        return self.first <= batch and (self.last is None or batch <= self.last)

    def describe_interval(self) -> str:
        if self.last is None:
            return f"b >= {self.first}"
        if self.first > self.last:
            return f"{self.lo} < b < {self.hi} (no integer)"
        return f"{self.first} <= b <= {self.last}" if self.first != self.last else f"b = {self.first}"


@dataclass(frozen=True)
class PlanEnvelope:
    """What ``plan()`` returns: the cheapest plan on each interval of the batch size b in [lo, hi]."""

    network: TTNetwork
    model: CostModel
    lo: int
    hi: int | None
    pieces: tuple[EnvelopePiece, ...]
    batch: int | None = None

    @property
    def envelope(self) -> tuple[EnvelopePiece, ...]:
        return self.pieces

    @property
    def breakpoints(self) -> tuple[sympy.Rational, ...]:
        """Exact values of b where the cheapest plan changes (the pieces' lower ends after the first)."""
        return tuple(piece.lo for piece in self.pieces[1:])

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(piece.plan for piece in self.pieces)

    def piece_at(self, batch: int) -> EnvelopePiece:
        """The piece whose integer range holds ``batch`` (0, an empty batch, gets the first piece's plan)."""
        batch = _as_int(batch, "batch")
        if batch < 0:
            raise ValueError(f"batch must be an int >= 0, got {batch!r}")
        if batch == 0:
            return self.pieces[0]
        if batch < self.lo or (self.hi is not None and batch > self.hi):
            raise ValueError(
                f"batch {batch} is outside the planned bounds [{self.lo}, {self.hi or '∞'}]; "
                f"plan again with bounds=(lo, hi) covering it"
            )
        return next(piece for piece in self.pieces if piece.holds(batch))

    def choose(self, batch: int) -> Plan:
        """The cheapest plan for this batch size."""
        return self.piece_at(batch).plan

    def __str__(self) -> str:
        layout, net = self.network.layout, self.network
        what = "x @ M" if net.op == "matmul" else "x @ Mᵀ"
        bounds = f"{self.lo} <= b" + (f" <= {self.hi}" if self.hi is not None else "")
        head = [
            f"{layout.format.value.upper()} {what}, {layout.describe_modes()}, ranks {layout.ranks}; {bounds}",
            self.model.describe(),
        ]
        at = f"FLOPs at b={self.batch}" if self.batch is not None else "FLOPs"
        rows = [("batch", "plan", "cost", at)]
        for piece in self.pieces:
            flops = piece.plan.flops(self.batch) if self.batch is not None else None
            rows.append(
                (
                    piece.describe_interval(),
                    str(piece.plan),
                    _pretty(piece.plan.weighted_cost),
                    _num(flops) if self.batch is not None else _pretty(piece.plan.terms.flops),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        table.insert(1, "  ".join("-" * w for w in widths))
        lines = head + table
        if self.breakpoints:
            lines.append("breakpoints: " + ", ".join(f"{bp} (≈{float(bp):.4g})" for bp in self.breakpoints))
        if self.batch is not None:
            piece = self.piece_at(self.batch)
            lines.append(f"at b = {self.batch}: {piece.plan}, cost {_num(piece.cost.subs(BATCH, self.batch))}")
        return "\n".join(lines)


def plan(
    layer_or_spec,
    batch: int | None = None,
    *,
    op: str | None = None,
    alpha=DEFAULT_ALPHA,
    beta=DEFAULT_BETA,
    bounds: tuple[int, int | None] = (1, None),
    backward: bool = True,
    x_requires_grad: bool = True,
    itemsize: int = 4,
    gamma=DEFAULT_GAMMA,
    launch=None,
) -> PlanEnvelope:
    """Plan ``x @ M`` (or ``x @ Mᵀ``) of a TT layer for every batch size in ``bounds``.

    ``layer_or_spec``: a ``TTMatrix``, a ``TTLinear`` (its op follows ``transposed``) or a ``TTLayout``. ``op``:
    "matmul" or "matmul_t" (default: what a TTLinear runs, else "matmul"). ``batch``: an int to report the plan
    that wins there (the table also shows FLOPs at that size). ``alpha`` / ``beta`` / ``gamma`` / ``launch``: the
    cost weights (``CostModel``); ``launch`` None: the launch cost of the device a layer's cores live on
    (``DEVICE_LAUNCH``), what its products run; 0 for a TTLayout. ``backward=False`` plans inference (forward only).
    """
    layout, default_op = _layout_of(layer_or_spec)
    if launch is None:
        device = _device_of(layer_or_spec)
        launch = 0 if device is None else device_launch(device)
    op = op if op is not None else default_op
    lo, hi = bounds
    _check_bounds(lo, hi)
    if batch is not None:
        batch = _as_int(batch, "batch")
        if batch < lo or (hi is not None and batch > hi):
            raise ValueError(f"batch must be an int within the bounds [{lo}, {hi or '∞'}], got {batch!r}")
    model = CostModel(
        alpha=alpha,
        beta=beta,
        itemsize=itemsize,
        backward=backward,
        x_requires_grad=x_requires_grad,
        gamma=gamma,
        launch=launch,
    )
    net = build_network(layout, op)
    found = search(net, model, lo, hi)
    pieces = []
    for k, (tree, line) in enumerate(found):
        chosen = Plan.from_tree(net, tree, model)
        if chosen.weighted_cost != line:  # the DP's inline arithmetic and _step_terms must agree
            raise RuntimeError(f"planner inconsistency for {chosen}: {chosen.weighted_cost} != {line}")
        start = Fraction(lo) if k == 0 else _crossing(found[k - 1][1], line)
        last_piece = k == len(found) - 1
        end = (Fraction(hi) if hi is not None else None) if last_piece else _crossing(line, found[k + 1][1])
        first = math.ceil(start)
        last = None if end is None else (int(end) if last_piece else math.ceil(end) - 1)
        pieces.append(
            EnvelopePiece(
                _as_rational(start), sympy.oo if end is None else _as_rational(end), first, last, chosen, chosen.cost()
            )
        )
    return PlanEnvelope(net, model, lo, hi, tuple(pieces), batch)


def _as_int(value, name: str) -> int:
    """Python ints and integer-like numbers (sympy.Integer, numpy ints) as int; ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _device_of(obj):
    """The device a TTMatrix's or TTLinear's cores live on (duck typing: ``.device`` of it or of its ``.tt``), or
    None for a TTLayout."""
    if isinstance(obj, TTLayout):
        return None
    return getattr(getattr(obj, "tt", obj), "device", None)


def _layout_of(obj) -> tuple[TTLayout, str]:
    """(layout, default op) of a TTLayout, TTMatrix or TTLinear, read by duck typing (no module import)."""
    if isinstance(obj, TTLayout):
        return obj, "matmul"
    tt = getattr(obj, "tt", None)
    if tt is not None and isinstance(getattr(tt, "layout", None), TTLayout):
        if hasattr(obj, "transposed"):
            return tt.layout, "matmul_t" if obj.transposed else "matmul"
        raise ValueError(
            f"{type(obj).__name__} looks rows up rather than multiplying; lookups are not planned. "
            f"Plan its matrix (obj.tt) with op='matmul_t' for a tied output head"
        )
    if isinstance(getattr(obj, "layout", None), TTLayout):
        return obj.layout, "matmul"
    raise ValueError(f"plan() takes a TTMatrix, a TTLinear or a TTLayout, got {type(obj).__name__}")
