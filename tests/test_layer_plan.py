"""passes/layer_plan.py: every layer's settings decided once, before anything is built, and built from the plan.

References: hand-written LayerSettings for the overrides, and for a size target the largest single max_rank whose
plain tensorize_ (TT-SVD by make_tt_matrix, no allocation code) fits, found by trying every rank.
"""

from __future__ import annotations

import torch
from torch import nn

import comera_fx
from comera_fx import LayerSettings, TensorizeConfig
from comera_fx.passes.layer_plan import LayerInput, plan_layers


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 80), nn.ReLU(), nn.Linear(80, 64))


def inputs(model: nn.Module) -> list[LayerInput]:
    return [LayerInput(f"{i}.weight", "linear", True, model[i].weight.detach().t()) for i in (0, 2, 4)]


def test_each_layer_gets_its_overrides_and_seed_once():
    config = TensorizeConfig(
        max_rank=12,
        min_numel=1000,
        seed=7,
        init="random",
        overrides={r"^2\.": {"max_rank": 4}, r"^4\.": {"num_modes": 2, "rank_ratio": 0.5}},
    )
    decided = plan_layers(inputs(mlp()), config)
    want = {
        "0.weight": LayerSettings(max_rank=12, init="random"),
        "2.weight": LayerSettings(max_rank=4, init="random"),
        "4.weight": LayerSettings(max_rank=12, rank_ratio=0.5, num_modes=2, init="random"),
    }
    assert {fqn: plan.settings for fqn, plan in decided.plans.items()} == want
    assert [plan.seed for plan in decided.plans.values()] == [7, 8, 9]
    assert all(plan.fit is None and plan.transposed for plan in decided.plans.values())
    assert decided.size_info is None and not decided.no_modes


def test_tensorize_resolves_each_layers_settings_once(monkeypatch):
    calls: list[str] = []
    resolve = TensorizeConfig.settings_for
    monkeypatch.setattr(TensorizeConfig, "settings_for", lambda self, fqn: calls.append(fqn) or resolve(self, fqn))
    summary = comera_fx.tensorize_(mlp(), TensorizeConfig(max_rank=8, min_numel=1000, size_target=0.3))
    assert len(summary.converted) == 3
    assert sorted(calls) == sorted(d.fqn for d in summary.converted)  # once each, no more


def test_a_uniform_size_target_plans_the_ranks_plain_tt_svd_would_give_at_the_best_single_max_rank():
    dense_sizes = 96 * 128 + 128 * 80 + 80 * 64
    target = 0.2
    asked = round(target * dense_sizes)

    def plain(rank: int) -> tuple[int, dict[str, tuple[int, ...]]]:
        model = mlp()
        summary = comera_fx.tensorize_(model, TensorizeConfig(max_rank=rank, min_numel=1000))
        return sum(d.params for d in summary.converted), summary.ranks

    best = 1
    while plain(best + 1)[0] <= asked:  # TT size grows with max_rank: the first rank over the target ends it
        best += 1
    config = TensorizeConfig(min_numel=1000, size_target=target, allocation="uniform")
    decided = plan_layers(inputs(mlp()), config)
    assert decided.size_info.max_rank == best and decided.size_info.asked == asked
    planned = {fqn: plan.fit.ranks for fqn, plan in decided.plans.items()}
    assert planned == plain(best)[1]
    summary = comera_fx.tensorize_(mlp(), config)  # built from the plan: the planned ranks, nothing else
    assert summary.ranks == planned
