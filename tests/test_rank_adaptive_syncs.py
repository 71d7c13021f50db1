"""Issue 44: ``RankAdaptive``'s per-step path reads nothing back to the host between prune points (a GPU step then
never waits for the device in the hook, and CUDA graphs replay back to back); prune points do read (so the counter
is seen to work). Also the late stage's λ and size, now computed on the device, against the host formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx import BudgetConfig, CoMERAConfig
from comera_fx.runtime import RankAdaptive
from comera_fx.runtime.comera import achievement_lambda, achievement_lambda_on_device, tt_params_at_counts
from comera_fx.runtime.schedule import BudgetSchedule
from comera_fx.testing.strategies import tt_layouts
from comera_fx.testing.syncs import host_reads
from comera_fx.tt import TTMatrix
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.inventory import live_count_tensor, live_counts

STEPS = 20
BUDGET = BudgetConfig(keep_fraction=0.5, total_steps=STEPS)
BUDGET_PRUNES = set(
    BudgetSchedule(1, 0, BUDGET.warmup_fraction, BUDGET.final_fraction, BUDGET.prunes).prune_steps(STEPS)
)


def small_tt_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=4, min_numel=1, min_dim=1))
    return model


def reads_per_step(config) -> dict[int, list]:
    """Train ``STEPS`` steps with the hook (the loss observed every step): per step, the host reads comera_fx made
    in observe + optimizer step (not the optimizer's own, such as AdamW's step counter)."""
    model = small_tt_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = RankAdaptive(model, optimizer, config)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
    reads = {}
    for step in range(1, STEPS + 1):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        with host_reads() as found:
            hook.observe(loss)
            optimizer.step()
            optimizer.zero_grad()
        reads[step] = found.by_comera_fx()
    history = hook.history  # the losses kept on the device are read here
    assert [e.step for e in history] == list(range(1, STEPS + 1)) and history[-1].loss == float(loss.detach())
    return reads


@pytest.mark.parametrize(
    "config, prune_steps",
    [
        (BUDGET, BUDGET_PRUNES),
        (CoMERAConfig(prune_every=5), {5, 10, 15, 20}),
        (CoMERAConfig(prune_every=5, keep_fraction=0.5, late_start_step=3, target_loss=0.1), {5, 10, 15, 20}),
    ],
    ids=["budget", "comera", "comera-late-stage"],
)
def test_no_host_reads_between_prune_points(config, prune_steps):
    reads = reads_per_step(config)
    between = {s: [f"{r.what} at {r.where}" for r in found] for s, found in reads.items() if s not in prune_steps}
    assert not any(between.values()), between
    assert all(reads[step] for step in prune_steps)  # a prune reads the gates: the counter does see reads


def test_plateau_detection_reads_the_loss_every_step():
    """The one documented exception: the plateau's stage switch is decided on the host from the loss."""
    reads = reads_per_step(CoMERAConfig(prune_every=None, keep_fraction=0.5, plateau_patience=50))
    assert all(len(found) == 1 and "update_stage" in found[0].where for found in reads.values())


@given(
    loss=st.one_of(st.none(), st.floats(-10, 10)),
    target_loss=st.one_of(st.none(), st.floats(-10, 10)),
    size=st.integers(0, 10**6),
    target_size=st.floats(0, 10**6),
)
def test_the_device_lambda_is_the_host_formulas(loss, target_loss, size, target_size):
    expected = achievement_lambda(loss, target_loss, size, target_size)
    as_tensor = None if loss is None else torch.tensor(loss, dtype=torch.float64)
    got = achievement_lambda_on_device(as_tensor, target_loss, torch.tensor(size), target_size)
    assert got.dtype == torch.float64 and float(got) == expected


@given(layouts=st.lists(tt_layouts(max_modes=3), min_size=1, max_size=3), data=st.data())
def test_the_size_at_counts_on_the_device_is_the_layouts_size_at_those_ranks(layouts, data):
    """Reference: each layout's own parameter count at the counted ranks (cores + gates), 0 with a rank-0 bond."""
    matrices = []
    for layout in layouts:
        gates = [
            torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=r, max_size=r)), dtype=torch.float64)
            for r in layout.internal_ranks
        ]
        matrices.append(TTMatrix(layout, random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64), gates))
    counts = live_count_tensor(matrices, 0.1)
    assume(counts is not None)  # single-core matrices only: no bond to count
    expected = sum(
        0 if 0 in c else m.layout.with_ranks((1, *c, 1)).num_params
        for m, c in zip(matrices, live_counts(matrices, 0.1))
    )
    assert float(tt_params_at_counts([m.layout for m in matrices], counts)) == expected
