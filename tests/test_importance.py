"""The per-step bookkeeping of the budget schedule, batched over all gates (``BondSensitivity.update``,
``live_counts``), against a plain per-gate float64 reference: the smoothed Σ|g·∂L/∂g| per bond, the smoothed
|Σ g·∂L/∂g| per matrix, the "no evidence" rule for a missing or all-zero gradient, and the live counts."""

from __future__ import annotations

import math

import pytest
import torch

from comera_fx.runtime.importance import BondSensitivity
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.inventory import MatrixEntry, live_counts
from comera_fx.tt.layers import TTMatrix
from comera_fx.tt.layout import TTFormat, TTLayout


def matrix(ranks, dtype, seed):
    row_modes, col_modes = (2,) * (len(ranks) - 1), (3,) * (len(ranks) - 1)
    layout = TTLayout(TTFormat.TTM, 2 ** (len(ranks) - 1), 3 ** (len(ranks) - 1), row_modes, col_modes, ranks)
    gen = torch.Generator().manual_seed(seed)
    tt = TTMatrix(layout, random_tt_cores(layout.core_shapes, 1.0, dtype=dtype, generator=gen))
    with torch.no_grad():
        for gate in tt.gates:
            gate.copy_(torch.randn(gate.shape, generator=gen, dtype=torch.float64).to(dtype))
    return tt


@pytest.fixture
def entries():
    specs = [("a", (1, 3, 4, 1), torch.float32), ("b", (1, 5, 2, 3, 1), torch.float64), ("c", (1, 2, 1), torch.float32)]
    return [
        MatrixEntry(name, matrix(ranks, dtype, seed), True, (name,)) for seed, (name, ranks, dtype) in enumerate(specs)
    ]


def reference_step(state, entries, beta):
    """One update of the float64 reference, per gate, in Python."""
    for entry in entries:
        for k, gate in enumerate(entry.tt.gates):
            if gate.grad is None:
                continue
            g = gate.detach().double().tolist()
            d = gate.grad.double().tolist()
            if not any(x != 0 for x in d):
                continue  # no evidence: the averages stay
            key = (entry.name, k)
            state["bond"][key] = beta * state["bond"].get(key, 0.0) + (1 - beta) * sum(abs(a * b) for a, b in zip(g, d))
            if k == 0:
                state["layer"][entry.name] = beta * state["layer"].get(entry.name, 0.0) + (1 - beta) * abs(
                    sum(a * b for a, b in zip(g, d))
                )
                state["seen"].add(entry.name)


def set_grads(entries, step, gen):
    """Random gradients, with one gate left without a gradient and one given an all-zero gradient, varying by
    step."""
    for m, entry in enumerate(entries):
        for k, gate in enumerate(entry.tt.gates):
            pattern = (step + m + k) % 4
            if pattern == 0:
                gate.grad = None
            elif pattern == 1:
                gate.grad = torch.zeros_like(gate)
            else:
                gate.grad = torch.randn(gate.shape, generator=gen, dtype=torch.float64).to(gate.dtype)


def test_bond_sensitivity_matches_a_per_gate_float64_reference(entries):
    beta = 0.7
    sensitivity = BondSensitivity(beta)
    state = {"bond": {}, "layer": {}, "seen": set()}
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        set_grads(entries, step, gen)
        sensitivity.update(entries)
        reference_step(state, entries, beta)
    bonds, layers = sensitivity.values(entries)
    assert sensitivity.updates == 6
    for entry in entries:
        expected = [state["bond"].get((entry.name, k), 0.0) for k in range(len(entry.tt.gates))]
        tol = 1e-6 if entry.tt.gates[0].dtype == torch.float32 else 1e-12
        assert bonds[entry.name] == pytest.approx(expected, rel=tol, abs=tol)
        assert layers[entry.name] == pytest.approx(state["layer"].get(entry.name, 0.0), rel=tol, abs=tol)
        assert all(ema.dtype == gate.dtype for ema, gate in zip(sensitivity.ema[entry.name], entry.tt.gates))
    assert set(entry.name for entry in entries) - sensitivity.unseen(entries) == state["seen"]
    # the grads' pattern gave every bond evidence at some step, so no comparison above is a trivial 0 == 0
    assert len(state["bond"]) == sum(len(entry.tt.gates) for entry in entries)
    assert state["seen"] == {"a", "b", "c"}


def test_a_step_with_no_evidence_changes_nothing(entries):
    sensitivity = BondSensitivity(0.5)
    gen = torch.Generator().manual_seed(1)
    for entry in entries:
        for gate in entry.tt.gates:
            gate.grad = torch.randn(gate.shape, generator=gen, dtype=torch.float64).to(gate.dtype)
    sensitivity.update(entries)
    before = sensitivity.values(entries)
    for entry in entries:
        for gate in entry.tt.gates:
            gate.grad = torch.zeros_like(gate)
    sensitivity.start_window()
    sensitivity.update(entries)
    assert sensitivity.values(entries) == before
    assert sensitivity.unseen(entries) == {"a", "b", "c"}


@pytest.mark.parametrize("threshold", [0.25, 0.5, 1.0])  # exact in float32: a gate can sit on it
def test_live_counts_match_a_per_gate_count(entries, threshold):
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for entry in entries:
            for gate in entry.tt.gates:
                gate.copy_((torch.rand(gate.shape, generator=gen, dtype=torch.float64) * 2 - 1).to(gate.dtype))
                gate[0] = 0.0
                gate[-1] = -threshold  # on the threshold: not live (|g| > threshold)
    expected = [
        tuple(sum(1 for x in gate.detach().double().tolist() if abs(x) > threshold) for gate in entry.tt.gates)
        for entry in entries
    ]
    got = live_counts([entry.tt for entry in entries], threshold)
    assert got == expected
    assert math.prod(len(c) for c in got) > 0
    assert live_counts([], threshold) == []


def test_bfloat16_gates_accumulate_like_the_float64_reference():
    """Low-precision gates: the per-matrix sum runs in float32 (as ``Tensor.sum`` would), so the averages stay
    within bfloat16's rounding of the float64 reference."""
    entries = [MatrixEntry("h", matrix((1, 6, 5, 7, 1), torch.bfloat16, 9), True, ("h",))]
    beta = 0.6
    sensitivity = BondSensitivity(beta)
    state = {"bond": {}, "layer": {}, "seen": set()}
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for gate in entries[0].tt.gates:
            gate.grad = torch.randn(gate.shape, generator=gen, dtype=torch.float64).to(torch.bfloat16)
        sensitivity.update(entries)
        reference_step(state, entries, beta)
    bonds, layers = sensitivity.values(entries)
    assert bonds["h"] == pytest.approx([state["bond"][("h", k)] for k in range(3)], rel=2e-2)
    assert layers["h"] == pytest.approx(state["layer"]["h"], rel=2e-2, abs=1e-2)
