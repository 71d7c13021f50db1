"""The exact search: lower envelopes of lines c0 + c1·b and the dynamic programme over subsets of tensors.

``search`` returns the trees on the lower envelope of the weighted cost over the batch bounds, with exact costs;
``_search`` is its cached core (tests clear the cache through ``comera_fx.tt.plan._search``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from .cost import CostModel, ScaledWeights, _subset_sizes, scaled_copy, scaled_copy_launches, scaled_step
from .network import X, Linear, Tree, TTNetwork, _canonical
from .plans import Plan
from .views import _final_copies, _step_copies


def _crosses_before(l1: Linear, l2: Linear, l3: Linear) -> bool:
    """For slopes l1 > l2 > l3: does l2 stop being best (meets l3) no earlier than it starts (meets l1)?

    Compares (c0_2 - c0_1)/(c1_1 - c1_2) < (c0_3 - c0_2)/(c1_2 - c1_3) by cross-multiplication, exactly.
    """
    return (l2[0] - l1[0]) * (l2[1] - l3[1]) < (l3[0] - l2[0]) * (l1[1] - l2[1])


def _crossing(l1: Linear, l2: Linear) -> Fraction:
    """Where line l1 (steeper) meets l2."""
    return Fraction(l2[0] - l1[0], l1[1] - l2[1])


def _lower_envelope(lines: list, lo: int, hi: int | None) -> list:
    """The lines (tuples starting with c0, c1) that are minimal somewhere in [lo, hi], ordered from lo to hi.

    A line that only touches the envelope at a single point is dropped: another line is as good there. Ties keep
    the line listed first, so the result is deterministic.
    """
    hull: list = []
    for line in sorted(lines, key=lambda l: (-l[1], l[0])):  # stable: ties keep input order
        if hull and hull[-1][1] == line[1]:
            continue  # same slope, larger or equal intercept
        while len(hull) >= 2 and not _crosses_before(hull[-2], hull[-1], line):
            hull.pop()
        hull.append(line)
    start = 0
    while start + 1 < len(hull) and _crossing(hull[start], hull[start + 1]) <= lo:
        start += 1
    end = len(hull)
    if hi is not None:
        while end - 1 > start and _crossing(hull[end - 2], hull[end - 1]) >= hi:
            end -= 1
    return hull[start:end]


def search(net: TTNetwork, model: CostModel, lo: int = 1, hi: int | None = None) -> tuple[tuple[Tree, Linear], ...]:
    """Exact search: the trees on the lower envelope of the weighted cost over b in [lo, hi], ordered by b.

    Returns (tree, (c0, c1)) pairs with exact Fraction costs. Cached per (network, model, bounds).
    """
    _check_bounds(lo, hi)
    return _search(net, model, lo, hi)


@dataclass(frozen=True)
class _Ceiling:
    """An upper bound U(b) on the optimal cost (the envelope of a few known trees), scaled to integers.

    Anything whose cost exceeds U at every b in [lo, hi] cannot be part of an optimal tree (all step costs are
    positive), so the search drops it. ``points`` are (p, q, U(p/q)·q): the bounds and U's vertices between them,
    where a convex difference line - U takes its minimum; ``tail`` is U's last line when hi is unbounded.
    """

    points: tuple[tuple[int, int, int], ...]
    tail: Linear | None

    def above(self, c0: int, c1: int) -> bool:
        """Is the line c0 + c1·b strictly above U on the whole range?"""
        if self.tail is not None and c1 < self.tail[1]:
            return False
        return all(c0 * q + c1 * p > value for p, q, value in self.points)


def _ceiling(lines: list[Linear], lo: int, hi: int | None) -> _Ceiling:
    hull = _lower_envelope(lines, lo, hi)
    where = [Fraction(lo)] + [_crossing(l1, l2) for l1, l2 in zip(hull, hull[1:])]
    where += [Fraction(hi)] if hi is not None else []
    points = []
    for t in where:
        value = min(Fraction(c0) + c1 * t for c0, c1 in hull)
        points.append((t.numerator, t.denominator, int(value * t.denominator)))
    return _Ceiling(tuple(points), None if hi is not None else hull[-1][:2])


def _reference_trees(net: TTNetwork) -> list[Tree]:
    """Trees whose costs bound the search from above: x through the chain from either end, and x times the
    merged chain split at every bond (CoMERA's (x·L)·R, the dense x·M and everything between)."""
    n = net.n_tensors - 1

    def chain(ids: Sequence[int]) -> Tree:
        node: Tree = ids[0]
        for t in ids[1:]:
            node = (node, t)
        return node

    cores = list(range(1, n + 1))
    trees = [chain([X] + cores), chain([X] + cores[::-1])]
    for cut in range(1, n + 1):
        left, right = cores[:cut], cores[cut:]
        for near, far in ((left, right), (right, left)):
            if near:
                trees.append(((X, chain(near)), chain(far)) if far else (X, chain(near)))
    return trees


_EXACT_ORDERS = 9


@lru_cache(maxsize=256)
def _search(net: TTNetwork, model: CostModel, lo: int, hi: int | None) -> tuple[tuple[Tree, Linear], ...]:
    n = net.n_tensors
    sizes = _subset_sizes(net)
    # Step and copy costs come from the cost model (cost.py), as integers scaled by w.scale: exact and cheap.
    w = ScaledWeights.of(model)
    scale = w.scale
    grad_x = model.x_requires_grad
    ceiling = _ceiling(
        [tuple(int(c * scale) for c in Plan.from_tree(net, t, model).weighted_cost) for t in _reference_trees(net)],
        lo,
        hi,
    )
    # Any tree over a subset ends with a GEMM writing it: >= 2 FLOPs and one write per element, twice with backward.
    last_step = (2 * w.flop + w.element) * (2 if model.backward else 1)

    # How execute runs a step depends on the stored index orders of its operands, which depend on the sub-trees:
    # the state of the DP is (subset, order). views[(order_a, order_b)] = (result order, copy_a, copy_b).
    views: dict = {}
    # Up to _EXACT_ORDERS tensors every order of a core-only subset is kept (exact); beyond, only its cheapest
    # (the number of orders explodes with outer products: a 13-tensor network would take minutes).
    exact_orders = n <= _EXACT_ORDERS

    def step_view(order_a, order_b, batched):
        key = (order_a, order_b)
        found = views.get(key)
        if found is None:
            found = views[key] = _step_copies(net.sizes, order_a, order_b, batched)[:3]
        return found

    # env[S]: lines (c0, c1, order, part, kp, ko): cost of the best trees over S whose result is stored in
    # ``order``, made of env[part][kp] and env[S ^ part][ko] (the part without x has a b-independent cost). For
    # subsets holding x, the lines of each order form a lower envelope; without x, one line per order. Leaves:
    # part = 0. A subset that cannot be in an optimal tree keeps an empty list.
    env: list[list] = [[] for _ in range(1 << n)]
    for subset in range(1, 1 << n):
        if subset & (subset - 1) == 0:
            env[subset] = [(0, 0, net.tensor_indices[subset.bit_length() - 1], 0, 0, 0)]
            continue
        size_s = sizes[subset]
        has_x = subset & 1
        if ceiling.above(0 if has_x else last_step * size_s, last_step * size_s if has_x else 0):
            continue
        if has_x:  # every split puts x on one side, "part"
            rest = subset ^ 1
            groups: dict = {}
            sub = (rest - 1) & rest
            while True:
                part, other = sub | 1, rest ^ sub
                if env[part] and env[other]:
                    sp, so = sizes[part], sizes[other]
                    grad_part = grad_x or part != 1  # x alone needs a gradient only if asked; a product always
                    k0, k1 = scaled_step(sp, so, size_s, True, False, grad_part, True, w)
                    copy_a, copy_b = scaled_copy(sp, grad_part, w), scaled_copy(so, True, w)
                    launch_a, launch_b = scaled_copy_launches(grad_part, w), scaled_copy_launches(True, w)
                    for ko, right in enumerate(env[other]):
                        for kp, line in enumerate(env[part]):
                            order, ca, cb = step_view(line[2], right[2], True)
                            c0 = line[0] + k0 + right[0] + cb * (copy_b + launch_b) + ca * launch_a
                            groups.setdefault(order, []).append((c0, line[1] + k1 + ca * copy_a, order, part, kp, ko))
                if sub == 0:
                    break
                sub = (sub - 1) & rest
            lines = []
            full = subset == (1 << n) - 1
            for order, candidates in groups.items():
                if full and _final_copies(net.sizes, order, net.output):  # the final reorder is a copy
                    extra, launches = scaled_copy(size_s, True, w), scaled_copy_launches(True, w)
                    candidates = [(c0 + launches, c1 + extra, *more) for c0, c1, *more in candidates]
                lines += _lower_envelope(_undominated(candidates, lo, hi), lo, hi)
            if full:
                lines = _lower_envelope(lines, lo, hi)
        else:  # cores only: costs do not depend on b, keep the best per stored order
            low = subset & -subset
            rest = subset ^ low
            best: dict = {}
            sub = (rest - 1) & rest
            while True:
                part, other = sub | low, rest ^ sub
                if env[part] and env[other]:
                    sp, so = sizes[part], sizes[other]
                    cost = scaled_step(sp, so, size_s, False, False, True, True, w)[0]
                    launches = scaled_copy_launches(True, w)
                    copy_a, copy_b = scaled_copy(sp, True, w) + launches, scaled_copy(so, True, w) + launches
                    for kp, left in enumerate(env[part]):
                        for ko, right in enumerate(env[other]):
                            order, ca, cb = step_view(left[2], right[2], False)
                            total = cost + left[0] + right[0] + ca * copy_a + cb * copy_b
                            if order not in best or total < best[order][0]:
                                best[order] = (total, 0, order, part, kp, ko)
                if sub == 0:
                    break
                sub = (sub - 1) & rest
            lines = list(best.values())
            if not exact_orders and lines:
                lines = [min(lines, key=lambda line: line[0])]
        env[subset] = [line for line in lines if not ceiling.above(line[0], line[1])]

    def tree(subset: int, k: int) -> Tree:
        _, _, _, part, kp, ko = env[subset][k]
        if part == 0:
            return subset.bit_length() - 1
        return _canonical((tree(part, kp), tree(subset ^ part, ko)))

    full = (1 << n) - 1
    if not env[full]:
        raise RuntimeError("planner bound pruned every tree; this is a bug in comera_fx.tt.plan")
    return tuple(
        (tree(full, k), (Fraction(line[0], scale), Fraction(line[1], scale))) for k, line in enumerate(env[full])
    )


def _undominated(candidates: list, lo: int, hi: int | None) -> list:
    """Drop candidates that the best line at lo or the best line at hi (or of least slope) beats everywhere.

    A cheap filter before the exact envelope: most candidates of a subset lose to one of these two.
    """

    def at_lo(line) -> int:
        return line[0] + line[1] * lo

    def at_end(line):
        return line[0] + line[1] * hi if hi is not None else (line[1], line[0])

    def beats(a, c) -> bool:
        return at_lo(a) <= at_lo(c) and at_end(a) <= at_end(c)

    first = min(candidates, key=at_lo, default=None)
    last = min(candidates, key=at_end, default=None)
    return [c for c in candidates if c is first or c is last or not (beats(first, c) or beats(last, c))]


def _check_bounds(lo: int, hi: int | None) -> None:
    """Bounds are plain ints (they key the search cache): lo >= 1, hi None (unbounded) or >= lo."""
    if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
        raise ValueError(f"the lower batch bound must be an int >= 1, got {lo!r}")
    if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int) or hi < lo):
        raise ValueError(f"the upper batch bound must be None (unbounded) or an int >= {lo}, got {hi!r}")
