"""balance_cores_: one RMS entry per TT chain, the represented matrix and the cores' int grids unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from comera_fx.quantize import QuantSpec, quantize_groups
from comera_fx.tt import TTFormat, make_tt_matrix
from comera_fx.tt.balance import balance_cores_, balancing_factors
from test_layers import assert_rel_close, reference_dense


def test_factors_multiply_to_one_and_equalise():
    rms = [0.02, 0.5, 3.0]
    factors = balancing_factors(rms)
    assert math.prod(factors) == pytest.approx(1.0, rel=1e-12)
    sizes = [f * r for f, r in zip(factors, rms)]
    assert max(sizes) == pytest.approx(min(sizes), rel=1e-12)
    assert balancing_factors([0.0, 2.0]) == [1.0, 1.0] and balancing_factors([]) == []
    with pytest.raises(ValueError, match="finite"):
        balancing_factors([1.0, float("nan")])


@pytest.mark.parametrize("fmt, num_modes", [(TTFormat.TT, 1), (TTFormat.TT, 3), (TTFormat.TTM, 2)])
def test_balanced_chain_keeps_its_matrix_and_grids(fmt, num_modes):
    """An SVD-initialised chain (one core holds the norm, entry sizes apart by > 5x) becomes one with equal RMS
    entries; its float64 einsum matrix is the one before (rel 1e-12, gates included); an int8 grid per group of
    each core keeps its codes (the scales follow the absolute maximum)."""
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.float64) * 3.0
    tt = make_tt_matrix(weight, kind="linear", format=fmt, max_rank=12, num_modes=num_modes)
    with torch.no_grad():
        for gate in tt.gates:
            gate.uniform_(0.5, 1.5)
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([tt]))
    linear_before = model[0].weight.detach().clone()
    before = reference_dense(tt)
    rms_before = [float(c.detach().pow(2).mean().sqrt()) for c in tt.cores]
    assert max(rms_before) > 5 * min(rms_before)
    spec = QuantSpec(8, 16)
    codes_before = [quantize_groups(c.detach(), spec)[0] for c in tt.cores]
    assert balance_cores_(model) == 1
    rms = [float(c.detach().pow(2).mean().sqrt()) for c in tt.cores]
    assert max(rms) == pytest.approx(min(rms), rel=1e-9)
    assert_rel_close(reference_dense(tt), before, 1e-12)
    assert torch.equal(model[0].weight, linear_before)
    for core, codes in zip(tt.cores, codes_before):
        assert torch.equal(quantize_groups(core.detach(), spec)[0], codes)
    balance_cores_(model)  # a second call: factors of ~1, the matrix and the sizes stay
    assert_rel_close(reference_dense(tt), before, 1e-12)
    assert [float(c.detach().pow(2).mean().sqrt()) for c in tt.cores] == pytest.approx(rms, rel=1e-9)
