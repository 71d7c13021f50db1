"""comera_fx.choose_formats / apply_formats_: a storage format per layer under one byte budget. The selection is
checked against brute force, the measured errors against the calibration inputs themselves (float64), and bad
input is refused before any weight moves."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx.pretrained.format_select import CORE_BITS, FormatChoice, lower_hull, select, select_on_hulls
from comera_fx.quantize import QuantSpec, fake_quant, quantized_specs, stored_bytes
from comera_fx.tt.layers import TTLinear


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(1, 60), st.floats(0, 1)), min_size=1, max_size=5), min_size=1, max_size=3),
    st.integers(0, 200),
    st.integers(0, 12),
)
def test_selection_fits_and_is_optimal_at_its_own_breakpoints(layers, budget_extra, steps):
    """Against brute force over every combination of every candidate (dominated ones included): the choice always
    fits the budget, no single swap that fits improves it, and at a budget where the steps of best error per byte,
    taken in order, fill it exactly, no combination of at most that many bytes has a smaller summed error."""
    candidates = {
        f"l{i}": [FormatChoice(f"l{i}", "int8", None, b, e) for b, e in cands] for i, cands in enumerate(layers)
    }
    hulls = {fqn: lower_hull(c) for fqn, c in candidates.items()}
    smallest = sum(h[0].bytes for h in hulls.values())

    def summed(chosen):
        picked = [hulls[f][i] for f, i in chosen.items()]
        return sum(c.bytes for c in picked), sum(c.error for c in picked)

    def best_within(budget):
        return min(
            sum(c.error for c in combo)
            for combo in itertools.product(*candidates.values())
            if sum(c.bytes for c in combo) <= budget
        )

    budget = smallest + budget_extra
    spent, _ = summed(select_on_hulls(hulls, budget))
    assert spent <= budget
    final = select(candidates, budget)
    spent = sum(c.bytes for c in final.values())
    assert spent <= budget
    for fqn, found in candidates.items():  # no single swap that fits lowers the error
        for c in found:
            assert not (spent - final[fqn].bytes + c.bytes <= budget and c.error < final[fqn].error - 1e-15)
    # the breakpoints: every hull step, in order of error saved per byte (a hull's own steps come in its order)
    moves = sorted(
        ((h[k].error - h[k + 1].error) / (h[k + 1].bytes - h[k].bytes), h[k + 1].bytes - h[k].bytes)
        for h in hulls.values()
        for k in range(len(h) - 1)
    )[::-1]
    assume(len({gain for gain, _ in moves}) == len(moves))  # ties make the order (and the breakpoints) ambiguous
    breakpoint_budget = smallest + sum(extra for _, extra in moves[:steps])
    spent, error = summed(select_on_hulls(hulls, breakpoint_budget))
    assert spent == breakpoint_budget
    assert error <= best_within(breakpoint_budget) + 1e-12


class ThreeLayers(nn.Module):
    """A layer of rank 2 (TT at a small rank is near exact), a full-rank random one (a flat spectrum: an int grid
    wins), and a third in between, all reading the same full-rank input."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.low = nn.Linear(64, 64, bias=False)
        self.flat = nn.Linear(64, 64, bias=False)
        self.mid = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.low.weight.copy_(torch.randn(64, 2, generator=gen) @ torch.randn(2, 64, generator=gen))
            self.flat.weight.copy_(torch.randn(64, 64, generator=gen))
            u, _, vh = torch.linalg.svd(torch.randn(64, 64, generator=gen))
            self.mid.weight.copy_(u @ torch.diag(torch.logspace(0, -3, 64)) @ vh)

    def forward(self, x):
        return self.low(x) + self.flat(x) + self.mid(x)  # full-rank inputs for each


CONFIG = comera_fx.TensorizeConfig(min_numel=1, min_dim=1)


def calibrated():
    model = ThreeLayers()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(32, 64, generator=gen) for _ in range(4)]
    return model, batches, comera_fx.calibrate(model, batches, config=CONFIG)


def layer_inputs(model, batches):
    """Each layer's inputs over the calibration batches, recorded by hooks (independent of the Calibration)."""
    seen = {name: [] for name in ("low", "flat", "mid")}
    handles = [
        getattr(model, n).register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].double())) for n in seen
    ]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_plan_fits_the_budget_and_its_errors_are_the_built_models():
    model, batches, cal = calibrated()
    original = {n: getattr(model, n).weight.detach().double().clone() for n in ("low", "flat", "mid")}
    inputs = layer_inputs(model, batches)
    plan = comera_fx.choose_formats(model, cal, 0.15, ranks=(1, 2, 4, 8, 16), config=CONFIG)
    assert plan.total_bytes <= plan.budget_bytes == int(0.15 * plan.dense_bytes)
    # rank 2: the low-rank product is exact at rank 2, in fewer bytes than any int grid or many-mode TT
    assert plan.choices["low.weight"].format in ("lr", "lr4")
    assert plan.choices["flat.weight"].format in ("int8", "int4", "int3")
    comera_fx.apply_formats_(model, plan, cal)
    assert isinstance(model.low, TTLinear) and isinstance(model.flat, nn.Linear)
    for name, w in original.items():
        module = getattr(model, name)
        built = (module.tt.dense().t() if isinstance(module, TTLinear) else module.weight).detach().double()
        x = inputs[name]
        want = float((x @ (w - built).T).square().sum() / (x @ w.T).square().sum())
        assert plan.choices[f"{name}.weight"].error == pytest.approx(want, rel=1e-6, abs=1e-12), name
    assert stored_bytes(model) == plan.total_bytes
    specs = quantized_specs(model)
    for name in ("low", "flat", "mid"):  # each layer on its chosen grid
        choice, module = plan.choices[f"{name}.weight"], getattr(model, name)
        bits = {"tt": 8, "tt4": 4, "lr": 8, "lr4": 4}.get(choice.format) or int(choice.format[3:])
        mine = [spec for key, spec in specs.items() if key.startswith(f"{name}.")]
        assert mine and all(spec == QuantSpec(bits, choice.group_size) for spec in mine), name
    assert len(specs) == sum(
        len(list(getattr(model, n).tt.cores)) if isinstance(getattr(model, n), TTLinear) else 1
        for n in ("low", "flat", "mid")
    )


def test_int3_choices_build_seven_level_grids_of_the_planned_bytes():
    """Only int3 allowed: every layer on a 7-level grid of its group size, the bytes and error as planned (the error
    against the float64 product over the recorded inputs); a budget below int3's smallest grids is refused."""
    model, batches, cal = calibrated()
    original = {n: getattr(model, n).weight.detach().double().clone() for n in ("low", "flat", "mid")}
    inputs = layer_inputs(model, batches)
    plan = comera_fx.choose_formats(model, cal, 0.12, formats=("int3",), config=CONFIG)
    assert {c.format for c in plan.choices.values()} == {"int3"}
    comera_fx.apply_formats_(model, plan, cal)
    for name, w in original.items():
        choice, weight = plan.choices[f"{name}.weight"], getattr(model, name).weight.detach()
        group, flat = choice.group_size or weight.numel(), weight.reshape(-1)
        for start in range(0, flat.numel(), group):  # one scale per group: at most seven values in it
            assert len(torch.unique(flat[start : start + group])) <= 7
        assert choice.bytes == QuantSpec(3, choice.group_size).nbytes(weight.numel())
        x = inputs[name]
        want = float((x @ (w - weight.double()).T).square().sum() / (x @ w.T).square().sum())
        assert choice.error == pytest.approx(want, rel=1e-6, abs=1e-12), name
    assert stored_bytes(model) == plan.total_bytes
    with pytest.raises(ValueError, match="smallest formats"):
        comera_fx.choose_formats(model, cal, 0.05, formats=("int3",), config=CONFIG)


def test_a_larger_budget_never_has_a_larger_error():
    model, _, cal = calibrated()
    errors = [
        comera_fx.choose_formats(model, cal, b, ranks=(1, 2, 4, 8), config=CONFIG).total_error
        for b in (0.05, 0.1, 0.2, 0.3)
    ]
    assert errors == sorted(errors, reverse=True) and errors[0] > errors[-1]


def test_applied_plan_saves_and_loads_bit_for_bit(tmp_path):
    model, batches, cal = calibrated()
    plan = comera_fx.choose_formats(model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG)
    comera_fx.apply_formats_(model, plan, cal)
    path = tmp_path / "m.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, ThreeLayers)
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]), model(batches[0]))


def test_bad_input_is_refused_before_any_weight_moves():
    model, _, cal = calibrated()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="below the smallest formats' total"):
        comera_fx.choose_formats(model, cal, 0.001, ranks=(1, 2), config=CONFIG)
    other = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(ValueError, match="does not belong to this model"):
        comera_fx.choose_formats(other, cal, 0.2, config=CONFIG)
    narrow = comera_fx.calibrate(model, [torch.randn(8, 64)], config=CONFIG)
    narrow = comera_fx.Calibration(
        {k: comera_fx.InputStats(v.second_moment[:32, :32], v.tokens) for k, v in narrow.items()}
    )
    with pytest.raises(ValueError, match="input features"):
        comera_fx.choose_formats(model, narrow, 0.2, config=CONFIG)
    plan = comera_fx.choose_formats(model, cal, 0.2, ranks=(1, 2), config=CONFIG)
    with pytest.raises(ValueError, match="plan does not belong to this model"):
        comera_fx.apply_formats_(other, plan, cal)
    with pytest.raises(ValueError, match="calibration does not belong to this model"):
        comera_fx.apply_formats_(model, plan, narrow)
    with pytest.raises(ValueError, match="byte_budget"):
        comera_fx.choose_formats(model, cal, 1.5, config=CONFIG)
    with pytest.raises(ValueError, match="formats must be"):
        comera_fx.choose_formats(model, cal, 0.2, formats=("fp8",), config=CONFIG)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_output_errors_are_measured_at_the_output_and_leave_the_model_as_it_was():
    """With ``batches`` each candidate's error is the relative squared change of the model's output with that layer
    alone replaced: checked in float64 from the weights (the layers add up: y = x (W_low + W_flat + W_mid)ᵀ).
    The model comes back unchanged: weights, training flag, RNG state."""
    model, batches, cal = calibrated()
    model.train()
    weights = {n: getattr(model, n).weight.detach().double().clone() for n in ("low", "flat", "mid")}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = comera_fx.choose_formats(model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG, batches=batches[:2])
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert plan.total_bytes <= plan.budget_bytes
    x = torch.cat(batches[:2]).double()
    total = x @ sum(weights.values()).T
    comera_fx.apply_formats_(model, plan, cal)
    for name, w in weights.items():
        module = getattr(model, name)
        built = (module.tt.dense().t() if isinstance(module, TTLinear) else module.weight).detach().double()
        want = float((x @ (w - built).T).square().sum() / total.square().sum())
        assert plan.choices[f"{name}.weight"].error == pytest.approx(want, rel=2e-3, abs=1e-9), name


def test_the_output_short_list_chooses_what_scoring_every_candidate_chooses():
    """Default output scoring runs only a short-list at the output; on these layers it picks a plan whose summed
    output error is within 5 % of what running every candidate picks (the short-list is a heuristic: since the int
    grids' scales are searched it settles on int4 g64 + low-rank r2 for 6.20e-5 against int4 g128 + r4's 6.05e-5),
    with every chosen candidate's error the one measured at the output, in fewer passes."""
    model, batches, cal = calibrated()
    every = comera_fx.choose_formats(
        model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG, batches=batches[:2], score_all=True
    )
    short = comera_fx.choose_formats(model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG, batches=batches[:2])
    assert (every.scoring, short.scoring) == ("output", "shortlist")
    assert short.total_error <= 1.05 * every.total_error
    for fqn, c in short.choices.items():
        (same,) = [o for o in every.candidates[fqn] if o.label() == c.label() and o.group_size == c.group_size]
        assert c.error == pytest.approx(same.error, rel=1e-9, abs=1e-15)
    assert short.output_passes < every.output_passes == sum(len(v) for v in every.candidates.values())
    assert short.total_bytes <= short.budget_bytes


def test_fast_estimates_are_near_the_exact_errors_and_choose_alike():
    """``fast=True``: int errors from the diagonal of C within 10 % of tr(Eᵀ C E) (float64, from the weights, on the
    grid whose scales were searched with C's diagonal), TT
    candidates' bytes an upper bound of the built TT's (ranks at their caps); the same formats chosen."""
    from comera_fx.pretrained.format_estimates import LayerEstimator

    model, batches, cal = calibrated()
    for name in ("low", "flat", "mid"):
        layer = getattr(model, name)
        est = LayerEstimator(layer, cal[f"{name}.weight"], None)
        w, c = layer.weight.detach().double(), cal[f"{name}.weight"].second_moment.double()
        total = float((w @ c @ w.T).trace())
        for bits, group in ((8, 64), (4, 32)):
            # the grid with searched scales (checked against a brute-force search in tests/test_quantize.py)
            grid = fake_quant(layer.weight.detach(), bits, group, c.diagonal().float())
            e = w - grid.double()
            exact = float((e @ c @ e.T).trace()) / total
            assert est.int_error(bits, group) == pytest.approx(exact, rel=0.1), (name, bits)
    exact = comera_fx.choose_formats(
        model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG, batches=batches[:2], score_all=True
    )
    fast = comera_fx.choose_formats(model, cal, 0.15, ranks=(1, 2, 4, 8), config=CONFIG, fast=True, batches=batches[:2])
    for fqn, c in fast.candidates.items():
        for e in exact.candidates[fqn]:
            if e.format in CORE_BITS and e.error > 1e-6:
                mine = next(f for f in c if (f.format, f.max_rank) == (e.format, e.max_rank))
                assert mine.bytes >= e.bytes
    assert {k: c.format[:2] for k, c in fast.choices.items()} == {k: c.format[:2] for k, c in exact.choices.items()}
    assert fast.total_bytes <= fast.budget_bytes


def test_fast_tt_estimates_share_svds_and_are_the_float64_output_error():
    """``LayerEstimator`` shares its column-side SVDs across ranks and keeps every rank's cores: asked the ranks in a
    mixed order it gives each rank's stand-in as a fresh estimator asked only that rank does, and ``tt_error`` of it
    is the relative output error ||X (M - M̂)||² / ||X M||² of float64 forward passes over the calibration inputs, as
    is ``tt_estimate`` (the same error from the cores, without the dense M̂)."""
    from comera_fx.pretrained.format_estimates import LayerEstimator

    model, batches, cal = calibrated()
    inputs = layer_inputs(model, batches)
    for name in ("low", "mid"):
        layer, stats = getattr(model, name), cal[f"{name}.weight"]
        shared = LayerEstimator(layer, stats, None)
        x, w = inputs[name], layer.weight.detach().double()
        for rank in (8, 2, 16, 4, 8):
            mine = shared.tt_approx(rank, 4, 32)
            alone = LayerEstimator(layer, stats, None).tt_approx(rank, 4, 32)
            assert torch.allclose(mine, alone, rtol=1e-5, atol=1e-6), (name, rank)
            want = float((x @ (w.T - mine.double())).square().sum() / (x @ w.T).square().sum())
            assert shared.tt_error(mine) == pytest.approx(want, rel=1e-3, abs=1e-7), (name, rank)
            assert shared.tt_estimate(rank, 4, 32) == pytest.approx(want, rel=1e-6, abs=1e-9), (name, rank)


class Blocks(nn.Module):
    """Three repeated residual blocks (an nn.ModuleList), called with a keyword argument as transformers do."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x, scale=1.0):
        for block in self.layers:
            x = x + scale * block(x)
        return x


def test_output_scoring_replays_the_blocks_before_the_layer_and_gets_the_whole_pass_result():
    """A candidate in block k is scored with blocks 0..k-1 replayed from the reference pass: the same errors, bit
    for bit, as running the whole model, for a layer in every block; the model comes back with its own blocks."""
    from comera_fx.pretrained.format_output import OutputError

    model = Blocks().eval()
    gen = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(8, 32, generator=gen), "scale": 0.5} for _ in range(2)]
    blocks = list(model.layers)
    with torch.no_grad():
        replayed = OutputError(model, batches, None)
        whole = OutputError(model, batches, None)
        whole._before = {}
        assert replayed._before == {0: [], 1: [0], 2: [0, 1]}
        for k in range(3):
            for i in (0, 2):
                linear = model.layers[k][i]
                weight = fake_quant(linear.weight.detach(), 4, 32)
                assert replayed(linear, weight) == whole(linear, weight) > 0, (k, i)
                assert all(a is b for a, b in zip(model.layers, blocks))
        # against float64 forward passes, independently of the scorer
        linear = model.layers[1][2]
        weight = fake_quant(linear.weight.detach(), 4, 32)
        double = Blocks().double().eval()
        double.load_state_dict(model.state_dict())
        x = torch.cat([b["x"] for b in batches]).double()
        ref = double(x, 0.5)
        double.layers[1][2].weight.copy_(weight.double())
        want = float((double(x, 0.5) - ref).square().sum() / ref.square().sum())
        assert replayed(linear, weight) == pytest.approx(want, rel=1e-4)
