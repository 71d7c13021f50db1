"""Rank allocation under a parameter budget (comera_fx/tt/allocate.py), and its wiring through tensorize_."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.tt.allocate import BudgetTooSmall, allocate_ranks, bond_energies, chain_params, uniform_ranks
from comera_fx.tt.decompose import matrix_to_tt, tt_core_shapes
from comera_fx.tt.shapes import capped_ranks, feasible_ranks
from comera_fx.tt.whiten import tt_chain_to_matrix

from helpers_models import MLP

ROW_MODES, COL_MODES = (8, 8), (8, 8)
DIMS = ROW_MODES + COL_MODES


def planted(decay: float | None, seed: int) -> torch.Tensor:
    """64 × 64: singular values decaying like decay**i (fast) or a Gaussian matrix (flat spectrum)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(64, 64, dtype=torch.float64, generator=g)
    if decay is None:
        return m
    u, _, vh = torch.linalg.svd(m)
    return (u * decay ** torch.arange(64, dtype=torch.float64)) @ vh


def relative_energies(m):
    chain = m.reshape(DIMS)
    return [e / float((chain**2).sum()) for e in bond_energies(chain)]


def tt_relative_error(m, ranks):
    cores = matrix_to_tt(m, ROW_MODES, COL_MODES, ranks)
    return float((tt_chain_to_matrix(cores, ROW_MODES, COL_MODES, 64, 64) - m).norm() / m.norm())


def test_chain_params_counts_cores_and_gates():
    for ranks in [(1, 8, 20, 8, 1), (1, 3, 5, 2, 1), capped_ranks(DIMS, 4)]:
        shapes = tt_core_shapes(ROW_MODES, COL_MODES, ranks)
        assert chain_params(DIMS, ranks) == sum(math.prod(s) for s in shapes) + sum(ranks[1:-1])


def test_bond_energies_are_the_unfolding_spectra():
    t = torch.randn(4, 5, 6, dtype=torch.float64)
    energies = bond_energies(t)
    assert len(energies) == 2
    for k, e in zip((1, 2), energies):
        unfolding = t.reshape(math.prod(t.shape[:k]), -1)
        assert float(e.sum()) == pytest.approx(float((unfolding**2).sum()))  # sum of σ² = ||A||²
        assert float(e[0]) == pytest.approx(float(torch.linalg.matrix_norm(unfolding, ord=2) ** 2))


@pytest.mark.parametrize("budget", [200, 3000, 9000])
def test_uniform_ranks_meet_the_budget_within_one_step(budget):
    dims = [DIMS, (4, 8, 8, 16)]
    max_rank, ranks = uniform_ranks(dims, budget)
    total = sum(chain_params(d, r) for d, r in zip(dims, ranks))
    assert total <= budget
    bigger = sum(chain_params(d, capped_ranks(d, max_rank + 1)) for d in dims)
    assert bigger > budget or all(capped_ranks(d, max_rank + 1) == capped_ranks(d, max_rank) for d in dims)


def test_energy_allocation_meets_the_budget_within_one_raise():
    layers = [planted(0.7, 0), planted(None, 1)]
    energies = [relative_energies(m) for m in layers]
    budget = 6000
    ranks = allocate_ranks([DIMS, DIMS], energies, budget)
    total = sum(chain_params(DIMS, r) for r in ranks)
    assert total <= budget
    # No bond that could still rise (energy left, feasible, consistent with its neighbours) fits what is left.
    caps = feasible_ranks(DIMS)
    for r, e in zip(ranks, energies):
        for k in range(1, len(DIMS)):
            new = r[k] + 1
            possible = (
                new <= caps[k] and r[k] < len(e[k - 1]) and new <= r[k - 1] * DIMS[k - 1] and new <= DIMS[k] * r[k + 1]
            )
            cost = r[k - 1] * DIMS[k - 1] + DIMS[k] * r[k + 1] + 1
            assert not possible or cost > budget - total


def test_ranks_go_where_the_energy_is():
    """A fast-decaying layer needs few ranks for almost all of its energy; the flat one gets the rest, and the
    summed relative error after real TT-SVD is below that of one max_rank for both at no more parameters."""
    fast, flat = planted(0.6, 2), planted(None, 3)
    energies = [relative_energies(fast), relative_energies(flat)]
    budget = 7000
    ranks_fast, ranks_flat = allocate_ranks([DIMS, DIMS], energies, budget)
    assert ranks_fast[2] < ranks_flat[2]  # the middle bond (the matrix rank)
    assert ranks_fast[2] <= 10 and tt_relative_error(fast, ranks_fast) < 0.1  # 0.6**6 < 0.05
    _, uniform = uniform_ranks([DIMS, DIMS], budget)
    energy_cost = chain_params(DIMS, ranks_fast) + chain_params(DIMS, ranks_flat)
    uniform_cost = sum(chain_params(DIMS, r) for r in uniform)
    assert energy_cost <= budget and uniform_cost <= budget
    energy_err = tt_relative_error(fast, ranks_fast) ** 2 + tt_relative_error(flat, ranks_flat) ** 2
    uniform_err = tt_relative_error(fast, uniform[0]) ** 2 + tt_relative_error(flat, uniform[1]) ** 2
    assert energy_err < uniform_err


def test_budget_too_small():
    with pytest.raises(BudgetTooSmall, match="rank 1"):
        uniform_ranks([DIMS], 10)
    with pytest.raises(BudgetTooSmall, match="rank 1"):
        allocate_ranks([DIMS], [relative_energies(planted(None, 0))], 10)


# ------------------------------------------------------------------------------------------ through tensorize_


def tt_params_in(model: nn.Module) -> int:
    """Cores + gates counted from the model's TT matrices themselves."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, comera_fx.TTMatrix) and id(module) not in seen:
            seen.add(id(module))
            total += sum(p.numel() for p in module.parameters())
    return total


@pytest.mark.parametrize("allocation", ["uniform", "energy"])
@pytest.mark.parametrize("budget", [0.25, 9000])
def test_tensorize_meets_the_budget(allocation, budget):
    torch.manual_seed(0)
    model = MLP(128, 256, 100)
    dense = 128 * 256 + 256 * 100
    summary = comera_fx.tensorize_(model, TensorizeConfig(size_target=budget, allocation=allocation, min_numel=1000))
    asked = budget if isinstance(budget, int) else round(budget * dense)
    assert summary.size_target.asked == asked and summary.size_target.dense == dense
    assert summary.size_target.reached == tt_params_in(model) <= asked
    assert summary.size_target.reached > 0.85 * asked  # within a rank step of it at these sizes
    assert set(summary.ranks) == {"fc1.weight", "fc2.weight"}
    assert "size_target" in str(summary)


def test_config_validation_names_the_field():
    for bad in (0, -3, 0.0, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="size_target"):
            TensorizeConfig(size_target=bad)
    with pytest.raises(ValueError, match="allocation"):
        TensorizeConfig(allocation="greedy")
    with pytest.raises(ValueError, match="allocation"):
        TensorizeConfig(size_target=0.5, allocation="energy", init="random")
    with pytest.raises(ValueError, match="rel_tol"):
        TensorizeConfig(size_target=0.5, rel_tol=0.1)
    config = TensorizeConfig(size_target=0.5, allocation="energy")
    assert TensorizeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="size_target"):
        comera_fx.tensorize_(MLP(), TensorizeConfig(size_target=10, min_numel=1000))
