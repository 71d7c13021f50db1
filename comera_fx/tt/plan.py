"""The contraction planner: which pairwise order to multiply an activation with a TT matrix, for every batch size.

``x @ M`` with M in TT or TTM form is a small tensor network: the activation x (a batch index ``b`` plus one index
per input mode), the cores (mode indices and bonds) and the output (``b`` plus the output modes). Every index other
than ``b`` joins exactly two places (two tensors, or a tensor and the output), so every pairwise contraction is one
GEMM and nothing else. The planner

1. builds that network from a ``TTLayout`` (``build_network``; padded sizes, gates folded into the cores),
2. searches all contraction trees exactly — dynamic programming over subsets of tensors, outer products included,
   so it is never worse than opt_einsum's ``optimal`` — under a cost model that counts the forward *and* the
   backward that autograd runs for a pairwise tree (``CostModel``),
3. returns the lower envelope over the batch size: which tree is cheapest on which interval of ``b``, with exact
   breakpoints (``plan``, ``PlanEnvelope``),
4. runs a chosen tree with reshape / permute / mm only, reading every size from the layout (``execute``), so the
   same code runs eagerly and on ``torch.fx`` proxies.

Why an envelope and not one plan: every intermediate either carries the batch index (it contains x) or not, so
every cost is linear in b, ``c0 + c1·b``. Merging cores first (CoMERA's (x·L)·R) pays a b-independent price to make
the b-dependent part small; at small b, pushing x through the cores one at a time wins. Keeping, per subset of
tensors, the lower envelope of its candidate sub-plans (a handful of lines) instead of a single best makes the
subset DP exact for every b at once. The DP runs on integer pairs; sympy only builds the final expressions.

Pure: the planning half reads no tensor and never imports ``torch.fx``; only ``execute`` uses torch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Union

import sympy
import torch
import torch.nn.functional as F

from . import ops
from .layout import TTFormat, TTLayout

__all__ = [
    "BATCH",
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
    "DEFAULT_GAMMA",
    "OPS",
    "CostModel",
    "CostTerms",
    "EnvelopePiece",
    "Plan",
    "PlanEnvelope",
    "PlanRunner",
    "Step",
    "TTNetwork",
    "Tree",
    "build_network",
    "execute",
    "execute_function",
    "plan",
    "search",
]

# Calibrated by benchmarks/calibrate_plan_cost.py on 2026-11-30 (`--repeat 10 --rounds 6`, 2 threads, torch
# 2.13.0+cpu, fp32): best square GEMM 69.2 GFLOP/s, best large-copy bandwidth 11.67 GB/s, so moving one byte takes
# as long as about 5.9 FLOPs. The machine was shared (load 4-5 on 2 cores): runs gave alpha 4.7 to 8.5; CoMERA's
# plans and breakpoints barely move over that range (docs/planner.md).
DEFAULT_ALPHA = 5.9
# Not a time: bytes kept alive for backward cost memory, and their write / re-read is already in the traffic term.
# One FLOP per saved byte is a tie-breaker that prefers the plan keeping fewer activations when times are close
# (1 GiB of saved activations weighs ~1 GFLOP, i.e. ~15 ms on the machine above).
DEFAULT_BETA = 1.0
# Fixed cost of one GEMM launched, in FLOP-equivalents: benchmarks/calibrate_plan_cost.py on 2026-11-30
# (`--repeat 10 --rounds 4`, 2 threads, load 3.4-3.9 on 2 cores) timed a tiny (4 x 4) GEMM chain forward + backward
# through reshapes at best 11.05 us per GEMM launched (bare torch.mm: 1.9 us), times the best GEMM rate of that run,
# 68.2 GFLOP/s. Every tree over n tensors launches n - 1 GEMMs forward and the same number backward, so gamma
# shifts every plan's cost by the same constant: it brings absolute predictions closer at small b, never a choice.
DEFAULT_GAMMA = 754000

OPS = ("matmul", "matmul_t")

#: The batch size (all leading dimensions of x flattened) in cost expressions.
BATCH = sympy.Symbol("b", integer=True, positive=True)

_B = 0  # id of the batch index in every network
X = 0  # id of the activation among the network's tensors

#: A contraction tree: a tensor id (leaf) or a pair of subtrees.
Tree = Union[int, tuple["Tree", "Tree"]]
#: A cost linear in the batch: (c0, c1) means c0 + c1·b (ints, or Fractions once weighted).
Linear = tuple


# ------------------------------------------------------------------------------------------------------ network


@dataclass(frozen=True)
class TTNetwork:
    """The tensor network of ``x @ M`` (op "matmul") or ``x @ Mᵀ`` ("matmul_t") for one layout.

    Index 0 is the batch ``b`` (its ``sizes`` entry is a placeholder 1). Tensor 0 is x, tensor k is core k; each
    tensor lists its indices in storage order (row-major), with the boundary bonds of size 1 left out. ``output``
    lists the result's indices in storage order: b, then the output modes.
    """

    layout: TTLayout
    op: str
    index_names: tuple[str, ...]
    sizes: tuple[int, ...]
    tensor_names: tuple[str, ...]
    tensor_indices: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]

    @property
    def n_tensors(self) -> int:
        return len(self.tensor_names)

    @property
    def in_modes(self) -> tuple[int, ...]:
        return self.layout.row_modes if self.op == "matmul" else self.layout.col_modes

    @property
    def out_modes(self) -> tuple[int, ...]:
        return self.layout.col_modes if self.op == "matmul" else self.layout.row_modes

    def open_indices(self, mask: int) -> frozenset[int]:
        """Indices of the intermediate made of the tensors in ``mask``: those with exactly one end inside."""
        seen: set[int] = set()
        for t in _bits(mask):
            seen ^= set(self.tensor_indices[t])
        return frozenset(seen)

    def size(self, indices: Iterable[int]) -> int:
        """Product of the sizes of ``indices``, the batch left out (it is carried as a flag)."""
        return math.prod(self.sizes[i] for i in indices if i != _B)


def build_network(layout: TTLayout, op: str = "matmul") -> TTNetwork:
    """The network of ``x @ M`` / ``x @ Mᵀ`` on the padded layout (ops.py pads x and trims the result around it)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    names, sizes = ["b"], [1]

    def new_index(name: str, size: int) -> int:
        names.append(name)
        sizes.append(size)
        return len(names) - 1

    rows = [new_index(f"i{k + 1}", m) for k, m in enumerate(layout.row_modes)]
    cols = [new_index(f"j{k + 1}", m) for k, m in enumerate(layout.col_modes)]
    n = layout.n_cores
    bonds = [None] + [new_index(f"r{k}", layout.ranks[k]) for k in range(1, n)] + [None]
    if layout.format is TTFormat.TT:
        modes = [[i] for i in rows + cols]
    else:
        modes = [[i, j] for i, j in zip(rows, cols)]
    cores = [tuple(i for i in [bonds[k], *modes[k], bonds[k + 1]] if i is not None) for k in range(n)]
    x_side, out_side = (rows, cols) if op == "matmul" else (cols, rows)
    return TTNetwork(
        layout=layout,
        op=op,
        index_names=tuple(names),
        sizes=tuple(sizes),
        tensor_names=("x",) + tuple(f"G{k + 1}" for k in range(n)),
        tensor_indices=((_B, *x_side),) + tuple(cores),
        output=(_B, *out_side),
    )


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


# --------------------------------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """Cost of a plan = FLOPs + alpha · (bytes moved + bytes copied) + beta · bytes saved + gamma · GEMMs launched.

    * FLOPs: 2·M·K·N per pairwise GEMM; with ``backward``, each operand that needs a gradient adds one GEMM of the
      same size (dA = dC·Bᵀ, dB = Aᵀ·dC), as autograd runs the pairwise tree. Cores always need one; x only when
      ``x_requires_grad``.
    * bytes moved: each GEMM reads both operands and writes its result (``itemsize`` bytes per element); alpha is
      FLOPs per byte (``DEFAULT_ALPHA``, measured by benchmarks/calibrate_plan_cost.py).
    * bytes copied: the permute copies ``execute`` makes (an operand that is neither a plain nor a transposed view
      of its stored order, and the final reorder into the output's order): read + write of the tensor forward,
      and the same again backward for its gradient when it needs one. Weighted by alpha.
    * bytes saved: the batch-dependent operands autograd keeps alive until backward (the activations); beta is a
      memory-pressure weight in FLOPs per byte (``DEFAULT_BETA``).
    * GEMMs launched: one per step forward, one per gradient backward; gamma (``DEFAULT_GAMMA``, measured) is the
      fixed overhead of one in FLOP-equivalents. Every tree over n tensors has n - 1 steps, so this term is the
      same for every plan of a network: it makes absolute predictions at small batches closer, not choices.
    Unmodelled: cache effects (small GEMMs run below peak), Inductor fusions.
    """

    alpha: float | Fraction = DEFAULT_ALPHA
    beta: float | Fraction = DEFAULT_BETA
    itemsize: int = 4
    backward: bool = True
    x_requires_grad: bool = True
    gamma: float | Fraction = DEFAULT_GAMMA

    def __post_init__(self) -> None:
        _as_fraction(self.alpha, "alpha")
        _as_fraction(self.beta, "beta")
        _as_fraction(self.gamma, "gamma")
        if isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int) or self.itemsize <= 0:
            raise ValueError(f"itemsize must be a positive int (bytes per element), got {self.itemsize!r}")

    @property
    def weights(self) -> tuple[Fraction, Fraction, Fraction]:
        """(alpha, beta, gamma) as exact fractions: a float is read as the decimal it prints as (5.5 -> 11/2)."""
        return (_as_fraction(self.alpha, "alpha"), _as_fraction(self.beta, "beta"),
                _as_fraction(self.gamma, "gamma"))

    def describe(self) -> str:
        alpha, beta, gamma = self.weights
        what = "forward + backward" if self.backward else "forward only"
        return (f"cost = FLOPs + {_num(alpha)}·(bytes moved + copied) + {_num(beta)}·bytes saved + "
                f"{_num(gamma)}·GEMMs ({what}, {self.itemsize}-byte elements)")


def _as_fraction(value, name: str) -> Fraction:
    """A finite value >= 0 as an exact Fraction; floats through their shortest repr so 5.9 means 59/10."""
    try:
        frac = Fraction(value) if isinstance(value, (int, Fraction)) else Fraction(str(value))
    except (ValueError, TypeError, ZeroDivisionError):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}") from None
    if isinstance(value, bool) or frac < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return frac


@dataclass(frozen=True)
class CostTerms:
    """Raw counts of a plan, each a pair (c0, c1) meaning c0 + c1·b; weigh them with ``CostModel``."""

    flops_forward: Linear = (0, 0)
    flops_backward: Linear = (0, 0)
    bytes_forward: Linear = (0, 0)
    bytes_backward: Linear = (0, 0)
    bytes_saved: Linear = (0, 0)
    bytes_copied: Linear = (0, 0)  # permute copies, forward + backward
    gemms: Linear = (0, 0)  # GEMMs launched, forward + backward

    def __add__(self, other: "CostTerms") -> "CostTerms":
        return CostTerms(*[(a[0] + b[0], a[1] + b[1]) for a, b in zip(self._pairs(), other._pairs())])

    def _pairs(self) -> tuple[Linear, ...]:
        return (self.flops_forward, self.flops_backward, self.bytes_forward, self.bytes_backward, self.bytes_saved,
                self.bytes_copied, self.gemms)

    @property
    def flops(self) -> Linear:
        """Forward + backward FLOPs."""
        return _add(self.flops_forward, self.flops_backward)

    def weighted(self, model: CostModel) -> tuple[Fraction, Fraction]:
        alpha, beta, gamma = model.weights
        moved = _add(_add(self.bytes_forward, self.bytes_backward), self.bytes_copied)
        return tuple(Fraction(f) + alpha * m + beta * s + gamma * g
                     for f, m, s, g in zip(self.flops, moved, self.bytes_saved, self.gemms))


def _add(a: Linear, b: Linear) -> Linear:
    return (a[0] + b[0], a[1] + b[1])


def _step_terms(left: int, right: int, sizes: Sequence[int], model: CostModel) -> CostTerms:
    """Counts of one pairwise contraction C = A·B of the subsets ``left`` (A) and ``right`` (B).

    ``sizes[mask]`` is the element count of an intermediate per batch element. Every index joins two places, so
    |A|·|B|·|C| = (M·K·N)² and the GEMM's FLOPs are 2·sqrt(|A|·|B|·|C|) — b included when A or B holds x.
    """
    sa, sb, sc = sizes[left], sizes[right], sizes[left | right]
    flops = 2 * math.isqrt(sa * sb * sc)
    batched = (left | right) & 1
    a_batched, b_batched = left & 1, right & 1

    def per(n: int, has_b: int) -> Linear:
        return (0, n) if has_b else (n, 0)

    moved = _add(_add(per(sa, a_batched), per(sb, b_batched)), per(sc, batched))
    step_flops = per(flops, batched)
    if not model.backward:
        return CostTerms(flops_forward=step_flops, bytes_forward=_scale(moved, model.itemsize), gemms=(1, 0))
    grad_a = left != 1 << X or model.x_requires_grad
    grad_b = right != 1 << X or model.x_requires_grad
    grads = grad_a + grad_b
    saved = (0, 0)
    if grad_b and a_batched:  # dB = Aᵀ·dC keeps A alive
        saved = _add(saved, per(sa, 1))
    if grad_a and b_batched:
        saved = _add(saved, per(sb, 1))
    return CostTerms(
        flops_forward=step_flops,
        flops_backward=_scale(step_flops, grads),
        bytes_forward=_scale(moved, model.itemsize),
        bytes_backward=_scale(moved, grads * model.itemsize),
        bytes_saved=_scale(saved, model.itemsize),
        gemms=(1 + grads, 0),
    )


def _copy_terms(copied: Sequence[tuple[int, bool, bool]], model: CostModel) -> CostTerms:
    """Bytes of permute copies: (elements per batch element or in all, batched, needs a gradient) per copy.

    Forward reads and writes the tensor once; backward copies its gradient back into the stored order when it
    needs one (the inverse permute of a contiguous gradient is not a view of the stored shape).
    """
    total = (0, 0)
    for n, batched, needs_grad in copied:
        times = 2 * (1 + (model.backward and needs_grad))
        total = _add(total, (0, n * times) if batched else (n * times, 0))
    return CostTerms(bytes_copied=_scale(total, model.itemsize))


def _scale(a: Linear, k: int) -> Linear:
    return (a[0] * k, a[1] * k)


@lru_cache(maxsize=64)
def _subset_sizes(net: TTNetwork) -> tuple[int, ...]:
    """Element count per batch element of the intermediate of every subset of tensors (bitmask -> int).

    Built incrementally: adding tensor t to a subset multiplies by |t| and divides by the squared size of the
    indices they share (those become internal).
    """
    masks = [sum(1 << i for i in idx if i != _B) for idx in net.tensor_indices]
    own = [net.size(idx) for idx in net.tensor_indices]
    n = net.n_tensors
    open_masks, sizes = [0] * (1 << n), [1] * (1 << n)
    for subset in range(1, 1 << n):
        low = subset & -subset
        t, prev = low.bit_length() - 1, subset ^ low
        open_masks[subset] = open_masks[prev] ^ masks[t]
        shared = math.prod(net.sizes[i] for i in _bits(open_masks[prev] & masks[t]))
        sizes[subset] = sizes[prev] * own[t] // (shared * shared)
    return tuple(sizes)


# ----------------------------------------------------------------------------------------------------- envelope


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


# ------------------------------------------------------------------------------------------------------- search


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
    alpha, beta, gamma = model.weights
    scale = math.lcm(alpha.denominator, beta.denominator, gamma.denominator)
    w_flop, w_byte, w_saved = scale, int(alpha * scale) * model.itemsize, int(beta * scale) * model.itemsize
    w_gemm = int(gamma * scale)
    grad_x = 1 if model.x_requires_grad else 0
    backward = model.backward
    copy_mult = 4 if backward else 2  # a permute copy: read + write forward, again for its gradient backward
    isqrt = math.isqrt
    ceiling = _ceiling([tuple(int(c * scale) for c in Plan.from_tree(net, t, model).weighted_cost)
                        for t in _reference_trees(net)], lo, hi)
    # Any tree over a subset ends with a GEMM writing it: >= 2 FLOPs and one write per element, twice with backward.
    last_step = (2 * w_flop + w_byte) * (2 if backward else 1)

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
                    flops = 2 * isqrt(sp * so * size_s)
                    if backward:
                        grad_part = grad_x if part == 1 else 1
                        mult = 2 + grad_part
                        k1 = (w_flop * flops + w_byte * (sp + size_s)) * mult + w_saved * sp
                        copy_a = w_byte * sp * (2 + 2 * grad_part)
                    else:
                        mult = 1
                        k1 = w_flop * flops + w_byte * (sp + size_s)
                        copy_a = w_byte * sp * 2
                    k0 = w_byte * so * mult + w_gemm * mult
                    copy_b = w_byte * so * copy_mult
                    for ko, right in enumerate(env[other]):
                        for kp, line in enumerate(env[part]):
                            order, ca, cb = step_view(line[2], right[2], True)
                            groups.setdefault(order, []).append(
                                (line[0] + k0 + right[0] + cb * copy_b, line[1] + k1 + ca * copy_a, order, part, kp,
                                 ko))
                if sub == 0:
                    break
                sub = (sub - 1) & rest
            lines = []
            full = subset == (1 << n) - 1
            for order, candidates in groups.items():
                if full and _final_copies(net.sizes, order, net.output):  # the final reorder is a copy
                    extra = w_byte * size_s * copy_mult
                    candidates = [(c0, c1 + extra, *more) for c0, c1, *more in candidates]
                lines += _lower_envelope(_undominated(candidates, lo, hi), lo, hi)
            if full:
                lines = _lower_envelope(lines, lo, hi)
        else:  # cores only: costs do not depend on b, keep the best per stored order
            low = subset & -subset
            rest = subset ^ low
            mult = 3 if backward else 1
            best: dict = {}
            sub = (rest - 1) & rest
            while True:
                part, other = sub | low, rest ^ sub
                if env[part] and env[other]:
                    sp, so = sizes[part], sizes[other]
                    flops = 2 * isqrt(sp * so * size_s)
                    cost = (w_flop * flops + w_byte * (sp + so + size_s) + w_gemm) * mult
                    for kp, left in enumerate(env[part]):
                        for ko, right in enumerate(env[other]):
                            order, ca, cb = step_view(left[2], right[2], False)
                            total = cost + left[0] + right[0] + (ca * sp + cb * so) * w_byte * copy_mult
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
    return tuple((tree(full, k), (Fraction(line[0], scale), Fraction(line[1], scale)))
                 for k, line in enumerate(env[full]))


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


def _canonical(node: Tree) -> Tree:
    """Order children so the one holding the lowest tensor id comes first (x, if present, is always left)."""
    if isinstance(node, int):
        return node
    left, right = _canonical(node[0]), _canonical(node[1])
    return (left, right) if _lowest(left) < _lowest(right) else (right, left)


def _lowest(node: Tree) -> int:
    return node if isinstance(node, int) else min(_lowest(node[0]), _lowest(node[1]))


def _leaves(node: Tree) -> list[int]:
    return [node] if isinstance(node, int) else _leaves(node[0]) + _leaves(node[1])


def _check_bounds(lo: int, hi: int | None) -> None:
    """Bounds are plain ints (they key the search cache): lo >= 1, hi None (unbounded) or >= lo."""
    if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
        raise ValueError(f"the lower batch bound must be an int >= 1, got {lo!r}")
    if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int) or hi < lo):
        raise ValueError(f"the upper batch bound must be None (unbounded) or an int >= {lo}, got {hi!r}")


# --------------------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Step:
    """One pairwise contraction ``result = left · right``: a GEMM (M × K) @ (K × N), M scaled by b if batched.

    ``left`` / ``right`` / ``result`` are slots: 0..n-1 are the network's tensors, n + k is the result of step k.
    ``left_tensors`` / ``right_tensors`` are bitmasks of the network tensors each operand is made of.
    """

    left: int
    right: int
    result: int
    left_tensors: int
    right_tensors: int
    m: int
    k: int
    n: int
    batched: bool

    @property
    def flops(self) -> Linear:
        f = 2 * self.m * self.k * self.n
        return (0, f) if self.batched else (f, 0)


@dataclass(frozen=True)
class Plan:
    """A contraction tree for one network, its pairwise steps (post-order) and its raw cost counts."""

    network: TTNetwork
    tree: Tree
    model: CostModel
    steps: tuple[Step, ...]
    terms: CostTerms

    @classmethod
    def from_tree(cls, network: TTNetwork, tree: Tree, model: CostModel | None = None) -> "Plan":
        """The plan of any tree (nested pairs of tensor ids, each id once); ValueError for a malformed tree."""
        model = model or CostModel()
        leaves = _leaves(tree) if _is_tree(tree) else None
        if leaves is None or sorted(leaves) != list(range(network.n_tensors)):
            raise ValueError(f"a tree must be nested pairs using each tensor id 0..{network.n_tensors - 1} exactly "
                             f"once, got {tree!r}")
        tree = _canonical(tree)
        sizes = _subset_sizes(network)
        steps: list[Step] = []
        terms = CostTerms()

        copies: list[tuple[int, bool, bool]] = []

        def walk(node: Tree) -> tuple[int, int, tuple[int, ...]]:  # (slot, tensor mask, stored index order)
            nonlocal terms
            if isinstance(node, int):
                return node, 1 << node, network.tensor_indices[node]
            (ls, lm, lo), (rs, rm, ro) = walk(node[0]), walk(node[1])
            shared = network.size(network.open_indices(lm) & network.open_indices(rm))
            slot = network.n_tensors + len(steps)
            batched = bool((lm | rm) & 1)
            steps.append(Step(ls, rs, slot, lm, rm, sizes[lm] // shared, shared, sizes[rm] // shared, batched))
            terms = terms + _step_terms(lm, rm, sizes, model)
            _, _, order, copy_l, copy_r = _step_views(network, lo, ro, batched)
            if copy_l:
                copies.append((sizes[lm], bool(lm & 1), lm != 1 << X or model.x_requires_grad))
            if copy_r:
                copies.append((sizes[rm], False, True))
            return slot, lm | rm, order

        _, full, final = walk(tree)
        if _final_copies(network.sizes, final, network.output):  # reordered into (b, output modes) by a copy
            copies.append((sizes[full], True, True))
        terms = terms + _copy_terms(copies, model)
        return cls(network, tree, model, tuple(steps), terms)

    # -- costs ----------------------------------------------------------------------------------------------------

    @property
    def weighted_cost(self) -> tuple[Fraction, Fraction]:
        """(c0, c1) of FLOPs + alpha·moved + beta·saved under the plan's model, exactly."""
        return self.terms.weighted(self.model)

    def cost(self, batch=BATCH):
        """The weighted cost as a sympy expression in b (or its value at an int batch)."""
        c0, c1 = self.weighted_cost
        return _linear_expr((c0, c1), batch)

    def flops(self, batch=BATCH, *, backward: bool | None = None):
        """FLOPs (forward + backward when the model has a backward, or as ``backward`` says) in b."""
        with_bwd = self.model.backward if backward is None else backward
        pair = self.terms.flops if with_bwd else self.terms.flops_forward
        return _linear_expr(pair, batch)

    # -- printing -------------------------------------------------------------------------------------------------

    def __str__(self) -> str:
        """E.g. ``((x·G1)·G2)·(G3·G4)``."""
        return _expression(self.tree, self.network.tensor_names, top=True)

    def describe(self) -> str:
        """One line per GEMM: operands, shapes (b = batch) and FLOPs."""
        names = list(self.network.tensor_names)
        lines = [f"{self}  [{self.network.op}, {self.network.layout.format.value}]"]
        for number, step in enumerate(self.steps, 1):
            names.append(f"t{number}")
            rows = (f"b·{step.m}" if step.m != 1 else "b") if step.batched else f"{step.m}"
            lines.append(f"  t{number} = {names[step.left]}·{names[step.right]}: [{rows} × {step.k}] @ "
                         f"[{step.k} × {step.n}] -> [{rows} × {step.n}], {_pretty(step.flops)} FLOPs")
        return "\n".join(lines)

    # -- execution ------------------------------------------------------------------------------------------------

    @cached_property
    def program(self) -> "_Program":
        """How ``execute`` runs the steps: operand views and index orders, worked out once (pure data)."""
        return _compile(self)

    @cached_property
    def runner(self) -> "PlanRunner":
        """The planned forward and backward as plain functions (``PlanRunner``)."""
        return PlanRunner(self)

    @cached_property
    def function(self) -> type:
        """A ``torch.autograd.Function`` that runs this plan with its planned backward (``execute_function``)."""
        return _make_function(self)


def _is_tree(node) -> bool:
    if isinstance(node, bool):
        return False
    if isinstance(node, int):
        return True
    return isinstance(node, tuple) and len(node) == 2 and _is_tree(node[0]) and _is_tree(node[1])


def _expression(node: Tree, names: Sequence[str], top: bool = False) -> str:
    if isinstance(node, int):
        return names[node]
    text = f"{_expression(node[0], names)}·{_expression(node[1], names)}"
    return text if top else f"({text})"


def _linear_expr(pair: Linear, batch=BATCH):
    """c0 + c1·batch with exact sympy rationals (batch: the symbol b or a number)."""
    return _as_rational(pair[0]) + _as_rational(pair[1]) * batch


def _num(value) -> str:
    """A number for tables: exact when small and whole, else 4 significant digits."""
    value = Fraction(value)
    if value.denominator == 1 and abs(value) < 10**6:
        return str(value.numerator)
    return f"{float(value):.4g}"


def _pretty(pair: Linear) -> str:
    """c0 + c1·b with 4-significant-digit coefficients."""
    c0, c1 = pair
    parts = ([f"{_num(c1)}·b"] if c1 else []) + ([_num(c0)] if c0 or not c1 else [])
    return " + ".join(parts)


# ---------------------------------------------------------------------------------------------------- envelope


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
            raise ValueError(f"batch {batch} is outside the planned bounds [{self.lo}, {self.hi or '∞'}]; "
                             f"plan again with bounds=(lo, hi) covering it")
        return next(piece for piece in self.pieces if piece.holds(batch))

    def choose(self, batch: int) -> Plan:
        """The cheapest plan for this batch size."""
        return self.piece_at(batch).plan

    def __str__(self) -> str:
        layout, net = self.network.layout, self.network
        what = "x @ M" if net.op == "matmul" else "x @ Mᵀ"
        bounds = f"{self.lo} <= b" + (f" <= {self.hi}" if self.hi is not None else "")
        head = [f"{layout.format.value.upper()} {what}, {layout.describe_modes()}, ranks {layout.ranks}; {bounds}",
                self.model.describe()]
        at = f"FLOPs at b={self.batch}" if self.batch is not None else "FLOPs"
        rows = [("batch", "plan", "cost", at)]
        for piece in self.pieces:
            flops = piece.plan.flops(self.batch) if self.batch is not None else None
            rows.append((piece.describe_interval(), str(piece.plan), _pretty(piece.plan.weighted_cost),
                         _num(flops) if self.batch is not None else _pretty(piece.plan.terms.flops)))
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


def plan(layer_or_spec, batch: int | None = None, *, op: str | None = None, alpha=DEFAULT_ALPHA,
         beta=DEFAULT_BETA, bounds: tuple[int, int | None] = (1, None), backward: bool = True,
         x_requires_grad: bool = True, itemsize: int = 4, gamma=DEFAULT_GAMMA) -> PlanEnvelope:
    """Plan ``x @ M`` (or ``x @ Mᵀ``) of a TT layer for every batch size in ``bounds``.

    ``layer_or_spec``: a ``TTMatrix``, a ``TTLinear`` (its op follows ``transposed``) or a ``TTLayout``. ``op``:
    "matmul" or "matmul_t" (default: what a TTLinear runs, else "matmul"). ``batch``: an int to report the plan
    that wins there (the table also shows FLOPs at that size). ``alpha`` / ``beta`` / ``gamma``: the cost weights
    (``CostModel``); ``backward=False`` plans inference (forward only).
    """
    layout, default_op = _layout_of(layer_or_spec)
    op = op if op is not None else default_op
    lo, hi = bounds
    _check_bounds(lo, hi)
    if batch is not None:
        batch = _as_int(batch, "batch")
        if batch < lo or (hi is not None and batch > hi):
            raise ValueError(f"batch must be an int within the bounds [{lo}, {hi or '∞'}], got {batch!r}")
    model = CostModel(alpha=alpha, beta=beta, itemsize=itemsize, backward=backward, x_requires_grad=x_requires_grad,
                      gamma=gamma)
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
        pieces.append(EnvelopePiece(_as_rational(start), sympy.oo if end is None else _as_rational(end), first, last,
                                    chosen, chosen.cost()))
    return PlanEnvelope(net, model, lo, hi, tuple(pieces), batch)


def _as_int(value, name: str) -> int:
    """Python ints and integer-like numbers (sympy.Integer, numpy ints) as int; ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _as_rational(value) -> sympy.Rational:
    value = Fraction(value)
    return sympy.Rational(value.numerator, value.denominator)


def _layout_of(obj) -> tuple[TTLayout, str]:
    """(layout, default op) of a TTLayout, TTMatrix or TTLinear, read by duck typing (no module import)."""
    if isinstance(obj, TTLayout):
        return obj, "matmul"
    tt = getattr(obj, "tt", None)
    if tt is not None and isinstance(getattr(tt, "layout", None), TTLayout):
        if hasattr(obj, "transposed"):
            return tt.layout, "matmul_t" if obj.transposed else "matmul"
        raise ValueError(f"{type(obj).__name__} looks rows up rather than multiplying; lookups are not planned. "
                         f"Plan its matrix (obj.tt) with op='matmul_t' for a tied output head")
    if isinstance(getattr(obj, "layout", None), TTLayout):
        return obj.layout, "matmul"
    raise ValueError(f"plan() takes a TTMatrix, a TTLinear or a TTLayout, got {type(obj).__name__}")


# --------------------------------------------------------------------------------------------------- execution


def _operand_view(order: tuple[int, ...], first: tuple[int, ...], second: tuple[int, ...], batched: bool):
    """How to see a stored tensor (indices ``order``) as the matrix (first × second) without copying if possible.

    Returns ("view",) when order is first + second, ("t",) when it is second + first (a transposed view; never
    for a batched tensor, whose batch must stay leading), else ("permute", perm).
    """
    body = order[1:] if batched else order
    if body == first + second:
        return ("view",)
    if not batched and body == second + first:
        return ("t",)
    wanted = ((_B,) if batched else ()) + first + second
    return ("permute", tuple(order.index(i) for i in wanted))


def _step_views(net: TTNetwork, order_a: tuple[int, ...], order_b: tuple[int, ...], batched: bool):
    """How ``execute`` runs one step on operands stored with index orders ``order_a`` (left) and ``order_b``.

    Returns (view_a, view_b, result order, copy_a, copy_b): the views of ``_operand_view``, the stored order of
    the GEMM's result, (b?, left's free indices, right's free indices), and whether each operand goes through a
    permute copy (a permute that torch can still view, ``_permute_copies``, is no copy). Of the two orders of the
    contracted indices (as stored in A, or in B) the one copying fewer
    elements wins, batch-dependent elements first; a tie keeps A's order. The cost model counts exactly these
    copies (``Plan.from_tree`` and the search call this same rule, ``_step_copies``).
    """
    order, copy_a, copy_b, shared = _step_copies(net.sizes, order_a, order_b, batched)
    free_a = tuple(i for i in order_a if i not in shared and i != _B)
    free_b = tuple(i for i in order_b if i not in shared)
    view_a = _operand_view(order_a, free_a, shared, batched)
    view_b = _operand_view(order_b, shared, free_b, False)
    return view_a, view_b, order, copy_a, copy_b


def _permute_copies(sizes: Sequence[int], order: tuple[int, ...], first: tuple[int, ...], second: tuple[int, ...],
                    batched: bool) -> bool:
    """Does ``reshape(permute(t))`` copy, for t stored contiguously with indices ``order``, read as the matrix
    (b? + first) × second? torch.reshape views whenever, within each of the two groups, consecutive dimensions of
    size > 1 are still adjacent in memory (size-1 dimensions never matter); else it copies. b counts as > 1."""
    dims = [i for i in order]
    stride, strides = 1, {}
    for i in reversed(dims):
        strides[i] = stride
        stride *= 1 if i == _B else sizes[i]
    for group in (((_B,) if batched else ()) + first, second):
        kept = [i for i in group if i == _B or sizes[i] != 1]
        for i, j in zip(kept, kept[1:]):
            if strides[i] != strides[j] * sizes[j] and not (j == _B):
                return True
    return False


def _final_copies(sizes: Sequence[int], final: tuple[int, ...], output: tuple[int, ...]) -> bool:
    """Does the reorder of the last result (stored as ``final``) into ``output`` = (b, output modes) copy?"""
    return final != output and _permute_copies(sizes, final, (), output[1:], True)


def _step_copies(sizes: Sequence[int], order_a: tuple[int, ...], order_b: tuple[int, ...], batched: bool):
    """The rule of ``_step_views`` without building views: (result order, copy_a, copy_b, shared indices in the
    order used). A view needs the operand stored as (free, shared) / (shared, free), or the reverse for a
    transposed view (never for the batched operand)."""
    set_a, set_b = set(order_a), set(order_b)
    shared_a = tuple(i for i in order_a if i in set_b)
    shared_b = tuple(i for i in order_b if i in set_a)
    free_a = tuple(i for i in order_a if i not in set_b and i != _B)
    free_b = tuple(i for i in order_b if i not in set_a)
    body_a = order_a[1:] if batched else order_a
    result = ((_B,) if batched else ()) + free_a + free_b

    def copies(shared):
        copy_a = (body_a != free_a + shared and (batched or body_a != shared + free_a)
                  and _permute_copies(sizes, order_a, free_a, shared, batched))
        copy_b = (order_b != shared + free_b and order_b != free_b + shared
                  and _permute_copies(sizes, order_b, shared, free_b, False))
        return copy_a, copy_b

    first = copies(shared_a)
    if shared_b == shared_a or not (first[0] or first[1]):
        return result, first[0], first[1], shared_a
    second = copies(shared_b)
    size_a = math.prod(sizes[i] for i in body_a)
    size_b = math.prod(sizes[i] for i in order_b)

    def key(c):
        return (c[0] * size_a, c[1] * size_b) if batched else (0, c[0] * size_a + c[1] * size_b)

    if key(second) < key(first):
        return result, second[0], second[1], shared_b
    return result, first[0], first[1], shared_a


@dataclass(frozen=True)
class _Instruction:
    """How one step sees its stored operands as matrices: views (see ``_operand_view``) and stored dims (no b)."""

    left_view: tuple
    right_view: tuple
    left_dims: tuple[int, ...]
    right_dims: tuple[int, ...]


@dataclass(frozen=True)
class _Program:
    """A plan made runnable: one instruction per step, then the permutation (if any) into the output's order."""

    instructions: tuple[_Instruction, ...]
    final_dims: tuple[int, ...]
    final_perm: tuple[int, ...] | None


def _compile(chosen: Plan) -> _Program:
    """Track each stored tensor's index order through the steps and pick copy-free views where they exist.

    A GEMM's result is stored as (b?, left's free indices, right's free indices); the next step reads it as is,
    transposed, or through a permute (a copy) — whichever order of the shared indices needs fewer copies.
    """
    net = chosen.network
    orders: list[tuple[int, ...]] = list(net.tensor_indices)
    instructions = []
    for step in chosen.steps:
        a, b = orders[step.left], orders[step.right]
        view_a, view_b, order, _, _ = _step_views(net, a, b, step.batched)
        orders.append(order)
        instructions.append(_Instruction(view_a, view_b, tuple(net.sizes[i] for i in a if i != _B),
                                         tuple(net.sizes[i] for i in b)))
    final = orders[-1]
    perm = None if final == net.output else tuple(final.index(i) for i in net.output)
    return _Program(tuple(instructions), tuple(net.sizes[i] for i in final if i != _B), perm)


def _as_matrix(t, view: tuple, dims: tuple[int, ...], rows: int, cols: int, batched: bool):
    """The stored tensor ``t`` as a (rows × cols) matrix (rows = -1, i.e. b·rows, when batched)."""
    if view[0] == "view":
        return t.reshape(-1 if batched else rows, cols)
    if view[0] == "t":
        return t.reshape(cols, rows).t()
    lead = (-1,) if batched else ()
    return t.reshape(lead + dims).permute(view[1]).reshape(-1 if batched else rows, cols)


def execute(chosen: Plan, x, cores: Sequence, layout: TTLayout):
    """Run ``chosen`` on x (..., in) and the (gated) cores -> (..., out), like ``ops.matmul`` / ``ops.matmul_t``.

    Only reshape / permute / t / mm / pad / slicing; every size comes from ``layout`` and the batch is always -1,
    so it traces on ``torch.fx.Proxy`` objects as well as running eagerly.
    """
    net = chosen.network
    if layout != net.layout:
        raise ValueError(f"the plan was made for {net.layout}, not {layout}; plan again for the new layout "
                         f"(ranks change when a TT is pruned)")
    if len(cores) != layout.n_cores:
        raise ValueError(f"expected {layout.n_cores} cores for this layout, got {len(cores)}")
    n_in, n_out = (layout.rows, layout.cols) if net.op == "matmul" else (layout.cols, layout.rows)
    pad_in, pad_out = math.prod(net.in_modes), math.prod(net.out_modes)
    x2 = x.reshape(-1, n_in)
    if pad_in != n_in:
        x2 = F.pad(x2, (0, pad_in - n_in))
    stored = [x2, *cores]
    program = chosen.program
    for step, inst in zip(chosen.steps, program.instructions):
        left = _as_matrix(stored[step.left], inst.left_view, inst.left_dims, step.m, step.k, step.batched)
        right = _as_matrix(stored[step.right], inst.right_view, inst.right_dims, step.k, step.n, False)
        stored.append(torch.mm(left, right))
    out = stored[-1]
    if program.final_perm is not None:
        out = out.reshape((-1,) + program.final_dims).permute(program.final_perm)
    out = ops._trim_cols(out.reshape(-1, pad_out), n_out, pad_out)
    return out.reshape(x.shape[:-1] + (n_out,))


# ------------------------------------------------------------------------------------------ custom autograd


def _permuted_shape(view: tuple, dims: tuple[int, ...], batched: bool) -> tuple[int, ...]:
    """Shape of ``t.reshape(lead + dims).permute(perm)`` in ``_as_matrix`` (the batch as -1, always leading)."""
    perm = view[1]
    if batched:
        return (-1,) + tuple(dims[p - 1] for p in perm[1:])
    return tuple(dims[p] for p in perm)


def _unview(grad, view: tuple, dims: tuple[int, ...], rows: int, cols: int, batched: bool):
    """The gradient of a stored tensor from the gradient of its matrix view (the inverse of ``_as_matrix``),
    in the stored tensor's element order; a permute's inverse is not a view of that order (a copy follows)."""
    if view[0] == "view":
        return grad
    if view[0] == "t":
        return grad.t()
    inverse = tuple(sorted(range(len(view[1])), key=view[1].__getitem__))
    return grad.reshape(_permuted_shape(view, dims, batched)).permute(inverse)


# MKL (torch 2.13 CPU, 2 threads) computes Aᵀ·dC for a tall A (m × k) and a narrow dC (m × n) 5–10× slower when
# n < 12 than as (dCᵀ·A)ᵀ: [1536×2048]·[2048×n] took 20–30 ms for n = 4..11, 3 ms for n = 12, and 2–4 ms the
# other way round. Pruned TT bonds land on such ranks, which made pruned layers slower than unpruned ones.
_NARROW_GRADIENT = 12


class PlanRunner:
    """The planned forward (optionally keeping each step's operands) and the planned backward of one plan, as
    plain functions of tensors — what ``Plan.function`` runs, reusable by ops that feed the backward other inputs
    (``comera_fx.rmm`` runs the core gradients on a sketch of x and of dy).

    Per step, backward needs the left operand A (for dB = Aᵀ·dC; b-dependent exactly when the step is batched,
    which is what the cost model counts as saved) and the right operand B (for dA = dC·Bᵀ; never b-dependent: x
    is always on the left). Backward runs the steps in reverse, one GEMM per gradient, and undoes each operand's
    view (a transposed view back, a permute back: the copy the model counts).
    """

    def __init__(self, chosen: "Plan"):
        net, layout = chosen.network, chosen.network.layout
        self.steps, self.instructions = chosen.steps, chosen.program.instructions
        self.n_in, self.n_out = (layout.rows, layout.cols) if net.op == "matmul" else (layout.cols, layout.rows)
        self.pad_in, self.pad_out = math.prod(net.in_modes), math.prod(net.out_modes)
        self.core_shapes = layout.core_shapes
        self.n_leaves = net.n_tensors
        self.final_perm, self.final_dims = chosen.program.final_perm, chosen.program.final_dims

    def forward(self, x, cores: Sequence, keep: bool = True):
        """(y, lefts, rights): y = x @ M (or x @ Mᵀ) of shape (..., n_out); the operands when ``keep``."""
        x2 = x.reshape(-1, self.n_in)
        if self.pad_in != self.n_in:
            x2 = F.pad(x2, (0, self.pad_in - self.n_in))
        stored = [x2, *cores]
        lefts, rights = [], []
        for step, inst in zip(self.steps, self.instructions):
            left = _as_matrix(stored[step.left], inst.left_view, inst.left_dims, step.m, step.k, step.batched)
            right = _as_matrix(stored[step.right], inst.right_view, inst.right_dims, step.k, step.n, False)
            if keep:
                lefts.append(left)
                rights.append(right)
            stored.append(torch.mm(left, right))
        out = stored[-1]
        if self.final_perm is not None:
            out = out.reshape((-1,) + self.final_dims).permute(self.final_perm)
        out = ops._trim_cols(out.reshape(-1, self.pad_out), self.n_out, self.pad_out)
        return out.reshape(x.shape[:-1] + (self.n_out,)), lefts, rights

    def backward(self, lefts: Sequence, rights: Sequence, dy, need_x: bool = True):
        """(dx or None, [d core_k]) from the kept operands and the output gradient dy (..., n_out)."""
        steps, instructions = self.steps, self.instructions
        n_steps = len(steps)
        grad = dy.reshape(-1, self.n_out)
        if self.pad_out != self.n_out:
            grad = F.pad(grad, (0, self.pad_out - self.n_out))
        if self.final_perm is not None:
            inverse = tuple(sorted(range(len(self.final_perm)), key=self.final_perm.__getitem__))
            shape = (-1,) + tuple(self.final_dims[p - 1] for p in self.final_perm[1:])
            grad = grad.reshape(shape).permute(inverse)
        grads: list = [None] * (self.n_leaves + n_steps)
        grads[steps[-1].result] = grad
        for i in range(n_steps - 1, -1, -1):
            step, inst = steps[i], instructions[i]
            d_out = grads[step.result].reshape(-1 if step.batched else step.m, step.n)
            grads[step.result] = None
            if step.left != 0 or need_x:
                d_left = torch.mm(d_out, rights[i].t())
                grads[step.left] = _unview(d_left, inst.left_view, inst.left_dims, step.m, step.k, step.batched)
            if step.n < _NARROW_GRADIENT:  # Aᵀ·dC with few columns: as (dCᵀ·A)ᵀ, the same numbers
                d_right = torch.mm(d_out.t(), lefts[i]).t()
            else:
                d_right = torch.mm(lefts[i].t(), d_out)
            grads[step.right] = _unview(d_right, inst.right_view, inst.right_dims, step.k, step.n, False)
        dx = None
        if need_x:
            dx = grads[0].reshape(-1, self.pad_in)
            if self.pad_in != self.n_in:
                dx = dx[:, :self.n_in]
            dx = dx.reshape(dy.shape[:-1] + (self.n_in,))
        return dx, [grads[k + 1].reshape(self.core_shapes[k]) for k in range(self.n_leaves - 1)]


def _make_function(chosen: "Plan") -> type:
    """A torch.autograd.Function running ``chosen`` forward and its planned backward (``PlanRunner``).

    Forward saves, per step, the two operands its backward needs and nothing else: intermediates that are only
    step results are not saved.
    """
    runner = chosen.runner
    n_steps = len(chosen.steps)

    class PlannedProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *cores):
            out, lefts, rights = runner.forward(x, cores)
            ctx.save_for_backward(*lefts, *rights)
            return out

        @staticmethod
        def backward(ctx, dy):
            saved = ctx.saved_tensors
            dx, core_grads = runner.backward(saved[:n_steps], saved[n_steps:], dy, ctx.needs_input_grad[0])
            return (dx, *core_grads)

    PlannedProduct.__name__ = PlannedProduct.__qualname__ = "PlannedProduct"
    return PlannedProduct


def execute_function(chosen: "Plan", x, cores: Sequence, layout: TTLayout):
    """``execute`` through a custom ``torch.autograd.Function`` (``Plan.function``): the same forward, and a backward
    that runs the planned gradient GEMMs and keeps only the operands the cost model counts. Real tensors only (use
    ``execute`` on ``torch.fx`` proxies); traces under ``torch.compile`` (Dynamo) without graph breaks."""
    if layout != chosen.network.layout:
        raise ValueError(f"the plan was made for {chosen.network.layout}, not {layout}; plan again for the new "
                         f"layout (ranks change when a TT is pruned)")
    if len(cores) != layout.n_cores:
        raise ValueError(f"expected {layout.n_cores} cores for this layout, got {len(cores)}")
    if not torch.is_grad_enabled():
        # Nothing to save: the plain executor. (Also sidesteps Dynamo, which under no_grad inlines two such Functions
        # of different layouts in one graph wrongly: their forwards share one code object, only the closures differ.)
        return execute(chosen, x, cores, layout)
    return chosen.function.apply(x, *cores)
