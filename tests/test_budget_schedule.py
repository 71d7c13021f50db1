"""RankAdaptive's budget schedule (the default): reaching a size target by a known step, the schedule's sizes,
importance ranking, rank-0 layers, TT rounding, checkpoints, and the refusals that keep a target from being
silently ignored.

References are independent of the code under test: the teacher's dense float64 weight, the schedule's formula
written out here, singular values from torch.linalg.svd of the fully contracted tensor.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx.runtime import BudgetConfig, CoMERAConfig, RankAdaptive
from comera_fx.runtime.rank_config import config_from_dict
from comera_fx.runtime.shrink import tt_round
from comera_fx.tt import TTMatrix

CONFIG32 = comera_fx.TensorizeConfig(max_rank=32, min_numel=1, min_dim=1)


pytestmark = pytest.mark.usefixtures("one_thread")


def teacher_problem(seed: int = 0, d: int = 64):
    """A student nn.Linear(d, d) in TT form at max rank 32 learns a teacher that is a TT matrix of rank 4 in the
    same layout. Returns (student, x, y, x_val, y_val) with y = x·W_teacherᵀ computed from the dense teacher."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, d, bias=False)).double()
    comera_fx.tensorize_(model, CONFIG32)
    layout = model[0].tt.layout
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = TTMatrix.random(
        layout.rows,
        layout.cols,
        format=layout.format,
        row_modes=layout.row_modes,
        col_modes=layout.col_modes,
        max_rank=4,
        std=1 / math.sqrt(d),
        dtype=torch.float64,
        generator=gen,
    )
    w = teacher.dense().detach()
    w = w if w.shape == (d, d) else w.T
    x, x_val = (torch.randn(512, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return model, x, x @ w.T, x_val, x_val @ w.T


def fit(model, optimizer, x, y, steps, hook=None):
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if hook is not None:
            hook.observe(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def scheduled(s0: float, st: float, t: int, total: int, warmup: float = 0.1, final: float = 0.2) -> float:
    """The documented schedule, written out: S_0 until warm-up ends, cubic decay, S_T from 1 − final on."""
    p, p_i, p_e = t / total, warmup, 1 - final
    if p <= p_i:
        return s0
    if p >= p_e:
        return st
    return st + (s0 - st) * (1 - (p - p_i) / (p_e - p_i)) ** 3


def largest_cut(tt: TTMatrix) -> int:
    """Most parameters one removed direction can free at the current ranks (cores k and k+1, one gate entry)."""
    ranks, mids = tt.ranks, [math.prod(c.shape[1:-1]) for c in tt.cores]
    return max(ranks[k] * mids[k] + mids[k + 1] * ranks[k + 2] + 1 for k in range(len(mids) - 1))


@pytest.fixture(scope="module")
def teacher_run():
    """The issue's new-user case: keep_fraction=0.25, total_steps=400, AdamW, no other argument. Trained on one
    thread (the module's ``one_thread`` is per test and starts after this module-wide fixture), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y, x_val, y_val = teacher_problem()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.25, total_steps=400))
        cuts = {}  # step -> largest single cut before that step's prune
        for step in range(1, 401):
            cuts[step] = largest_cut(model[0].tt)
            fit(model, optimizer, x, y, 1, hook)
    finally:
        torch.set_num_threads(threads)
    return model, hook, cuts, x_val, y_val


def test_teacher_case_reaches_the_target_and_still_fits_the_teacher(teacher_run):
    model, hook, _, x_val, y_val = teacher_run
    assert hook.step == 400 and hook.target_size == 0.25 * hook.initial_tt_params
    assert abs(hook.live_tt_params() / hook.target_size - 1) <= 0.10
    assert hook.live_tt_params() == sum(p.numel() for p in model[0].tt.parameters())
    with torch.no_grad():
        rel = ((model(x_val) - y_val).norm() / y_val.norm()).item()
    assert rel < 1e-2, rel  # held-out inputs against the dense float64 teacher
    reached = next(e.step for e in hook.history if e.tt_params <= 1.10 * hook.target_size)
    assert reached <= 320  # by the end of the decay (1 - final_fraction of the horizon)


def test_the_sizes_follow_the_formula_at_every_prune(teacher_run):
    _, hook, cuts, _, _ = teacher_run
    s0, st = hook.initial_tt_params, hook.target_size
    prune_steps = sorted({math.ceil((0.1 + 0.07 * k) * 400 - 1e-9) for k in range(1, 11)})
    assert prune_steps[0] == 68 and prune_steps[-1] == 320
    by_step = {e.step: e for e in hook.history}
    assert len(by_step) == 400
    for step, entry in by_step.items():
        assert entry.budget == pytest.approx(scheduled(s0, st, step, 400), rel=1e-12)
        assert entry.stage == ("warmup" if step <= 40 else "decay" if step < 320 else "final")
    size = s0
    for step in range(1, 401):
        entry = by_step[step]
        if step in prune_steps:
            budget = scheduled(s0, st, step, 400)
            assert budget - cuts[step] < entry.tt_params <= budget, step
            assert entry.shrunk == (("0",) if entry.tt_params < size else ()), step
            size = entry.tt_params
        else:
            assert entry.tt_params == size, step  # nothing changes between prunes


def test_tt_rounding_keeps_the_gauge_invariant_singular_values():
    """Singular values per bond from the fully contracted tensor; a random gauge change on a bond must not move
    them, and rounding one bond costs exactly its discarded singular values (2-bond chain, left bond cut)."""
    gen = torch.Generator().manual_seed(3)
    cores = [
        torch.randn(1, 4, 5, generator=gen, dtype=torch.float64),
        torch.randn(5, 6, 3, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 1, generator=gen, dtype=torch.float64),
    ]
    mix = torch.randn(5, 5, generator=gen, dtype=torch.float64) + 3 * torch.eye(5, dtype=torch.float64)
    gauged = [cores[0] @ mix, torch.einsum("ab,bjc->ajc", torch.linalg.inv(mix), cores[1]), cores[2]]

    def full(cs):
        out = cs[0]
        for c in cs[1:]:
            out = torch.tensordot(out, c, dims=1)
        return out.reshape(4, 6, 4)

    torch.testing.assert_close(full(gauged), full(cores), rtol=0, atol=1e-10)
    ref = [torch.linalg.svdvals(full(cores).reshape(4, 24)), torch.linalg.svdvals(full(cores).reshape(24, 4))]
    _, sig = tt_round(gauged)
    for got, want in zip(sig, ref):
        torch.testing.assert_close(got, want[: len(got)], rtol=1e-10, atol=1e-10)
    rounded, _ = tt_round(gauged, [2, 3])  # bond 0: 4 -> 2 (its unfolding has rank 4); bond 1 untouched
    error = (full(rounded) - full(cores)).norm()
    torch.testing.assert_close(error, ref[0][2:].norm(), rtol=1e-8, atol=1e-10)


def _one_gradient_step(model, hook, x, y):
    optimizer = hook.optimizer
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0  # measure importance without moving anything
    fit(model, optimizer, x, y, 3, hook)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def planted_cores(strong: float, weak: float, gen: torch.Generator) -> tuple[list, list, list]:
    """TT cores (ranks 2) of strong·(u¹⊗u¹⊗u¹⊗u¹) + weak·(u²⊗u²⊗u²⊗u²) with u¹ ⊥ u² per mode, so every bond's
    singular values are {strong, weak}; also the cores of each term alone (ranks 1)."""
    both, first, second = [], [], []
    for k in range(4):
        u, _ = torch.linalg.qr(torch.randn(4, 2, generator=gen, dtype=torch.float64))
        scale = (strong, weak) if k == 0 else (1.0, 1.0)
        left, right = (1 if k == 0 else 2), (1 if k == 3 else 2)
        core = torch.zeros(left, 4, right, dtype=torch.float64)
        core[0, :, 0] = scale[0] * u[:, 0]
        core[left - 1, :, right - 1] = scale[1] * u[:, 1]
        both.append(core)
        first.append((scale[0] * u[:, 0]).reshape(1, 4, 1))
        second.append((scale[1] * u[:, 1]).reshape(1, 4, 1))
    return both, first, second


def test_importance_keeps_the_planted_direction_whatever_the_gauge():
    """Every bond carries one strong direction and one weak one, mixed over both stored slices by a random gauge;
    cutting every bond to one direction must keep exactly the strong term, where dropping a stored slice would
    not."""
    from comera_fx.tt.layout import TTFormat, TTLayout

    gen = torch.Generator().manual_seed(5)
    both, strong, weak = planted_cores(3.0, 0.05, gen)
    layout = TTLayout(TTFormat.TT, 16, 16, (4, 4), (4, 4), (1, 2, 2, 2, 1))
    mixed = [c.clone() for c in both]
    for k in range(3):  # a random invertible change of basis on every bond: same matrix, mixed slices
        mix = torch.randn(2, 2, generator=gen, dtype=torch.float64) + 2 * torch.eye(2, dtype=torch.float64)
        mixed[k] = mixed[k] @ mix
        mixed[k + 1] = torch.einsum("ab,bjc->ajc", torch.linalg.inv(mix), mixed[k + 1])
    reference = TTMatrix(layout, both).dense().detach()
    strong_only = TTMatrix(layout.with_ranks((1, 1, 1, 1, 1)), strong).dense().detach()
    model = nn.Sequential(comera_fx.TTLinear(TTMatrix(layout, mixed)))
    torch.testing.assert_close(model[0].tt.dense().detach(), reference, rtol=0, atol=1e-12)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=100))
    gen_x = torch.Generator().manual_seed(6)
    x, y = (torch.randn(64, 16, generator=gen_x, dtype=torch.float64) for _ in range(2))
    _one_gradient_step(model, hook, x, y)
    hook.prune_to(layout.with_ranks((1, 1, 1, 1, 1)).num_params)
    assert model[0].tt.ranks == (1, 1, 1, 1, 1)
    torch.testing.assert_close(model[0].tt.dense().detach(), strong_only, rtol=0, atol=1e-10)
    # what dropping a stored slice of one bond would have cost instead (gates are 1: a slice is a core slice)
    for k in range(3):
        for drop in range(2):
            cs = [c.clone() for c in mixed]
            cs[k], cs[k + 1] = cs[k][..., [1 - drop]], cs[k + 1][[1 - drop]]
            ranks = tuple(1 if i == k + 1 else r for i, r in enumerate(layout.ranks))
            sliced = TTMatrix(layout.with_ranks(ranks), cs).dense().detach()
            assert (sliced - strong_only).norm() > 0.3, (k, drop)


class TwoBranches(nn.Module):
    """y = A(x) + 1e-4 · B(x): B barely matters to the loss; both TT linears of the same shape."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) + 1e-4 * self.b(x)


def test_a_negligible_layer_goes_to_rank_zero_and_the_summary_says_why():
    torch.manual_seed(0)
    model = TwoBranches().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=100))
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(128, 16, generator=gen, dtype=torch.float64),
        torch.randn(128, 16, generator=gen, dtype=torch.float64),
    )
    _one_gradient_step(model, hook, x, y)
    hook.prune_to(0.5 * hook.initial_tt_params)
    assert model.b.tt.is_zero and not model.a.tt.is_zero
    assert set(hook.zeroed) == {"b"} and "rank0_below" in hook.zeroed["b"]
    text = str(hook.summary())
    assert "b: rank 0 (bias only)" in text and "rank0_below" in text

    # with the guard off (rank0_below=0) no layer is removed, whatever its importance: floors of min_rank=1
    torch.manual_seed(0)
    model = TwoBranches().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=100, rank0_below=0.0))
    _one_gradient_step(model, hook, x, y)
    hook.prune_to(0.5 * hook.initial_tt_params)
    assert not model.a.tt.is_zero and not model.b.tt.is_zero and not hook.zeroed
    assert min(model.b.tt.ranks) >= 1 and hook.live_tt_params() <= 0.5 * hook.initial_tt_params


def two_branches_held_wider(keep_fraction: float):
    """TwoBranches in TT form (float64) under a budget schedule with ``shrink_slack=4``, after one gradient step:
    (model, hook, x, y)."""
    torch.manual_seed(0)
    model = TwoBranches().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=keep_fraction, total_steps=100, shrink_slack=4.0))
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(128, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    _one_gradient_step(model, hook, x, y)
    return model, hook, x, y


def test_a_layer_cut_to_rank_zero_in_place_is_zero_until_compacted():
    """shrink_slack: a negligible layer goes to rank 0 without a shape change (its gates and cores all zero, so it
    adds exactly nothing), counts as zero in sizes and the summary, and compact() then empties its cores."""
    model, hook, x, y = two_branches_held_wider(keep_fraction=0.5)
    stored_b = [tuple(c.shape) for c in model.b.tt.cores]
    hook.prune_to(0.5 * hook.initial_tt_params)
    assert model.b.tt.is_zero and not model.b.tt.stored_empty and set(hook.zeroed) == {"b"}
    assert [tuple(c.shape) for c in model.b.tt.cores] == stored_b
    assert all((p == 0).all() for p in model.b.tt.parameters())
    assert "b: rank 0 (bias only)" in str(hook.summary())
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.a(x) + 1e-4 * model.b.bias, rtol=0, atol=0)
    sizes = hook.live_tt_params()
    assert sizes == sum(p.numel() for p in model.a.tt.parameters()) < hook.stored_tt_params()
    hook.compact()
    assert model.b.tt.stored_empty and hook.stored_tt_params() == hook.live_tt_params() == sizes


def test_shrink_eagerly_turns_the_slack_off_for_the_rest_of_the_run():
    """A run that stops compiling: the matrices held wider shrink to their live ranks now, and the next prune
    shrinks physically although the slack would have held it."""
    model, hook, x, y = two_branches_held_wider(keep_fraction=0.3)
    hook.prune_to(0.8 * hook.initial_tt_params)
    assert hook.stored_tt_params() == hook.initial_tt_params > hook.live_tt_params()  # held wider
    live = hook.live_tt_params()
    hook.shrink_eagerly()
    stored = sum(p.numel() for m in (model.a, model.b) for p in m.tt.parameters())  # counted from the tensors
    assert stored == live and all(tuple(m.tt.layout.ranks) == tuple(m.tt.ranks) for m in (model.a, model.b))
    _one_gradient_step(model, hook, x, y)
    hook.prune_to(0.6 * hook.initial_tt_params)
    stored = sum(p.numel() for m in (model.a, model.b) for p in m.tt.parameters())
    assert stored == hook.live_tt_params() <= 0.6 * hook.initial_tt_params
    assert hook.shrink_slack is None and not hook.same_shape_blocks


@pytest.mark.parametrize("slack", [None, 4.0])
def test_a_checkpoint_mid_schedule_resumes_identically(slack):
    """Also with the matrix held wider (shrink_slack): the hook's state carries the live ranks."""
    settings = BudgetConfig(keep_fraction=0.3, total_steps=60, prunes=4, shrink_slack=slack)
    model, x, y, _, _ = teacher_problem(seed=2, d=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = RankAdaptive(model, optimizer, settings)
    fit(model, optimizer, x, y, 25, hook)  # past the first prune (step 18), before the second (step 30)
    assert hook.live_tt_params() < hook.initial_tt_params
    assert (hook.stored_tt_params() > hook.live_tt_params()) == (slack is not None)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()}
    )
    expected = fit(model, optimizer, x, y, 35, hook)
    expected_sizes = [e.tt_params for e in hook.history[25:]]

    fresh, _, _, _, _ = teacher_problem(seed=9, d=16)
    fresh.load_state_dict(checkpoint["model"])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_optimizer.load_state_dict(checkpoint["optimizer"])
    fresh_hook = RankAdaptive(fresh, fresh_optimizer, settings)
    fresh_hook.load_state_dict(checkpoint["hook"])
    resumed = fit(fresh, fresh_optimizer, x, y, 35, fresh_hook)

    assert resumed == pytest.approx(expected, rel=0, abs=1e-12)
    assert [e.tt_params for e in fresh_hook.history] == expected_sizes
    assert fresh[0].tt.ranks == model[0].tt.ranks and fresh[0].tt.layout == model[0].tt.layout
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert (p - q).abs().max().item() <= 1e-12


def test_a_wall_clock_budget_reaches_the_target_by_its_end():
    model, x, y, _, _ = teacher_problem(seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    now = [100.0]
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.3, budget_seconds=20.0), clock=lambda: now[0])
    sizes = []
    for _ in range(30):
        fit(model, optimizer, x, y, 1, hook)
        now[0] += 1.0  # every step takes one second
        sizes.append(hook.live_tt_params())
    assert hook.history[0].stage == "warmup" and hook.elapsed_seconds() == 30.0
    # the clock starts at the first step: after step t, t − 1 seconds have passed. First prune point 3.4 s
    # (step 5), the last at 16 s (step 17), where the size reaches the target and stays.
    assert sizes[:4] == [hook.initial_tt_params] * 4 and sizes[4] < sizes[3]
    assert abs(sizes[16] / hook.target_size - 1) <= 0.10 and sizes[16:] == [sizes[16]] * 14


def test_a_target_is_never_silently_ignored():
    model, _, _, _, _ = teacher_problem(d=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="total_steps= .* or budget_seconds="):
        RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.25))
    with pytest.raises(ValueError, match="needs a size target"):
        RankAdaptive(model, optimizer, BudgetConfig(total_steps=100))
    with pytest.raises(ValueError, match="at most one"):
        RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.25, total_steps=100, budget_seconds=60.0))
    with pytest.raises(TypeError, match="l1_weight"):  # the other schedule's options are not fields of this one
        BudgetConfig(keep_fraction=0.25, total_steps=100, l1_weight=0.1, prune_every=5)
    with pytest.raises(TypeError, match="total_steps"):
        CoMERAConfig(total_steps=100)
    with pytest.raises(ValueError, match="late stage"):  # CoMERA's schedule refuses a target it would not pursue
        RankAdaptive(model, optimizer, CoMERAConfig(keep_fraction=0.25))
    with pytest.raises(ValueError, match="final_fraction must be < 1"):
        RankAdaptive(
            model, optimizer, BudgetConfig(keep_fraction=0.25, total_steps=100, warmup_fraction=0.5, final_fraction=0.5)
        )
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.25, total_steps=100))
    with pytest.raises(ValueError, match="schedule='budget'"):
        RankAdaptive(model, optimizer, CoMERAConfig(prune_every=None)).load_state_dict(hook.state_dict())


def reference_dense(tt: TTMatrix) -> torch.Tensor:
    """M (rows × cols) from the stored cores and gates, contracted in float64 with opt_einsum (padding cut)."""
    import opt_einsum as oe

    operands, n = [], len(tt.cores)
    for k, core in enumerate(tt.cores):
        operands += [core.detach().double(), [k, 100 + k, k + 1]]
        if k < n - 1:
            operands += [tt.gates[k].detach().double(), [k + 1]]
    full = oe.contract(*operands, [0, *(100 + k for k in range(n)), n], optimize="greedy")
    return full.reshape(math.prod(tt.row_modes), math.prod(tt.col_modes))[: tt.rows, : tt.cols]


def reference_mlp(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The two-layer GELU MLP in float64 from reference_dense (M = Wᵀ), not from the planner."""
    first, last = model[0], model[2]
    hidden = nn.functional.gelu(x @ reference_dense(first.tt) + first.bias.detach())
    return hidden @ reference_dense(last.tt) + last.bias.detach()


def live_ranks_from_gates(tt: TTMatrix) -> list[int]:
    """Per bond, the leading nonzero gate entries, after checking that every slice past them is exactly zero in the
    gate and both cores (what a matrix held wider must keep: no optimizer step may move a dead slice)."""
    ranks = []
    for k, gate in enumerate(tt.gates):
        live = int((gate.detach() != 0).sum())
        assert (gate.detach()[live:] == 0).all()
        assert (tt.cores[k].detach()[..., live:] == 0).all() and (tt.cores[k + 1].detach()[live:] == 0).all()
        ranks.append(live)
    return ranks


def compiled_budget_run(backend, slack, steps=30, prunes=5, keep_fraction=0.2, same_shape_blocks=None):
    """A two-layer TT MLP (max rank 16, float64) trained under ``torch.compile(backend=backend)`` with the budget
    schedule, ``shrink_slack=slack`` and ``same_shape_blocks``. After every step that pruned, the compiled output
    (grad on: the training graph) is compared with the float64 reference and the live sizes with the gates.
    Returns (hook, graphs after the first step, graphs at the end, the steps that pruned)."""
    torch.manual_seed(0)
    d = 64
    model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)).double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=16, min_numel=1, min_dim=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(
            keep_fraction=keep_fraction,
            total_steps=steps,
            prunes=prunes,
            shrink_slack=slack,
            same_shape_blocks=same_shape_blocks,
        ),
    )
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(128, d, generator=gen, dtype=torch.float64) for _ in range(2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    first_graphs, pruned_at = None, []
    for step in range(1, steps + 1):
        fit(compiled, optimizer, x, y, 1, hook)
        first_graphs = backend.stats.graphs if first_graphs is None else first_graphs
        if hook.history[-1].shrunk:
            pruned_at.append(step)
            expected = reference_mlp(model, x)
            got = compiled(x).detach()
            assert ((got - expected).norm() / expected.norm()).item() < 1e-10, step
            sizes = []
            for m in hook.matrices:
                ranks = live_ranks_from_gates(m.tt)
                assert list(m.tt.ranks[1:-1]) == ranks
                sizes.append(m.tt.layout.with_ranks((1, *ranks, 1)).num_params)
            assert hook.live_tt_params() == sum(sizes) == hook.history[-1].tt_params
    return hook, first_graphs, backend.stats.graphs, pruned_at


def assert_stored_at_one_width(hook: RankAdaptive) -> None:
    """The MLP's two TT matrices (same modes, so one group for ``same_shape_blocks``) are stored at one width per
    bond, the wider live rank of the two (read from the gates), the narrower one zero past its live ranks."""
    live = [live_ranks_from_gates(m.tt) for m in hook.matrices]
    widest = tuple(max(bond) for bond in zip(*live))
    assert len(set(map(tuple, live))) > 1, "the two matrices should have been pruned to different live ranks"
    assert all(tuple(m.tt.layout.internal_ranks) == widest for m in hook.matrices)
    assert hook.stored_tt_params() == len(hook.matrices) * hook.matrices[0].tt.layout.num_params > hook.live_tt_params()


def test_compiled_rank_adaptation_recompiles_within_the_slack_bound(monkeypatch, gemms_narrow_with_rank):
    """Under comera_fx's backend (AOTAutograd graphs run eagerly: the retraces, not Inductor, are under test) with
    ``shrink_slack=2``: prunes inside the slack change no stored shape and recompile nothing, so the graphs compiled
    after the first step are at most the physical shrinks' bound 1 + ⌊log2(S_0 / S_T)⌋ and fewer than the prunes;
    compiled ≡ the float64 reference after every prune; at the end every matrix is stored at its live ranks.
    benchmarks/bench_recompile.py measures the same with Inductor on a transformer LM."""
    from comera_fx.backend import make_backend
    from comera_fx.tt import ops

    backend = make_backend(inductor=False)
    hook, first, last, pruned_at = compiled_budget_run(backend, 2.0)
    shrink_bound = 1 + math.floor(math.log2(hook.initial_tt_params / hook.live_tt_params()))
    assert len(pruned_at) >= 4 and first == 1
    assert last - first <= shrink_bound and last - first < len(pruned_at), (last, pruned_at)
    assert hook.live_tt_params() <= 0.2 * hook.initial_tt_params + 1
    assert_stored_at_one_width(hook)  # compacted at the last prune point, to one shape for both (compiled)

    def fallback(*args, **kwargs):
        raise AssertionError("the compiled graph ran the fixed fallback order")

    monkeypatch.setattr(ops, "matmul", fallback)  # the new layouts were planned before the retrace
    monkeypatch.setattr(ops, "matmul_t", fallback)
    x = torch.randn(8, 64, dtype=torch.float64)
    with torch.no_grad():
        got = torch.compile(hook.module, backend=backend)(x)
    torch._dynamo.reset()
    model = hook.module
    torch.testing.assert_close(got, reference_mlp(model, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("same_shape_blocks", [None, False])
def test_by_default_a_compiled_run_recompiles_at_most_once(gemms_narrow_with_rank, same_shape_blocks):
    """No flags: the backend saw the cores, so the hook rounds in place at every prune point but the last, which
    shrinks every matrix physically: at most one graph after the first step, compiled ≡ the float64 reference after
    every prune (``compiled_budget_run``). The cores end stored at one width per matrix role (the role's widest live
    rank: Inductor compiles the kernels of equal shapes once), or at their own live ranks with
    ``same_shape_blocks=False``."""
    from comera_fx.backend import make_backend

    backend = make_backend(inductor=False)
    hook, first, last, pruned_at = compiled_budget_run(backend, None, same_shape_blocks=same_shape_blocks)
    torch._dynamo.reset()
    assert hook.compiled_as == "whole" and len(pruned_at) >= 4 and first == 1
    assert last - first == 1, (first, last, pruned_at)
    assert hook.live_tt_params() <= 0.2 * hook.initial_tt_params + 1
    if same_shape_blocks is None:
        assert_stored_at_one_width(hook)
    else:
        assert hook.stored_tt_params() == hook.live_tt_params()
        assert all(m.tt.live_internal_ranks is None for m in hook.matrices)


def test_a_compiled_cpu_run_keeps_its_shapes_when_compacting_narrows_no_gemm():
    """On the CPU a planned product runs its two-factor bond padded to at least 16, so cores stored at max rank 16
    multiply the same GEMMs at any live rank: by default a compiled run then holds the stored widths at the last
    prune point too (no recompile at all), compiled ≡ the float64 reference after every prune
    (``compiled_budget_run``), and ``compact()`` still compacts on request. Cores stored wider than 16 would narrow
    the GEMMs: there the last prune point compacts (the test above, as on a device without the floor)."""
    from comera_fx.backend import make_backend

    backend = make_backend(inductor=False)
    hook, first, last, pruned_at = compiled_budget_run(backend, None)
    torch._dynamo.reset()
    assert hook.compiled_as == "whole" and hook.compaction_keeps_gemm_widths()
    assert len(pruned_at) >= 4 and first == 1 and last == first, (first, last, pruned_at)
    assert hook.live_tt_params() <= 0.2 * hook.initial_tt_params + 1
    assert hook.stored_tt_params() == hook.initial_tt_params  # held at the stored widths throughout
    hook.compact()
    assert_stored_at_one_width(hook)

    wide = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).double()
    comera_fx.tensorize_(wide, comera_fx.TensorizeConfig(max_rank=24, min_numel=1, min_dim=1))
    schedule = BudgetConfig(keep_fraction=0.5, total_steps=10)
    wide_hook = RankAdaptive(wide, torch.optim.AdamW(wide.parameters()), schedule)
    assert max(max(m.tt.layout.internal_ranks) for m in wide_hook.matrices) > 16
    assert not wide_hook.compaction_keeps_gemm_widths()
    wide_hook.remove()
    hook.remove()


def test_an_eager_run_shrinks_at_every_prune():
    """The same run never compiled: every prune point shrinks the cores physically (smaller steps at once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=16, min_numel=1, min_dim=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.2, total_steps=30, prunes=5))
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(128, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    stored = []
    for _ in range(30):
        fit(model, optimizer, x, y, 1, hook)
        if hook.history[-1].shrunk:
            stored.append(hook.stored_tt_params())
            assert hook.stored_tt_params() == hook.live_tt_params()
    assert hook.compiled_as is None and len(stored) >= 4 and stored == sorted(stored, reverse=True)


def test_a_slack_that_shrinks_a_compiled_model_again_warns_naming_the_setting():
    """``shrink_slack=1.0`` (physically at every prune) overrides the default; compiled, the second physical
    shrink (a second recompile) warns, naming the setting to drop."""
    from comera_fx.backend import make_backend

    backend = make_backend(inductor=False)
    with pytest.warns(UserWarning, match=r"runs compiled \(whole\) and shrink_slack=1.0 .*leave BudgetConfig"):
        _, first, last, pruned_at = compiled_budget_run(backend, 1.0, steps=20, prunes=3)
    torch._dynamo.reset()
    assert len(pruned_at) >= 2 and last - first == len(pruned_at)


def test_dynamic_parameter_shapes_compile_and_stay_exact_across_prunes():
    """A user who traces parameters with dynamic shapes (``force_parameter_static_shapes = False``) gets symbolic core
    sizes after a rank change. That crashed inside Dynamo at the planner's layout check; the TT products now
    specialize the ranks (a recompile per shrink, as with static shapes) and stay exact against the float64
    reference after every prune (``compiled_budget_run`` checks it)."""
    from comera_fx.backend import make_backend

    backend = make_backend(inductor=False)
    with torch._dynamo.config.patch(force_parameter_static_shapes=False), pytest.warns(UserWarning, match="slack"):
        _, first, last, pruned_at = compiled_budget_run(backend, 1.0, steps=20, prunes=3)
    torch._dynamo.reset()
    assert len(pruned_at) >= 2 and first == 1 and last - first == len(pruned_at)


@pytest.mark.slow
def test_compiled_rank_adaptation_with_inductor_stays_within_the_bound():
    """The same run through Inductor (C++ codegen): the bound on recompiles and compiled ≡ reference hold."""
    from comera_fx.backend import make_backend

    backend = make_backend()
    hook, first, last, pruned_at = compiled_budget_run(backend, 2.0)
    torch._dynamo.reset()
    shrink_bound = 1 + math.floor(math.log2(hook.initial_tt_params / hook.live_tt_params()))
    assert last - first <= shrink_bound and last - first < len(pruned_at)


# ------------------------------------------------------------------------------ BudgetConfig and CoMERAConfig


def test_a_float_size_target_is_a_fraction_of_the_dense_size():
    """The same meaning as TensorizeConfig.size_target and distill_(size_target=): of the dense weights."""
    model, _, _, _, _ = teacher_problem(d=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = RankAdaptive(model, optimizer, BudgetConfig(size_target=0.25, total_steps=10))
    assert hook.target_size == pytest.approx(0.25 * 16 * 16, rel=1e-12)  # one 16 x 16 weight


def test_config_refusals_name_the_fix():
    model, _, _, _, _ = teacher_problem(d=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = BudgetConfig(size_target=0.25, total_steps=10)
    fix = r"takes a BudgetConfig or a CoMERAConfig, not .*BudgetConfig\(keep_fraction=0.5, total_steps=\.\.\.\)"
    fix += r"( .*CoMERAConfig\(\))?"
    for bad in (None, 0.5, {"keep_fraction": 0.5}):  # a dict: BudgetConfig(keep_fraction=0.5, total_steps=...)
        with pytest.raises(TypeError, match=fix):
            RankAdaptive(model, optimizer, bad)
    with pytest.raises(TypeError, match=r"pass CoMERAConfig\(l1_weight=0.1\)"):  # a dict: the config it meant
        RankAdaptive(model, optimizer, {"schedule": "comera", "l1_weight": 0.1})
    with pytest.raises(TypeError, match="target_ratio"):  # the spellings before the configs are gone
        RankAdaptive(model, optimizer, config, target_ratio=0.5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        BudgetConfig(total_step=20)
    with pytest.raises(ValueError, match="clock"):
        RankAdaptive(model, optimizer, CoMERAConfig(), clock=lambda: 0.0)
    with pytest.raises(ValueError, match="history_every"):
        RankAdaptive(model, optimizer, config, history_every=0)
    for bad in (1.5, -1, True, "0.5"):
        with pytest.raises(ValueError, match="size_target"):
            BudgetConfig(size_target=bad, total_steps=10)
    with pytest.raises(ValueError, match="at most one"):
        BudgetConfig(size_target=0.25, keep_fraction=0.5, total_steps=10)
    with pytest.raises(ValueError, match="needs a size target"):
        BudgetConfig(total_steps=10)
    with pytest.raises(ValueError, match="warmup_fraction"):
        BudgetConfig(keep_fraction=0.5, total_steps=10, warmup_fraction=None)


def test_configs_round_trip_through_json_and_old_rank_config_dicts_load():
    config = BudgetConfig(size_target=1000, budget_seconds=60.0, prunes=4)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["schedule"] == "budget" and config_from_dict(data) == config
    assert (config.prunes, config.warmup_fraction) == (4, 0.1)  # the defaults sit on the fields
    comera = CoMERAConfig(prune_every=None)  # None: never prune
    assert config_from_dict(comera.to_dict()) == comera and CoMERAConfig().prune_every == 100
    # RankConfig.to_dict wrote every field of both schedules, None where not given ("the schedule's default")
    budget_fields = ("total_steps", "budget_seconds", "warmup_fraction", "final_fraction", "prunes")
    comera_fields = ("l1_weight", "target_loss", "late_start_step", "plateau_patience", "plateau_tol", "reduction")
    old = {"schedule": "budget", "size_target": None, "keep_fraction": 0.3, "threshold": 0.01}
    old.update(dict.fromkeys(budget_fields + comera_fields + ("shrink_slack", "same_shape_blocks"), None))
    old.update(total_steps=24, prunes=3)  # prune_every left out: "not given"
    assert config_from_dict(old) == BudgetConfig(keep_fraction=0.3, total_steps=24, prunes=3)
    old_comera = {**dict.fromkeys(budget_fields + comera_fields, None), "schedule": "comera", "l1_weight": 0.05}
    assert config_from_dict(old_comera) == CoMERAConfig(l1_weight=0.05)
    assert config_from_dict({**old_comera, "prune_every": None}).prune_every is None
    with pytest.raises(ValueError, match="unknown BudgetConfig fields"):
        config_from_dict({**old, "l1_weight": 0.1})


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def reference_stack(model: Stack, x: torch.Tensor) -> torch.Tensor:
    """The stack from each TT matrix's dense form (independent of the products under test)."""
    with torch.no_grad():
        for block in model.blocks:
            hidden = torch.tanh(x @ block.up.tt.dense() + block.up.bias)
            x = x + hidden @ block.down.tt.dense() + block.down.bias
    return x


def regional_prune(same_shape_blocks: bool, slack: float | None = None):
    """A 3-block TT stack compiled per block (a counting backend), one step, one physical prune, one no-grad
    forward, two more training steps; returns (model, hook, graphs compiled before the prune, graphs after that
    forward, its output, the dense reference's)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = Stack().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(keep_fraction=0.4, total_steps=100, shrink_slack=slack, same_shape_blocks=same_shape_blocks),
    )
    torch._dynamo.reset()
    counter = CompileCounter()
    comera_fx.compile_regions(model, backend=counter)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(64, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    _one_gradient_step(model, hook, x, y)
    before = counter.frame_count
    hook.prune_to(0.4 * hook.initial_tt_params)
    # compiled (compile_regions marked the blocks): in place, with or without a slack
    assert counter.frame_count == before and hook.stored_tt_params() == hook.initial_tt_params
    hook.compact()  # the stored widths are cut, not padded
    with torch.no_grad():
        out = model(x)
    after, expected = counter.frame_count, reference_stack(model, x)
    fit(model, optimizer, x, y, 2, hook)  # the optimizer's state follows the resized cores
    torch._dynamo.reset()
    return model, hook, before, after, out, expected


@pytest.mark.parametrize("slack", [None, 4.0])
def test_same_shape_blocks_give_repeated_blocks_one_shape_and_one_graph_after_a_shrink(slack):
    """Regional compilation reuses one graph for blocks of equal shapes; after a physical prune the blocks' live
    ranks differ. With ``same_shape_blocks`` each matrix role is stored at its widest live rank (zero slices past
    the others'), so one new graph serves every block, and the output still equals the dense reference."""
    model, hook, before, after, out, expected = regional_prune(True, slack)
    ups = [block.up.tt for block in model.blocks]
    assert len({tt.ranks for tt in ups}) > 1, "the blocks should have been pruned to different live ranks"
    assert len({tt.layout for tt in ups}) == 1 and len({b.down.tt.layout for b in model.blocks}) == 1
    assert after == before + 1  # the no-grad forward after the prune: one graph for the three blocks
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert hook.live_tt_params() <= 0.4 * hook.initial_tt_params + 1 < hook.stored_tt_params()

    # same_shape_blocks=False: one graph per block after the shrink
    model, _, before, after, out, expected = regional_prune(False, slack)
    assert after == before + len(model.blocks)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_the_last_prune_point_compacts_only_when_that_frees_enough(monkeypatch, floor):
    """Under ``shrink_slack`` the schedule's last prune point compacts the stored cores (a recompile) only if that
    frees at least ``MIN_FINAL_COMPACTION`` of the stored size: with ``same_shape_blocks`` one block that keeps its
    ranks holds its whole group wide, and a recompile for a few percent does not pay. Below the floor the cores stay
    as stored (no shape changes) until ``compact()``, which frees what the hook predicted."""
    from comera_fx.runtime import rank_adaptive

    monkeypatch.setattr(rank_adaptive, "MIN_FINAL_COMPACTION", floor)
    torch.manual_seed(0)
    model = Stack().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(keep_fraction=0.4, total_steps=20, prunes=2, shrink_slack=4.0, same_shape_blocks=True),
    )
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(64, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    fit(model, optimizer, x, y, 20, hook)
    assert sum(1 for e in hook.history if e.shrunk) == 2  # both prune points, the last one included
    assert hook.live_tt_params() <= 0.4 * hook.initial_tt_params + 1
    torch.testing.assert_close(model(x), reference_stack(model, x), rtol=1e-10, atol=1e-12)
    if floor == 1.0:
        assert hook.stored_tt_params() == hook.initial_tt_params  # held at the stored widths: no shape changed
        predicted = hook._compaction_frees()
        assert predicted > 0
        hook.compact()
        assert hook.stored_tt_params() == hook.initial_tt_params - predicted
    else:
        assert hook.stored_tt_params() < hook.initial_tt_params  # compacted at the last prune point
        assert hook._compaction_frees() == 0
    for role in ("up", "down"):  # either way each role keeps one stored shape across the blocks
        assert len({getattr(block, role).tt.layout for block in model.blocks}) == 1
    torch.testing.assert_close(model(x), reference_stack(model, x), rtol=1e-10, atol=1e-12)


def test_by_default_regional_blocks_recompile_at_most_one_graph(gemms_narrow_with_rank):
    """No flags, blocks compiled regionally: the hook finds the regions, holds the shapes until the last prune point
    and then gives every role one shape across the blocks: at most one graph compiled after the first step, for the
    three blocks together, and the output equals the dense reference."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = Stack().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.3, total_steps=20, prunes=4))
    torch._dynamo.reset()
    counter = CompileCounter()  # not comera_fx's backend: compile_regions itself tells the hook
    comera_fx.compile_regions(model, backend=counter)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(64, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    x.requires_grad_(True)  # every block then takes an input with grad (as after an embedding): one graph for all
    fit(model, optimizer, x, y, 1, hook)
    first = counter.frame_count
    fit(model, optimizer, x, y, 19, hook)
    out = model(x).detach()
    last = counter.frame_count
    torch._dynamo.reset()
    assert hook.compiled_as == "regional" and first == 1 and last - first == 1
    assert sum(1 for e in hook.history if e.shrunk) >= 3
    assert hook.live_tt_params() <= 0.3 * hook.initial_tt_params + 1
    assert hook.stored_tt_params() < hook.initial_tt_params  # the last prune point shrank physically
    assert len({b.up.tt.ranks for b in model.blocks}) > 1  # the blocks' live ranks differ, their shapes not
    for role in ("up", "down"):
        assert len({getattr(block, role).tt.layout for block in model.blocks}) == 1
    torch.testing.assert_close(out, reference_stack(model, x), rtol=1e-10, atol=1e-12)


def test_the_hook_reads_nothing_back_from_the_device_between_prune_points(monkeypatch):
    """CPU proxy for a GPU step without host synchronisation: during ``optimizer.step()`` of the budget schedule,
    no tensor is read to the host (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor) except at prune
    points; the history's live counts of the other steps are read when the history is asked for, and equal the
    gates' own counts at each step."""
    model, x, y, _, _ = teacher_problem(d=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=20, prunes=2))
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    expected_live, read_steps = [], []
    for step in range(1, 21):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        before = len(reads)
        optimizer.step()
        if len(reads) > before:
            read_steps.append(step)
        with torch.no_grad():
            expected_live.append(tuple(int((g.abs() > hook.settings.threshold).sum()) for g in model[0].tt.gates))
    pruned = [e.step for e in hook.history if e.shrunk]
    monkeypatch.undo()
    assert len(pruned) == 2 and read_steps == pruned, (read_steps, pruned)
    assert [e.step for e in hook.history] == list(range(1, 21))
    assert [e.gate_ranks["0"][1:-1] for e in hook.history] == expected_live


def test_a_block_whose_layer_went_to_rank_zero_keeps_the_shape_of_the_others():
    """Same-shape blocks: one block's ``down`` cut to rank 0 in place, another's to a lower rank. The compaction
    stores all three at the widest live ranks (the zero one all zero, still counted as zero), so the blocks keep
    one shape (one compiled graph); the stack still equals its dense reference, the zero layer adding its bias."""
    from comera_fx.runtime.shrink import round_to_ranks_

    torch.manual_seed(0)
    model = Stack().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.4, total_steps=100, same_shape_blocks=True))
    downs = [block.down.tt for block in model.blocks]
    bonds = len(downs[0].gates)
    round_to_ranks_(downs[0], [0] * bonds, in_place=True)
    round_to_ranks_(downs[1], [2] * bonds, in_place=True)
    widest = tuple(max(2, r) for r in downs[2].layout.internal_ranks)
    hook.compact()
    assert downs[0].is_zero and not downs[0].stored_empty and all((p == 0).all() for p in downs[0].parameters())
    assert len({tt.layout for tt in downs}) == 1 and downs[0].layout.internal_ranks == widest
    assert downs[1].ranks[1:-1] == (2,) * bonds
    x = torch.randn(16, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_stack(model, x), rtol=1e-10, atol=1e-12)
