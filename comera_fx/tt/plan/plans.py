"""One contraction tree made concrete: its pairwise GEMMs (``Step``) and ``Plan`` (costs, printing).

A plan is a description only: running it is the business of ``execution`` (``execute``, ``plan_program``) and
``autograd`` (``plan_runner``, ``plan_function``, ``execute_function``), which take a plan; nothing here imports them.
``BATCH`` is the symbol b of the cost expressions a plan prints (sympy only builds those; the counts are ints).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import sympy

from .cost import CostModel, CostTerms, _copy_terms, _num, _step_terms, _subset_sizes
from .network import X, Linear, Tree, TTNetwork, _canonical, _leaves
from .views import _final_copies, _step_views


#: The batch size (all leading dimensions of x flattened) in cost expressions.
BATCH = sympy.Symbol("b", integer=True, positive=True)


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
            raise ValueError(
                f"a tree must be nested pairs using each tensor id 0..{network.n_tensors - 1} exactly "
                f"once, got {tree!r}"
            )
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
            lines.append(
                f"  t{number} = {names[step.left]}·{names[step.right]}: [{rows} × {step.k}] @ "
                f"[{step.k} × {step.n}] -> [{rows} × {step.n}], {_pretty(step.flops)} FLOPs"
            )
        return "\n".join(lines)


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


def _pretty(pair: Linear) -> str:
    """c0 + c1·b with 4-significant-digit coefficients."""
    c0, c1 = pair
    parts = ([f"{_num(c1)}·b"] if c1 else []) + ([_num(c0)] if c0 or not c1 else [])
    return " + ".join(parts)


def _as_rational(value) -> sympy.Rational:
    value = Fraction(value)
    return sympy.Rational(value.numerator, value.denominator)
