"""RankAdaptive: gate penalty, CoMERA's two stages, physical shrinking with the optimizer state, checkpoints.

Exactness checks run in float64 and compare against references built independently in the test (cores sliced by
hand with plain indexing, optimizer state sliced by hand by key name, parameter counts from the shapes).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx.runtime import CoMERAConfig, RankAdaptive, param_groups
from comera_fx.runtime.comera import EARLY, LATE, achievement_lambda
from comera_fx.tt.inventory import tt_matrices
from comera_fx.testing import assert_rewrite_equivalent, strategies
from comera_fx.tt import TTMatrix

CONFIG = comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1)


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------------- models


class Toy(nn.Module):
    """TTM embedding tied to the output head, two TT linears: every kind of TT matrix, one of them shared."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(24, 12)
        self.fc = nn.Linear(12, 16)
        self.out = nn.Linear(16, 12)
        self.head = nn.Linear(12, 24, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.out(torch.tanh(self.fc(self.emb(idx)))))


def make_toy(seed: int = 0, randomize_gates: bool = True) -> Toy:
    torch.manual_seed(seed)
    model = Toy().double()
    comera_fx.tensorize_(model, CONFIG)
    if randomize_gates:  # gates != 1 so that folding them into the cores is really exercised
        gen = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for entry in tt_matrices(model):
                for gate in entry.tt.gates:
                    gate.copy_(0.5 + torch.rand(gate.shape, generator=gen, dtype=gate.dtype))
    return model


def toy_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 24, (32,), generator=gen)
    target = torch.randn(32, 24, generator=gen, dtype=torch.float64)
    return idx, target


def toy_loss(model, batch):
    idx, target = batch
    return ((model(idx) - target) ** 2).mean()


def regression_problem(y_scale: float = 5.0):
    """A two-layer student with TT layers of rank 8 learns a teacher of rank 2: most rank slices are redundant."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    comera_fx.tensorize_(model, CONFIG)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 2, generator=gen) @ torch.randn(2, 16, generator=gen) / 4
    b = torch.randn(16, 8, generator=gen) / 4
    x = torch.randn(256, 16, generator=gen)
    return model, x, y_scale * torch.tanh(x @ a) @ b


def train(model, optimizer, hook, x, y, steps):
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        hook.observe(loss)
        optimizer.step()


def live_entries(model, threshold=1e-2) -> int:
    return sum(int((g.detach().abs() > threshold).sum()) for e in tt_matrices(model) for g in e.tt.gates)


def kill(gate: torch.Tensor, entries) -> None:
    with torch.no_grad():
        gate[list(entries)] = 0.0


def keep_lists(tt: TTMatrix) -> list[list[int]]:
    """Indices of the gate entries that are not exactly zero, per bond."""
    return [[i for i, v in enumerate(g.detach().tolist()) if v != 0.0] for g in tt.gates]


def slice_core(t: torch.Tensor, first: list[int] | None, last: list[int] | None) -> torch.Tensor:
    if first is not None:
        t = t[first]
    if last is not None:
        t = t[..., last]
    return t.clone()


def hand_shrunk(tt: TTMatrix) -> TTMatrix:
    """A TTMatrix BUILT with the small ranks: every core and gate sliced with plain indexing."""
    keep = keep_lists(tt)
    n = len(tt.cores)
    cores = [
        slice_core(c.detach(), keep[k - 1] if k > 0 else None, keep[k] if k < n - 1 else None)
        for k, c in enumerate(tt.cores)
    ]
    gates = [g.detach()[kp].clone() for g, kp in zip(tt.gates, keep)]
    ranks = (1, *(len(kp) for kp in keep), 1)
    return TTMatrix(tt.layout.with_ranks(ranks), cores, gates)


# ------------------------------------------------------------------------------------------------ param groups


def test_param_groups_hold_every_parameter_once_with_the_right_lrs():
    model = make_toy()
    groups = param_groups(model, lr_cores=1e-4, lr_gates=1e-3, lr_other=5e-5, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"tt_cores", "tt_gates", "other"}
    assert (by_name["tt_cores"]["lr"], by_name["tt_gates"]["lr"], by_name["other"]["lr"]) == (1e-4, 1e-3, 5e-5)
    assert by_name["tt_gates"]["weight_decay"] == 0.0 and by_name["tt_cores"]["weight_decay"] == 0.1

    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed))  # nothing twice, although emb and head share one TTMatrix
    assert set(listed) == {id(p) for p in model.parameters()}
    matrices = [e.tt for e in tt_matrices(model)]
    assert len(matrices) == 3  # emb/head tied: one matrix
    assert {id(p) for p in by_name["tt_cores"]["params"]} == {id(c) for tt in matrices for c in tt.cores}
    assert {id(p) for p in by_name["tt_gates"]["params"]} == {id(g) for tt in matrices for g in tt.gates}
    assert {id(p) for p in by_name["other"]["params"]} == {id(model.fc.bias), id(model.out.bias)}
    torch.optim.AdamW(groups)  # torch itself refuses duplicates


# ------------------------------------------------------------------------------------------------ gradient terms


def _zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def test_early_stage_adds_l1_weight_times_mean_gradient():
    model = make_toy()
    kill(model.fc.tt.gates[1], [0, 3])  # dead entries get no pull and do not count in the mean
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    RankAdaptive(model, optimizer, CoMERAConfig(l1_weight=0.05, prune_every=None))
    gates = [g for e in tt_matrices(model) for g in e.tt.gates]
    before = [g.detach().clone() for g in gates]
    n_live = sum(int((g.abs() > 1e-2).sum()) for g in before)
    _zero_grads(model)
    optimizer.step()
    for g, b in zip(gates, before):
        expected = b - 0.05 * torch.sign(b) * (b.abs() > 1e-2) / n_live
        torch.testing.assert_close(g.detach(), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("late_size_weight", [None, 0.01], ids=["default", "comera-0.01"])
@pytest.mark.parametrize("target_params, lam", [(10, 1.0), (10**6, 0.0)])
def test_late_stage_rescales_task_gradients_and_pushes_the_gates(target_params, lam, late_size_weight):
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    extra = {} if late_size_weight is None else {"late_size_weight": late_size_weight}
    config = CoMERAConfig(size_target=target_params, late_start_step=0, prune_every=None, reduction="sum", **extra)
    hook = RankAdaptive(model, optimizer, config)
    params = list(model.parameters())
    gate_ids = {id(g) for e in tt_matrices(model) for g in e.tt.gates}
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)  # a stand-in task gradient
    optimizer.step()
    assert hook.stage == LATE and hook.history[-1].lam == lam
    # default late_size_weight is 0: once the size is on target (λ = 0) the gates get the task gradient only
    task_weight, size_weight = (1 - lam) + 0.1, lam + (late_size_weight or 0.0)
    for p, b in zip(params, before):
        expected = b - task_weight
        if id(p) in gate_ids:
            expected = expected - size_weight * torch.sign(b) * (b.abs() > 1e-2)  # "sum": no division
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-14)


def test_achievement_lambda_pushes_the_relatively_farther_objective():
    assert achievement_lambda(loss=1.0, target_loss=0.9, size=100, target_size=50) == 1.0  # 10% vs 50%
    assert achievement_lambda(loss=2.0, target_loss=0.5, size=100, target_size=50) == 0.0  # 75% vs 50%
    assert achievement_lambda(loss=None, target_loss=None, size=40, target_size=50) == 0.0  # size reached
    assert achievement_lambda(loss=0.3, target_loss=None, size=60, target_size=50) == 1.0
    assert achievement_lambda(loss=1.0, target_loss=0.5, size=0, target_size=50) == 0.0


# ------------------------------------------------------------------------------------------------ training runs


def test_l1_pressure_shrinks_the_gates():
    counts = {}
    for l1 in (0.0, 0.05):
        model, x, y = regression_problem(y_scale=1.0)
        optimizer = torch.optim.Adam(param_groups(model, lr_cores=1e-2, lr_gates=2e-2, lr_other=1e-2))
        hook = RankAdaptive(model, optimizer, CoMERAConfig(l1_weight=l1, prune_every=50))
        start = live_entries(model)
        train(model, optimizer, hook, x, y, 300)
        counts[l1] = (start, live_entries(model), hook.live_tt_params(), hook.initial_tt_params)
    start, end, params, initial = counts[0.05]
    assert end < 0.75 * start and params < 0.75 * initial
    assert counts[0.0][1] > end  # the penalty, not the task, removed them


def test_late_stage_reaches_the_target_size():
    model, x, y = regression_problem()
    optimizer = torch.optim.Adam(param_groups(model, lr_cores=1e-2, lr_gates=5e-3, lr_other=1e-2))
    hook = RankAdaptive(
        model, optimizer, CoMERAConfig(l1_weight=0.01, prune_every=25, keep_fraction=0.5, late_start_step=100)
    )
    train(model, optimizer, hook, x, y, 400)
    assert hook.target_size == 0.5 * hook.initial_tt_params
    assert abs(hook.live_tt_params() / hook.target_size - 1) <= 0.15
    assert hook.live_tt_params() == sum(p.numel() for e in tt_matrices(model) for p in e.tt.parameters())
    stages = [e.stage for e in hook.history]
    assert stages[:100] == [EARLY] * 100 and set(stages[100:]) == {LATE} and hook.switch_step == 100
    assert {e.lam for e in hook.history[100:]} == {0.0, 1.0}  # pushed the size, then the loss again
    sizes = [e.tt_params for e in hook.history]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))


def test_plateau_switches_to_the_late_stage():
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = RankAdaptive(
        model, optimizer, CoMERAConfig(keep_fraction=0.5, plateau_patience=3, plateau_tol=0.01, prune_every=None)
    )
    for loss in (5.0, 4.0, 3.0, 2.999, 2.998, 2.997, 2.996):
        _zero_grads(model)
        hook.observe(torch.tensor(loss))
        optimizer.step()
    # best 3.0 at step 2; steps 3, 4, 5 improve by < 1%: late from step 5 on
    assert [e.stage for e in hook.history] == [EARLY] * 5 + [LATE] * 2 and hook.switch_step == 5
    assert [e.loss for e in hook.history][:2] == [5.0, 4.0]


def test_without_a_target_the_early_stage_never_ends():
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(prune_every=None))
    for _ in range(5):
        _zero_grads(model)
        hook.observe(1.0)
        optimizer.step()
    assert hook.stage == EARLY and hook.target_size is None


# ------------------------------------------------------------------------------------------------------ shrinking


def _expected_removed(model, dead: dict[str, dict[int, int]]) -> int:
    """Parameters removed when bond k of matrix ``name`` loses ``dead[name][k]`` slices, from the shapes alone."""
    removed = 0
    for entry in tt_matrices(model):
        lost = dead.get(entry.name, {})
        ranks = [1] + [c.shape[-1] for c in entry.tt.cores]
        for k, core in enumerate(entry.tt.cores):
            mid = math.prod(core.shape[1:-1])
            new = (ranks[k] - lost.get(k - 1, 0)) * mid * (ranks[k + 1] - lost.get(k, 0))
            removed += core.numel() - new
        removed += sum(lost.values())  # the gate entries themselves
    return removed


def test_shrinking_preserves_the_function_and_removes_the_expected_parameters():
    model = make_toy()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(prune_every=None))
    kill(model.emb.tt.gates[0], [1, 3, 5])
    kill(model.fc.tt.gates[0], [2])
    kill(model.fc.tt.gates[1], [0, 4, 7])
    kill(model.out.tt.gates[2], [1])
    dead = {"emb": {0: 3}, "fc": {0: 1, 1: 3}, "out": {2: 1}}
    idx, _ = toy_batch()
    with torch.no_grad():
        before = model(idx)
    n_before = sum(p.numel() for p in model.parameters())
    expected_removed = _expected_removed(model, dead)
    old_ranks = {e.name: e.tt.ranks for e in tt_matrices(model)}

    records = hook.prune()

    assert sorted(r.name for r in records) == ["emb", "fc", "out"]  # the tied matrix once
    with torch.no_grad():
        after = model(idx)
    assert (after - before).abs().max().item() <= 1e-12
    assert sum(p.numel() for p in model.parameters()) == n_before - expected_removed
    assert model.fc.tt.ranks == (1, old_ranks["fc"][1] - 1, old_ranks["fc"][2] - 3, *old_ranks["fc"][3:])
    assert model.head.tt is model.emb.tt and model.emb.tt.ranks == (1, 5, 1)
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in in_optimizer] == [id(p) for p in model.parameters()]  # same positions, new objects
    assert hook.prune() == []  # nothing dead any more


THRESHOLD = 1e-2
# A gate entry is kept (a random value in [0.5, 1.5]) or dead: exactly 0, below the threshold, or at it.
GATE_FATES = st.sampled_from(["live", "zero", "below", "at"])


@given(case=strategies.models(num_inputs=2), max_rank=st.integers(1, 5), data=st.data())
def test_pruning_dead_slices_of_random_models_keeps_the_function_and_the_optimizer_state_aligned(case, max_rank, data):
    """Random models tensorized at random ranks, random gate entries dead (exactly 0, below or at the threshold).

    Reference: the same model with every dead gate set to exactly 0 (built by the test with plain indexing),
    whose function pruning must keep (outputs and gradients, two batches). The rewrite puts the small dead values
    back and prunes through an Adam optimizer whose moments are tagged exp_avg = p, exp_avg_sq = p²: after
    pruning every surviving parameter must still carry its own tags, which holds only if each state tensor was
    sliced exactly like its parameter."""
    model, example_inputs = case
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=max_rank, min_numel=1, min_dim=1))
    matrices = tt_matrices(model)
    assume(matrices)
    small: dict[tuple[str, int, int], float] = {}  # (matrix, bond, entry) -> the dead value the rewrite restores
    live: dict[str, list[int]] = {}
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="gate seed"))
    with torch.no_grad():
        for entry in matrices:
            counts = []
            for k, gate in enumerate(entry.tt.gates):
                fates = data.draw(
                    st.lists(GATE_FATES, min_size=gate.numel(), max_size=gate.numel()), label=f"{entry.name} gate {k}"
                )
                values = 0.5 + torch.rand(gate.shape, generator=generator, dtype=gate.dtype)
                for i, fate in enumerate(fates):
                    if fate != "live":
                        small[(entry.name, k, i)] = {"zero": 0.0, "below": -0.5 * THRESHOLD, "at": THRESHOLD}[fate]
                        values[i] = 0.0
                gate.copy_(values)
                counts.append(fates.count("live"))
            live[entry.name] = counts
    optimizers = []

    def prune(m: nn.Module) -> None:
        with torch.no_grad():
            for e in tt_matrices(m):
                for (name, k, i), value in small.items():
                    if name == e.name:
                        e.tt.gates[k][i] = value
        optimizer = torch.optim.Adam(m.parameters(), lr=0.0)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # Adam's own state layout (step, exp_avg, exp_avg_sq); lr 0 leaves p as it was
        with torch.no_grad():
            for p in m.parameters():
                optimizer.state[p]["exp_avg"].copy_(p)
                optimizer.state[p]["exp_avg_sq"].copy_(p * p)
        hook = RankAdaptive(m, optimizer, CoMERAConfig(prune_every=None, threshold=THRESHOLD))  # dead-slice pruning
        hook.prune()
        hook.remove()
        optimizers.append(optimizer)

    pruned = assert_rewrite_equivalent(model, prune, example_inputs, graph=False, extra_inputs=case.more_inputs)
    optimizer = optimizers[0]
    params = list(pruned.parameters())
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in params]
    for p in params:
        state = optimizer.state[p]
        assert torch.equal(state["exp_avg"], p.detach()) and torch.equal(state["exp_avg_sq"], p.detach() ** 2)
        assert float(state["step"]) == 1.0
    for e in tt_matrices(pruned):
        counts = live[e.name]
        expected = (1, *counts, 1) if 0 not in counts else (1, *[0] * len(counts), 1)
        assert e.tt.ranks == expected, (e.name, e.tt.ranks, counts)
    for p in params:  # and the optimizer steps on the shrunk parameters
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_a_bond_at_rank_zero_leaves_only_the_bias():
    model = make_toy()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(prune_every=1))
    kill(model.out.tt.gates[1], range(model.out.tt.gates[1].numel()))
    idx, target = toy_batch()
    with torch.no_grad():
        before = model(idx)
    _zero_grads(model)
    for group in optimizer.param_groups:  # this step must change nothing but the ranks
        group["lr"] = 0.0
    optimizer.step()  # prunes (prune_every=1)

    assert model.out.tt.is_zero and sum(p.numel() for p in model.out.tt.parameters()) == 0
    assert hook.history[-1].zeroed == ("out",) and hook.history[-1].ranks["out"] == (1, 0, 0, 0, 1)
    with torch.no_grad():
        after = model(idx)
        torch.testing.assert_close(
            model.out(torch.randn(3, 16, dtype=torch.float64)), model.out.bias.expand(3, -1), rtol=0, atol=0
        )
    assert (after - before).abs().max().item() <= 1e-12
    assert "zero matrix" in repr(model.out.tt)

    for group in optimizer.param_groups:  # still trains: gradients flow around the zero layer
        group["lr"] = 1e-3
    optimizer.zero_grad()
    toy_loss(model, (idx, target)).backward()
    assert model.out.bias.grad is not None and model.fc.bias.grad.abs().sum() == 0  # nothing reaches fc
    optimizer.step()

    fresh = make_toy(seed=3)
    fresh.load_state_dict(model.state_dict())
    assert fresh.out.tt.is_zero
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), model(idx), rtol=0, atol=1e-12)


def test_an_embedding_at_rank_zero_returns_zeros():
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(prune_every=None))
    kill(model.emb.tt.gates[0], range(8))
    records = hook.prune()
    assert [r.zeroed for r in records] == [True]
    idx = torch.tensor([[0, 5], [23, 7]])
    assert torch.equal(model.emb(idx), torch.zeros(2, 2, 12, dtype=torch.float64))
    assert torch.equal(model.head(torch.ones(4, 12, dtype=torch.float64)), torch.zeros(4, 24, dtype=torch.float64))


def _hand_slice_state(state: dict, keep_first, keep_last) -> dict:
    out = dict(state)
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if key in out:
            out[key] = slice_core(out[key], keep_first, keep_last)
    return out


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.Adam(params, lr=1e-2),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    ],
    ids=["adam", "adamw", "sgd-momentum"],
)
def test_training_after_shrinking_matches_a_model_built_small(make_optimizer):
    batch = toy_batch()
    model = make_toy()
    optimizer = make_optimizer(model.parameters())
    hook = RankAdaptive(model, optimizer, CoMERAConfig(l1_weight=0.0, prune_every=None))
    for _ in range(4):  # non-trivial optimizer state
        optimizer.zero_grad()
        toy_loss(model, batch).backward()
        optimizer.step()
    kill(model.emb.tt.gates[0], [0, 6])
    kill(model.fc.tt.gates[1], [1, 2, 5])
    kill(model.out.tt.gates[0], [3])

    # Reference: a model built with the small ranks, its optimizer state sliced by hand.
    small = make_toy(seed=7)
    names = [n for n, _ in model.named_parameters()]
    big_state = copy.deepcopy(optimizer.state_dict())  # load_state_dict would share the tensors
    slicing = {}  # parameter name -> (keep on the first axis, keep on the last axis)
    for entry in tt_matrices(model):
        keep, n = keep_lists(entry.tt), len(entry.tt.cores)
        prefix = {"emb": "emb.tt.", "fc": "fc.tt.", "out": "out.tt."}[entry.name]
        for k in range(n):
            slicing[f"{prefix}cores.{k}"] = (keep[k - 1] if k > 0 else None, keep[k] if k < n - 1 else None)
        for k in range(n - 1):
            slicing[f"{prefix}gates.{k}"] = (keep[k], None)
        getattr(small, entry.name).tt = hand_shrunk(entry.tt)
    small.head.tt = small.emb.tt
    with torch.no_grad():
        small.fc.bias.copy_(model.fc.bias)
        small.out.bias.copy_(model.out.bias)
    small_optimizer = make_optimizer(small.parameters())
    assert [n for n, _ in small.named_parameters()] == names
    state = {i: _hand_slice_state(s, *slicing.get(names[i], (None, None))) for i, s in big_state["state"].items()}
    small_optimizer.load_state_dict({"state": state, "param_groups": big_state["param_groups"]})

    hook.prune()
    hook.remove()
    for _ in range(5):
        for m, opt in ((model, optimizer), (small, small_optimizer)):
            opt.zero_grad()
            toy_loss(m, batch).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), small.parameters()):
        assert p.shape == q.shape, name
        assert (p - q).abs().max().item() <= 1e-12, name


def test_checkpoint_of_a_shrunk_model_resumes_identically():
    batch = toy_batch()
    settings = CoMERAConfig(l1_weight=0.05, prune_every=3, keep_fraction=0.8, late_start_step=8)
    model = make_toy()
    optimizer = torch.optim.Adam(param_groups(model, lr_cores=1e-2, lr_gates=5e-2, lr_other=1e-2))
    hook = RankAdaptive(model, optimizer, settings)
    kill(model.fc.tt.gates[1], [0, 1, 2])
    kill(model.emb.tt.gates[0], [4])
    hook.prune()

    def step(m, opt, h):
        opt.zero_grad()
        loss = toy_loss(m, batch)
        loss.backward()
        h.observe(loss)
        opt.step()
        return loss.item()

    for _ in range(7):
        step(model, optimizer, hook)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()}
    )
    ranks = {e.name: e.tt.ranks for e in tt_matrices(model)}
    expected = [step(model, optimizer, hook) for _ in range(6)]  # crosses the stage switch and a pruning

    fresh = make_toy(seed=11, randomize_gates=False)
    fresh.load_state_dict(checkpoint["model"])  # adopts the smaller ranks; build the optimizer afterwards
    assert {e.name: e.tt.ranks for e in tt_matrices(fresh)} == ranks
    fresh_optimizer = torch.optim.Adam(param_groups(fresh, lr_cores=1e-2, lr_gates=5e-2, lr_other=1e-2))
    fresh_optimizer.load_state_dict(checkpoint["optimizer"])
    fresh_hook = RankAdaptive(fresh, fresh_optimizer, settings)
    fresh_hook.load_state_dict(checkpoint["hook"])
    resumed = [step(fresh, fresh_optimizer, fresh_hook) for _ in range(6)]

    assert resumed == pytest.approx(expected, rel=0, abs=1e-12)
    assert fresh_hook.stage == hook.stage == LATE
    assert {e.name: e.tt.ranks for e in tt_matrices(fresh)} == {e.name: e.tt.ranks for e in tt_matrices(model)}


# ----------------------------------------------------------------------------------------------- hooks, history


def test_remove_detaches_the_hooks():
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(l1_weight=1.0, prune_every=1))
    gates = lambda: [g.detach().clone() for e in tt_matrices(model) for g in e.tt.gates]  # noqa: E731
    before = gates()
    _zero_grads(model)
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, gates()))  # the penalty moved them
    assert hook.step == 1

    hook.remove()
    hook.remove()  # idempotent
    kill(model.fc.tt.gates[0], [0])  # would be pruned if the post-hook still ran
    before = gates()
    _zero_grads(model)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, gates()))
    assert hook.step == 1 and len(hook.history) == 1
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_history_is_recorded_and_saved(tmp_path):
    model, x, y = regression_problem()
    optimizer = torch.optim.Adam(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_other=1e-2))
    hook = RankAdaptive(model, optimizer, CoMERAConfig(l1_weight=0.05, prune_every=4), history_every=2)
    kill(model[0].tt.gates[1], [0])
    train(model, optimizer, hook, x, y, 5)
    steps = [e.step for e in hook.history]
    assert steps == [2, 4]  # every 2 steps; the pruning at 4 coincides
    last = hook.history_as_dicts()[-1]
    assert last["shrunk"] == ["0"] and last["ranks"]["0"][2] == 7 and last["stage"] == EARLY
    assert last["tt_params"] == hook.live_tt_params() and last["compression"] == pytest.approx(
        last["dense_params"] / last["tt_params"]
    )
    assert isinstance(last["loss"], float) and last["wall_time"] >= 0
    path = tmp_path / "history.json"
    hook.save_history(path)
    assert json.loads(path.read_text()) == hook.history_as_dicts()


# --------------------------------------------------------------------------------------------------- refusals


def test_invalid_use_is_refused_with_a_reason():
    model = make_toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="late stage needs a size target"):
        RankAdaptive(model, optimizer, CoMERAConfig(late_start_step=10))
    with pytest.raises(ValueError, match="at most one"):
        RankAdaptive(model, optimizer, CoMERAConfig(keep_fraction=0.5, size_target=100))
    with pytest.raises(ValueError, match="prune_every"):
        RankAdaptive(model, optimizer, CoMERAConfig(prune_every=0))
    with pytest.raises(ValueError, match="no TTMatrix"):
        RankAdaptive(nn.Linear(3, 3), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1), CoMERAConfig())

    dense = Toy().double()
    early_optimizer = torch.optim.SGD(dense.parameters(), lr=0.1)  # built before tensorize_: no gates in it
    comera_fx.tensorize_(dense, CONFIG)
    with pytest.raises(ValueError, match="build it after"):
        RankAdaptive(dense, early_optimizer, CoMERAConfig())

    hook = RankAdaptive(model, optimizer, CoMERAConfig(keep_fraction=0.5, target_loss=0.1, late_start_step=0))
    _zero_grads(model)
    with pytest.raises(RuntimeError, match="observe"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="closure"):
        optimizer.step(lambda: 0.0)
    hook.remove()


def test_graph_pass_matrices_are_penalised_but_never_shrunk():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(12, 16)).double())
    comera_fx.passes.tensorize(gm, CONFIG)
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="graph pass"):
        hook = RankAdaptive(gm, optimizer, CoMERAConfig(prune_every=1))
    (entry,) = tt_matrices(gm)
    assert not entry.shrinkable
    kill(entry.tt.gates[0], [0])
    x = torch.randn(5, 12, dtype=torch.float64)
    before = gm(x)
    assert hook.prune() == []  # its ranks are constants of the graph: removing slices would break it
    torch.testing.assert_close(gm(x), before, rtol=0, atol=0)


def test_compiled_model_after_shrinking_runs_the_planned_order(monkeypatch):
    """A compiled model retraces after pruning; the new ranks must already be planned (a traced graph cannot plan),
    else it would silently run the fixed fallback order."""
    from comera_fx.tt import ops
    from comera_fx.tt.plan_cache import planned_ops

    model = make_toy()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, CoMERAConfig(prune_every=None))
    idx, _ = toy_batch()
    with torch.no_grad():
        model(idx)  # eager calls plan the products each matrix uses
    planned_before = {m.name: planned_ops(m.tt.layout, device="cpu") for m in tt_matrices(model)}
    kill(model.fc.tt.gates[1], [0, 4, 7])
    kill(model.out.tt.gates[2], [1])
    with torch.no_grad():
        expected = model(idx)  # killing gates changes values, not shapes: still the old layouts
    hook.prune()
    assert {m.name: planned_ops(m.tt.layout, device="cpu") for m in tt_matrices(model)} == planned_before

    def fallback(*args, **kwargs):
        raise AssertionError("the compiled graph ran the fixed fallback order")

    monkeypatch.setattr(ops, "matmul", fallback)
    monkeypatch.setattr(ops, "matmul_t", fallback)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="eager")(idx)
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
