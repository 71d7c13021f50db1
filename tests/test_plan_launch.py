"""Issue 44 item 5: the cost model's per-device launch term (``CostModel.launch``, ``DEVICE_LAUNCH``).

Every GEMM and every permute copy a plan runs is a kernel launched; the GEMMs are the same in number for every tree
of a network, the copies are not, so a launch cost moves the plan towards fewer kernels. Checked against brute force
over every contraction order with concrete sizes, and the counted kernels against the ones torch runs."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from test_plan import all_trees

from comera_fx.testing.strategies import tt_layouts
from comera_fx.tt import TTFormat, TTLayout
from comera_fx.tt import plan as planner
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.plan.cost import (
    DEVICE_LAUNCH,
    CostModel,
    ScaledWeights,
    _copy_terms,
    _step_terms,
    scaled_copy,
    scaled_copy_launches,
    scaled_step,
)

TINY = TTLayout(TTFormat.TT, 16, 16, (8, 2), (4, 4), (1, 3, 3, 3, 1))  # x and four cores: 105 trees
COMERA_768 = TTLayout(TTFormat.TT, 768, 768, (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1))


def brute_force(layout: TTLayout, model: CostModel, batch: int) -> tuple[int, set]:
    """The least cost at ``batch`` over every tree of the layout's network, and the trees reaching it."""
    net = planner.build_network(layout, "matmul")
    costs = {}
    for tree in all_trees(list(range(net.n_tensors))):
        plan_ = planner.Plan.from_tree(net, tree, model)
        costs[plan_.tree] = plan_.cost(batch)
    best = min(costs.values())
    return best, {tree for tree, cost in costs.items() if cost == best}


def kernels_torch_runs(plan_: planner.Plan, layout: TTLayout, batch: int, backward: bool) -> int:
    """GEMMs and copy kernels torch runs for the plan (forward, and backward of a random projection)."""
    counted = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "bmm", "addmm", "clone", "copy_", "_to_copy"):
                counted.append(name)
            return func(*args, **(kwargs or {}))

    cores = [c.requires_grad_(backward) for c in random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64)]
    x = torch.randn(batch, layout.rows, dtype=torch.float64, requires_grad=backward)
    weights = torch.randn(batch, layout.cols, dtype=torch.float64)
    with Count():
        y = planner.execute(plan_, x, cores, layout)
        if backward:
            (y * weights).sum().backward()
    return len(counted)


def test_the_launch_term_moves_a_tiny_plan_to_fewer_kernels_as_brute_force_does():
    """x (2 × 16) through four rank-3 cores, forward + backward: without a launch cost the chain
    (((x·G1)·G2)·G3)·G4 wins (least FLOPs and bytes), with one the plan that merges G1·G2 first wins (one copy
    fewer, forward and backward: 12 kernels, not 16); at each weight the planner's plan is a brute-force argmin over
    all 105 orders, and the kernels the model counts (forward only, and forward + backward) are those torch runs."""
    chosen = {}
    for launch in (0, 10**3, DEVICE_LAUNCH["cuda"]):
        model = CostModel(launch=launch)
        plan_ = planner.plan(TINY, launch=launch).choose(2)
        best, argmin = brute_force(TINY, model, 2)
        assert plan_.cost(2) == best and plan_.tree in argmin, (launch, str(plan_))
        chosen[launch] = plan_
    assert str(chosen[0]) == "(((x·G1)·G2)·G3)·G4"
    assert str(chosen[10**3]) == str(chosen[DEVICE_LAUNCH["cuda"]]) == "((x·(G1·G2))·G3)·G4"
    assert chosen[0].terms.launches == (16, 0) and chosen[10**3].terms.launches == (12, 0)
    assert chosen[0].flops(2) < chosen[10**3].flops(2)  # the launch term bought fewer kernels with FLOPs
    for plan_ in chosen.values():
        for backward in (False, True):
            counted = planner.Plan.from_tree(plan_.network, plan_.tree, CostModel(backward=backward))
            assert kernels_torch_runs(plan_, TINY, 2, backward) == counted.terms.launches[0], (str(plan_), backward)


def test_on_the_device_model_comera_768_at_16_tokens_launches_fewer_kernels():
    """CoMERA's 768 × 768 layer at 16 tokens: the CPU model (launch 0) reads x through a permute; with CUDA's
    launch cost the plan copies nothing batch-sized (18 kernels forward + backward instead of 22)."""
    cpu, cuda = CostModel.for_device("cpu"), CostModel.for_device(torch.device("cuda", 0))
    assert cpu.launch == 0 and cuda.launch == DEVICE_LAUNCH["cuda"]
    on_cpu = planner.plan(COMERA_768, launch=cpu.launch).choose(16)
    on_cuda = planner.plan(COMERA_768, launch=cuda.launch).choose(16)
    assert str(on_cpu) == "(((x·(G1·G2))·G3)·G4)·(G5·G6)" and on_cpu.terms.launches == (22, 0)
    assert str(on_cuda) == "((x·((G1·G2)·G3))·G4)·(G5·G6)" and on_cuda.terms.launches == (18, 0)
    assert "kernels" in cuda.describe() and "kernels" not in cpu.describe()
    assert CostModel.for_device("cuda", launch=5).launch == 5


# At most 5 tensors (105 trees) keeps brute force cheap.
small_layouts = tt_layouts(max_modes=2).filter(lambda layout: layout.n_cores + 1 <= 5)


@given(
    layout=small_layouts,
    launch=st.sampled_from([0, 1, 10**4, 10**6, 10**9]),
    backward=st.booleans(),
    batch=st.integers(1, 300),
)
def test_the_chosen_plan_is_a_brute_force_argmin_with_any_launch_cost(layout, launch, backward, batch):
    model = CostModel(launch=launch, backward=backward)
    plan_ = planner.plan(layout, launch=launch, backward=backward).choose(batch)
    best, argmin = brute_force(layout, model, batch)
    assert plan_.cost(batch) == best and plan_.tree in argmin


@given(
    launch=st.sampled_from([0, 3, 10**6, 2.5]),
    sa=st.integers(1, 500),
    sb=st.integers(1, 500),
    sc=st.integers(1, 500),
    n=st.integers(1, 500),
    needs_grad=st.booleans(),
    backward=st.booleans(),
)
def test_the_searchs_integer_launch_costs_are_the_cost_models(launch, sa, sb, sc, n, needs_grad, backward):
    """``scaled_step`` and ``scaled_copy`` + ``scaled_copy_launches`` are scale × ``CostTerms.weighted``, launch
    term included (the exact search's integers and the plans' costs agree)."""
    model = CostModel(launch=launch, backward=backward)
    w = ScaledWeights.of(model)
    sizes = [0] * 8
    left, right = 1, 2  # x with a core
    sizes[left], sizes[right], sizes[left | right] = sa, sb, sc
    assert scaled_step(sa, sb, sc, True, False, True, True, w) == tuple(
        c * w.scale for c in _step_terms(left, right, sizes, model).weighted(model)
    )
    for batched in (False, True):
        c0, c1 = _copy_terms([(n, batched, needs_grad)], model).weighted(model)
        bytes_part = scaled_copy(n, needs_grad, w)
        launches = scaled_copy_launches(needs_grad, w)
        assert (c0 * w.scale, c1 * w.scale) == ((launches, bytes_part) if batched else (bytes_part + launches, 0))
    assert math.isclose(float(model.launch_weight), launch)
