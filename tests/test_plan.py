"""The contraction planner (comera_fx/tt/plan/) against independent references.

* Execution: any contraction tree (drawn at random, or every tree of small networks) computes x @ M and x @ Mᵀ and
  their gradients equal to a dense float64 reference built with opt_einsum from the cores.
* Optimality: forward FLOPs never exceed those of opt_einsum's ``optimal`` path (an oracle on concrete sizes,
  recounted with the planner's own counting), and the envelope equals a brute-force minimum over all trees.
* Known case: CoMERA's 768² layer at b = 4096 merges the row cores and the column cores ((x·L)·R).
"""

from __future__ import annotations

import itertools
import math

import opt_einsum as oe
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import fx, nn

from comera_fx.testing.strategies import tt_inputs, tt_layouts, tt_specs
from comera_fx.tt import TTEmbedding, TTFormat, TTLayout, TTLinear, TTMatrix
from comera_fx.tt import plan as planner
from comera_fx.tt.plan.cost import ScaledWeights, _copy_terms, _step_terms, scaled_copy, scaled_step
from helpers_models import random_trees
from comera_fx.tt.decompose import random_tt_cores

COMERA_768 = TTLayout(TTFormat.TT, 768, 768, (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1))
COMERA_768_3072 = TTLayout(TTFormat.TT, 768, 3072, (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1))
ops_ = st.sampled_from(planner.OPS)

# ------------------------------------------------------------------------------------- independent references

BOND, ROW, COL = 0, 100, 200  # index labels for interleaved einsum calls


def reference_matrix(cores, layout: TTLayout) -> torch.Tensor:
    """M (rows × cols), differentiable in the cores: the chain contracted by opt_einsum, padding sliced off."""
    operands = []
    for k, core in enumerate(cores):
        labels = [ROW + k] if layout.format is TTFormat.TT else [ROW + k, COL + k]
        operands += [core, [BOND + k, *labels, BOND + k + 1]]
    n = len(cores)
    modes = [ROW + k for k in range(n)] + ([COL + k for k in range(n)] if layout.format is TTFormat.TTM else [])
    full = oe.contract(*operands, [BOND, *modes, BOND + n])
    return full.reshape(layout.padded_rows, layout.padded_cols)[: layout.rows, : layout.cols]


def reference_apply(x, cores, layout: TTLayout, op: str) -> torch.Tensor:
    m = reference_matrix(cores, layout)
    return x @ m if op == "matmul" else x @ m.t()


def einsum_network(layout: TTLayout, op: str, batch: int) -> tuple[str, list[tuple[int, ...]]]:
    """The network as an einsum equation and operand shapes (x first, then the cores; size-1 end bonds dropped)."""
    label = iter(oe.get_symbol(i) for i in itertools.count())
    b = next(label)
    rows = [(next(label), m) for m in layout.row_modes]
    cols = [(next(label), m) for m in layout.col_modes]
    n = layout.n_cores
    bonds = [None] + [(next(label), layout.ranks[k]) for k in range(1, n)] + [None]
    modes = [[mode] for mode in rows + cols] if layout.format is TTFormat.TT else [list(p) for p in zip(rows, cols)]
    x_side, out_side = (rows, cols) if op == "matmul" else (cols, rows)
    terms = [[(b, batch), *x_side]]
    terms += [[i for i in [bonds[k], *modes[k], bonds[k + 1]] if i is not None] for k in range(n)]
    output = [(b, batch), *out_side]
    equation = ",".join("".join(c for c, _ in t) for t in terms) + "->" + "".join(c for c, _ in output)
    return equation, [tuple(s for _, s in t) for t in terms]


def path_to_tree(path) -> planner.Tree:
    """opt_einsum's path (positions in the shrinking operand list, result appended) as a nested-pair tree."""
    nodes: list = list(range(len(path) + 1))
    for step in path:
        assert len(step) == 2, f"unexpected single-operand step {step}"
        i, j = sorted(step)
        right, left = nodes.pop(j), nodes.pop(i)
        nodes.append((left, right))
    (tree,) = nodes
    return tree


def all_trees(ids: list[int]):
    """Every full binary tree over ``ids`` once (the first id's side listed first): (2n-3)!! trees."""
    if len(ids) == 1:
        yield ids[0]
        return
    first, rest = ids[0], ids[1:]
    for r in range(len(rest)):
        for chosen in itertools.combinations(rest, r):
            others = [i for i in rest if i not in chosen]
            for left in all_trees([first, *chosen]):
                for right in all_trees(others):
                    yield (left, right)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-10) -> None:
    assert tuple(actual.shape) == tuple(expected.shape)
    err = torch.linalg.norm((actual.detach() - expected.detach()).reshape(-1)).item()
    scale = torch.linalg.norm(expected.detach().reshape(-1)).item()
    assert err <= tol * scale, f"relative error {err / max(scale, 1e-300):.3g} > {tol}"


def outputs_and_grads(fn, x: torch.Tensor, cores) -> tuple[torch.Tensor, list]:
    """fn(x, cores) and the gradients of a fixed random projection of it w.r.t. x and every core."""
    x = x.detach().requires_grad_()
    cores = [c.detach().requires_grad_() for c in cores]
    y = fn(x, cores)
    weights = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    return y, torch.autograd.grad((y * weights).sum(), [x, *cores], allow_unused=True)


class Reference:
    """Output and gradients of the dense reference for one (x, cores, layout, op), computed once."""

    def __init__(self, x, cores, layout: TTLayout, op: str):
        self.x, self.cores, self.layout = x, cores, layout
        self.y, self.grads = outputs_and_grads(lambda a, c: reference_apply(a, c, layout, op), x, cores)

    def check(self, chosen: planner.Plan) -> None:
        """The plan's output and gradients (x and every core) match, float64 rel. error <= 1e-10."""
        y, grads = outputs_and_grads(lambda a, c: planner.execute(chosen, a, c, self.layout), self.x, self.cores)
        assert_rel_close(y, self.y)
        for got, want in zip(grads, self.grads):
            if want is None:  # only for an empty batch: nothing flows anywhere
                assert got is None or not got.any()
            else:
                assert_rel_close(got if got is not None else torch.zeros_like(want), want)


# ------------------------------------------------------------------------------------------------- execution


@given(data=st.data(), spec=tt_specs(max_modes=3, max_rank=6), op=ops_)
def test_any_tree_and_every_envelope_plan_match_dense(data, spec, op):
    layout = spec.layout
    net = planner.build_network(layout, op)
    x = data.draw(tt_inputs(layout, side="rows" if op == "matmul" else "cols"))
    tree = data.draw(random_trees(net.n_tensors))
    reference = Reference(x, spec.cores, layout, op)
    reference.check(planner.Plan.from_tree(net, tree))
    for chosen in planner.plan(layout, op=op).plans:
        reference.check(chosen)


# Five tensors at most (105 trees each): every tree runs forward and backward; bigger networks get random trees.
SMALL_LAYOUTS = [
    TTLayout(TTFormat.TT, 5, 7, (2, 3), (4, 2), (1, 3, 2, 2, 1)),  # padded rows (6) and columns (8)
    TTLayout(TTFormat.TT, 6, 3, (1, 6), (3, 1), (1, 1, 3, 1, 1)),  # 1-sized modes, rank-1 bonds
    TTLayout(TTFormat.TTM, 5, 7, (2, 1, 3), (4, 2, 1), (1, 3, 2, 1)),  # padded TTM, 1-sized modes
    TTLayout(TTFormat.TTM, 12, 10, (3, 2, 2), (2, 5, 1), (1, 4, 3, 1)),
]


@pytest.mark.parametrize("op", planner.OPS)
@pytest.mark.parametrize("layout", SMALL_LAYOUTS, ids=lambda l: f"{l.format.value}-{l.describe_modes()}")
def test_every_tree_of_small_networks_matches_dense(layout, op):
    generator = torch.Generator().manual_seed(0)
    cores = random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64, generator=generator)
    x = torch.randn(2, 3, layout.rows if op == "matmul" else layout.cols, dtype=torch.float64, generator=generator)
    net = planner.build_network(layout, op)
    trees = list(all_trees(list(range(net.n_tensors))))
    assert len(trees) == math.prod(range(1, 2 * net.n_tensors - 2, 2))  # (2n-3)!!
    reference = Reference(x, cores, layout, op)
    for tree in trees:
        reference.check(planner.Plan.from_tree(net, tree))


def test_execute_traces_into_a_batch_free_graph_of_pairwise_ops():
    layout = TTLayout(TTFormat.TT, 5, 7, (2, 3), (4, 2), (1, 3, 2, 2, 1))
    cores = random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    chosen = planner.plan(layout).choose(1)

    class Planned(nn.Module):
        def __init__(self):
            super().__init__()
            self.cores = nn.ParameterList(cores)

        def forward(self, x):
            return planner.execute(chosen, x, list(self.cores), layout)

    gm = fx.symbolic_trace(Planned())
    targets = {str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes if n.op.startswith("call")}
    assert targets <= {"reshape", "permute", "t", "mm", "pad", "getitem", "getattr", "add"}, targets
    assert "mm" in targets
    for shape in [(4, 5), (2, 3, 5), (5,)]:
        x = torch.randn(shape, dtype=torch.float64)
        assert_rel_close(gm(x), reference_apply(x, cores, layout, "matmul"))


# ------------------------------------------------------------------------------------------------ optimality


@given(layout=tt_layouts(max_modes=3), op=ops_, batch=st.integers(1, 10_000))
def test_forward_flops_never_exceed_opt_einsum_optimal(layout, op, batch):
    forward_flops = dict(alpha=0, beta=0, backward=False)
    chosen = planner.plan(layout, op=op, **forward_flops).choose(batch)
    equation, shapes = einsum_network(layout, op, batch)
    path, _ = oe.contract_path(equation, *shapes, shapes=True, optimize="optimal")
    net = planner.build_network(layout, op)
    oracle = planner.Plan.from_tree(net, path_to_tree(path), planner.CostModel(**forward_flops))
    assert chosen.flops(batch) <= oracle.flops(batch)


models = st.builds(
    planner.CostModel,
    alpha=st.sampled_from([0, 1, planner.DEFAULT_ALPHA, 37.25]),
    beta=st.sampled_from([0, planner.DEFAULT_BETA, 3]),
    itemsize=st.sampled_from([2, 4]),
    backward=st.booleans(),
    x_requires_grad=st.booleans(),
    gamma=st.sampled_from([0, planner.DEFAULT_GAMMA, 12.5]),
)


# (left, right) tensor masks of one step; bit 0 is x: x alone, x with a core, cores only, either side
STEP_SIDES = [(1, 2), (2, 1), (3, 4), (4, 3), (2, 4), (6, 8)]


@given(
    model=models,
    sides=st.sampled_from(STEP_SIDES),
    sa=st.integers(1, 5000),
    sb=st.integers(1, 5000),
    sc=st.integers(1, 5000),
    n=st.integers(1, 5000),
    needs_grad=st.booleans(),
)
def test_the_searchs_integer_costs_are_the_cost_models(model, sides, sa, sb, sc, n, needs_grad):
    """The exact search weighs steps and copies in integers (``scaled_step`` / ``scaled_copy``): scale times what
    ``CostTerms.weighted`` gives for ``_step_terms`` / ``_copy_terms``, so its envelope is the plans' costs."""
    left, right = sides
    sizes = [0] * 16
    sizes[left], sizes[right], sizes[left | right] = sa, sb, sc
    w = ScaledWeights.of(model)
    grad_left, grad_right = left != 1 or model.x_requires_grad, right != 1 or model.x_requires_grad
    step = scaled_step(sa, sb, sc, bool(left & 1), bool(right & 1), grad_left, grad_right, w)
    assert step == tuple(c * w.scale for c in _step_terms(left, right, sizes, model).weighted(model))
    for batched in (False, True):
        weighted = _copy_terms([(n, batched, needs_grad)], model).weighted(model)
        assert weighted[batched] * w.scale == scaled_copy(n, needs_grad, w) and weighted[not batched] == 0


@st.composite
def bounds(draw) -> tuple[int, int | None]:
    lo = draw(st.integers(1, 64))
    hi = draw(st.one_of(st.none(), st.integers(lo, lo + 5000)))
    return lo, hi


# Brute force needs every tree: at most 6 tensors (945 trees) keeps 200 examples within a few seconds.
small_layouts = tt_layouts(max_modes=3).filter(lambda l: l.n_cores + 1 <= 6)


@given(data=st.data(), layout=small_layouts, op=ops_, model=models, limits=bounds())
def test_envelope_is_the_minimum_over_all_trees(data, layout, op, model, limits):
    lo, hi = limits
    result = planner.plan(
        layout,
        op=op,
        alpha=model.alpha,
        beta=model.beta,
        itemsize=model.itemsize,
        backward=model.backward,
        x_requires_grad=model.x_requires_grad,
        bounds=limits,
        gamma=model.gamma,
    )
    net = result.network
    lines = [planner.Plan.from_tree(net, t, model).weighted_cost for t in all_trees(list(range(net.n_tensors)))]

    def best(b):
        return min(c0 + c1 * b for c0, c1 in lines)

    top = hi if hi is not None else lo + 10**6
    sizes = {lo, top, data.draw(st.integers(lo, top))}
    for bp in result.breakpoints:
        sizes |= {b for b in (int(math.floor(bp)), int(math.floor(bp)) + 1) if lo <= b <= top}
    for b in sorted(sizes):
        c0, c1 = result.choose(b).weighted_cost
        assert c0 + c1 * b == best(b), f"b={b}: chose {result.choose(b)}"

    pieces = result.envelope
    assert pieces[0].lo == lo and pieces[0].first == lo
    for before, after in zip(pieces, pieces[1:]):
        assert before.hi == after.lo and before.plan.tree != after.plan.tree
        bp = after.lo
        assert before.cost.subs(planner.BATCH, bp) == after.cost.subs(planner.BATCH, bp)
        # the argmin changes at bp: the earlier plan is no worse before it, the later one no worse after it
        assert before.cost.subs(planner.BATCH, bp - 1) <= after.cost.subs(planner.BATCH, bp - 1)
        assert after.cost.subs(planner.BATCH, bp + 1) <= before.cost.subs(planner.BATCH, bp + 1)


def _leaf_set(node) -> frozenset[int]:
    return frozenset([node]) if isinstance(node, int) else _leaf_set(node[0]) | _leaf_set(node[1])


@pytest.mark.parametrize("layout", [COMERA_768, COMERA_768_3072], ids=["768x768", "768x3072"])
@pytest.mark.parametrize("op", planner.OPS)
@pytest.mark.parametrize("backward", [True, False])
def test_comera_layers_at_large_batch_use_merged_factors(layout, op, backward):
    """(x·L)·R: x meets the merged cores of its own side, then the merged cores of the other side."""
    tree = planner.plan(layout, op=op, backward=backward).choose(4096).tree
    rows, cols = frozenset(range(1, 4)), frozenset(range(4, 7))
    near, far = (rows, cols) if op == "matmul" else (cols, rows)
    (x, left), right = tree
    assert x == 0 and _leaf_set(left) == near and _leaf_set(right) == far, tree


def test_comera_768_envelope_changes_plan_with_batch():
    result = planner.plan(COMERA_768, 4096)
    assert len(result.envelope) >= 2  # at b = 1 pushing x through the cores wins
    assert result.choose(1) != result.choose(4096)
    text = str(result)
    assert "at b = 4096" in text and str(result.choose(4096)) in text and "breakpoints" in text


# ----------------------------------------------------------------------------------------------------- the API


def test_plan_accepts_modules_and_follows_a_transposed_linear():
    tt = TTMatrix.random(6, 10, format=TTFormat.TT, row_modes=(2, 3), col_modes=(5, 2), std=1.0)
    assert planner.plan(tt).network.op == "matmul"
    assert planner.plan(TTLinear(tt)).network == planner.plan(tt.layout).network
    assert planner.plan(TTLinear(tt, transposed=True)).network.op == "matmul_t"
    with pytest.raises(ValueError, match="lookups are not planned"):
        planner.plan(TTEmbedding(tt))
    with pytest.raises(ValueError, match="TTMatrix, a TTLinear or a TTLayout"):
        planner.plan(nn.Linear(6, 10))


def test_printed_plan_and_steps():
    chosen = planner.Plan.from_tree(planner.build_network(COMERA_768), ((((0, 1), 2), 3), (4, (5, 6))))
    assert str(chosen) == "(((x·G1)·G2)·G3)·(G4·(G5·G6))"
    assert [(s.m, s.k, s.n, s.batched) for s in chosen.steps][0] == (64, 12, 12, True)
    assert chosen.flops(1, backward=False) == sum(2 * s.m * s.k * s.n for s in chosen.steps)
    assert "t1 = x·G1: [b·64 × 12] @ [12 × 12]" in chosen.describe()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(op="linear"), "op must be one of"),
        (dict(bounds=(0, None)), "lower batch bound"),
        (dict(bounds=(10, 5)), "upper batch bound"),
        (dict(alpha=-1), "alpha must be"),
        (dict(beta=float("nan")), "beta must be"),
        (dict(gamma=-1), "gamma must be"),
        (dict(itemsize=0), "itemsize"),
        (dict(batch=0), "within the bounds"),
    ],
)
def test_bad_arguments_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        planner.plan(COMERA_768, **bad)


def test_choose_outside_the_bounds_and_a_stale_layout_are_refused():
    result = planner.plan(COMERA_768, bounds=(8, 64))
    assert result.choose(0) == result.choose(8)  # an empty batch runs any plan
    with pytest.raises(ValueError, match="outside the planned bounds"):
        result.choose(65)
    with pytest.raises(ValueError, match="plan again"):
        planner.execute(result.choose(8), torch.zeros(1, 768), [], COMERA_768.with_ranks((1, 12, 30, 29, 30, 12, 1)))
    with pytest.raises(ValueError, match="exactly once"):
        planner.Plan.from_tree(result.network, ((0, 1), (2, 2)))


# ------------------------------------------------------------------------------------------- the copy term


class _CopyCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Elements written by aten copy kernels (clone / copy) while active: what a permute followed by a reshape
    really copies, as torch decides it."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "clone" in name or "copy" in name:
            self.elements += out.numel()
        return out


def _forward_copies(chosen: planner.Plan, batch: int) -> int:
    """Elements the cost model says the forward copies at this batch (bytes_copied / (2 · itemsize), no backward)."""
    forward = planner.Plan.from_tree(chosen.network, chosen.tree, planner.CostModel(backward=False, itemsize=1))
    c0, c1 = forward.terms.bytes_copied
    return (c0 + c1 * batch) // 2


@given(data=st.data(), layout=tt_layouts(max_modes=3, max_rank=5), op=ops_, batch=st.integers(2, 5))
def test_counted_copies_are_the_copies_torch_makes(data, layout, op, batch):
    net = planner.build_network(layout, op)
    chosen = planner.Plan.from_tree(net, data.draw(random_trees(net.n_tensors)))
    cores = random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64)
    x = torch.randn(batch, layout.rows if op == "matmul" else layout.cols, dtype=torch.float64)
    with _CopyCounter() as counter:
        planner.execute(chosen, x, cores, layout)
    assert counter.elements == _forward_copies(chosen, batch), str(chosen)


@pytest.mark.parametrize("layout", [COMERA_768, COMERA_768_3072], ids=["768x768", "768x3072"])
def test_copy_term_moves_the_small_batch_plan_of_comera_layers(layout):
    """At 64 tokens the plan that reads x through a permute, (((x·(G1·G2))·G3)·G4)·(G5·G6), measured 16-21% slower
    than ((x·((G1·G2)·G3))·G4)·(G5·G6) (benchmarks/RESULTS.md); with the copies counted the latter is chosen."""
    result = planner.plan(layout)
    copying = planner.Plan.from_tree(result.network, ((((0, (1, 2)), 3), 4), (5, 6)))
    chosen = result.choose(64)
    assert str(chosen) == "((x·((G1·G2)·G3))·G4)·(G5·G6)"
    cores = random_tt_cores(layout.core_shapes, 1.0)
    for plan_, per_token in ((copying, 768), (chosen, 0)):  # the copying plan copies x (and the small core G3)
        with _CopyCounter() as counter:
            planner.execute(plan_, torch.randn(64, 768), cores, layout)
        assert counter.elements == _forward_copies(plan_, 64)
        assert _forward_copies(plan_, 65) - _forward_copies(plan_, 64) == per_token
    # the breakpoint between the two, 175260/3923 ≈ 44.7, was 38592/407 ≈ 94.8 before the copy term
    assert any(abs(float(bp) - 44.67) < 0.01 for bp in result.breakpoints), result.breakpoints
