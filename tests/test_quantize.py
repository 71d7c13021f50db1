"""comera_fx.quantize_ and quantized weights in save_tensorized / load_tensorized: grids checked against a float64
reference computed here, round trips bit for bit, bytes by hand and in the file."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.quantize import (
    CLIP_RATIOS,
    QuantSpec,
    clipped_scales,
    dequantize,
    fake_quant,
    pack,
    quantize_groups,
    quantized_specs,
    requantize_,
    stored_bytes,
    unpack,
)
from comera_fx.tt.layers import TTMatrix

from helpers_models import Big, Mixed, TiedLM


def reference_grid(weight: torch.Tensor, bits: int, group_size: int | None):
    """(float64 groups of the weight, float64 scale per group) computed independently of comera_fx."""
    flat = weight.detach().double().reshape(-1)
    size = flat.numel() if group_size is None else group_size
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % size)])
    groups = flat.reshape(-1, size)
    return groups, groups.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 300),
    bits=st.sampled_from([3, 4, 8]),
    group=st.sampled_from([None, 1, 7, 64]),
    magnitude=st.floats(-6, 3),
    seed=st.integers(0, 2**16),
)
def test_grid_error_bound_codes_and_exact_requantization(numel, bits, group, magnitude, seed):
    """Every value moves by at most half its group's scale (float64 reference), codes lie in [-qmax, qmax], int4
    and int3 codes survive packing (int3: 3 bits a code), and quantizing a quantized tensor again (what a save after
    ``quantize_`` does) gives back exactly the same values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=gen) * 10.0**magnitude
    spec = QuantSpec(bits, group)
    codes, scales = quantize_groups(w, spec)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= spec.qmax
    assert scales.numel() == spec.groups(numel)
    q = dequantize(codes, scales, spec, w.shape, w.dtype)
    groups, scale = reference_grid(w, bits, group)
    err = (
        torch.cat([q.double(), q.new_zeros(groups.numel() - numel, dtype=torch.float64)]).reshape(groups.shape) - groups
    ).abs()
    assert bool((err <= scale / 2 * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(unpack(pack(codes, bits), bits, numel), codes)
    assert pack(codes, bits).numel() == math.ceil(numel * bits / 8)  # what QuantSpec.nbytes counts
    again, again_scales = quantize_groups(q, spec)
    assert torch.equal(dequantize(again, again_scales, spec, q.shape, q.dtype), q)


def test_int4_packs_two_codes_per_byte():
    codes = torch.tensor([-7, 7, 0, -1, 3], dtype=torch.int8)
    stored = pack(codes, 4)
    assert stored.dtype == torch.uint8 and stored.numel() == 3
    assert stored.tolist() == [(1) | (15 << 4), (8) | (7 << 4), 11 | (8 << 4)]


def test_int3_packs_eight_codes_in_three_bytes():
    """code + 4 in 3-bit fields of a little-endian 24-bit word, the first code lowest; a partial last word is
    filled with code 0 (field 4) and cut after the last byte holding a code."""
    codes = torch.tensor([-3, 3, 0, -1, 1, 2, -2, 0, 3], dtype=torch.int8)
    stored = pack(codes, 3)
    fields = [c + 4 for c in codes.tolist()] + [4] * 7
    words = [sum(f << (3 * i) for i, f in enumerate(fields[k : k + 8])) for k in (0, 8)]
    expected = [(w >> shift) & 0xFF for w in words for shift in (0, 8, 16)][:4]  # 27 bits: 4 bytes
    assert stored.dtype == torch.uint8 and stored.tolist() == expected
    assert torch.equal(unpack(stored, 3, 9), codes)
    assert QuantSpec(3, 64).nbytes(128) == 48 + 2 * 4


def tensorized_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 64))
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=1, min_dim=1, skip=[r"^3\b"]))
    return model


def test_quantize_rounds_cores_in_place_and_touches_nothing_else():
    """TT cores land on the grid (float64 reference, groups of 16); gates, biases and the dense layer left out are
    untouched; the parameter objects and their requires_grad stay, so an optimizer built before keeps working."""
    model = tensorized_mlp()
    model[2].tt.cores[0].requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    summary = comera_fx.quantize_(model, bits=4, group_size=16)
    assert dict(model.named_parameters()) == params
    assert not model[2].tt.cores[0].requires_grad
    cores = {n for n in before if ".cores." in n}
    assert set(summary.quantized) == cores and len(cores) == 8
    for name, p in model.named_parameters():
        if name not in cores:
            assert torch.equal(p, before[name]), name
            continue
        groups, scale = reference_grid(before[name], 4, 16)
        moved = torch.cat([p.detach().double().reshape(-1), groups.new_zeros(groups.numel() - p.numel())]).reshape(
            groups.shape
        )
        steps = moved / torch.where(scale > 0, scale, 1)
        assert bool(((moved - groups).abs() <= scale / 2 * (1 + 1e-5)).all())
        assert torch.allclose(steps, steps.round(), atol=1e-4), name
    assert summary.bytes_after == sum(QuantSpec(4, 16).nbytes(params[n].numel()) for n in cores)
    assert summary.bytes_before == sum(4 * params[n].numel() for n in cores)


def test_stored_bytes_by_hand():
    """int8 groups of 64: a (1, 64, 8) core is 512 + 8 * 4 bytes; the dense (64, 64) weight stays fp32."""
    model = tensorized_mlp()
    dense = 64 * 64 * 4
    fp32 = stored_bytes(model)
    comera_fx.quantize_(model)
    cores = [p for m in model.modules() if isinstance(m, TTMatrix) for p in m.cores]
    assert fp32 == dense + sum(4 * c.numel() for c in cores)
    assert stored_bytes(model) == dense + sum(c.numel() + 4 * math.ceil(c.numel() / 64) for c in cores)
    comera_fx.quantize_(model, 8, None, dense_linears=True, include=r"^3$")
    assert stored_bytes(model, "3.") == 64 * 64 + 4


@pytest.mark.parametrize("model_cls", [Big, TiedLM, Mixed])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (3, 64)])
def test_save_load_keeps_quantized_weights_bit_for_bit_in_a_smaller_file(tmp_path, model_cls, bits, group):
    torch.manual_seed(0)
    model = model_cls()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=10_000))
    float_path, quant_path = tmp_path / "f.safetensors", tmp_path / "q.safetensors"
    comera_fx.save_tensorized(model, float_path)
    comera_fx.quantize_(model, bits, group)
    manifest = comera_fx.save_tensorized(model, quant_path)
    assert manifest["quantized"] and all(e["bits"] == bits for e in manifest["quantized"].values())
    loaded = comera_fx.load_tensorized(quant_path, model_cls)
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert quantized_specs(loaded) == quantized_specs(model)
    ids = torch.randint(0, 300, (3, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    cores = [p for n, p in model.named_parameters() if ".cores." in n]
    fewer = sum(4 * c.numel() - QuantSpec(bits, group).nbytes(c.numel()) for c in cores)
    saved = float_path.stat().st_size - quant_path.stat().st_size
    assert fewer - 400 * len(cores) <= saved <= fewer  # the cores' bytes left the file (headers: < 400 B a core)
    again = tmp_path / "again.safetensors"
    comera_fx.save_tensorized(loaded, again)  # the grids were restored: a re-save stays quantized
    assert again.stat().st_size == quant_path.stat().st_size


def test_a_weight_trained_off_its_grid_is_quantized_again_when_saved(tmp_path):
    model = tensorized_mlp()
    comera_fx.quantize_(model, 8, 64, dense_linears=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    path = tmp_path / "m.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(
        path, lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 64))
    )
    for name, p in model.named_parameters():
        want = fake_quant(p.detach(), 8, 64) if p.dim() >= 2 else p.detach()
        assert torch.equal(loaded.get_parameter(name).detach(), want), name
    assert requantize_(model) == 9  # eight cores and the dense weight: what the save stored, in memory too
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), loaded.get_parameter(name).detach()), name
        assert torch.equal(p.detach(), trained[name]) == (p.dim() < 2), name


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="tensorize_ the model first"):
        comera_fx.quantize_(nn.Sequential(nn.Linear(8, 8)))
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4, 3\)"):
        comera_fx.quantize_(tensorized_mlp(), bits=2)
    with pytest.raises(ValueError, match="group_size"):
        comera_fx.quantize_(tensorized_mlp(), group_size=0)
    with pytest.raises(ValueError, match="matching 'nothing'"):
        comera_fx.quantize_(tensorized_mlp(), include="nothing")


def rounded_reference(weight: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """The weight rounded onto its grid, float64, from ``reference_grid`` (round half to even, as torch.round)."""
    groups, scale = reference_grid(weight, bits, group_size)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(groups / scale) * scale).reshape(-1)[: weight.numel()].reshape(weight.shape)


def off_grid_student(bits: int = 4, group: int = 16) -> nn.Module:
    """A linear quantized with ``quantize_`` whose weight then moved off its grid (as float training moves it)."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))
    comera_fx.quantize_(student, bits, group, dense_linears=True, include=r"^0$")
    with torch.no_grad():
        student[0].weight.add_(0.05 * torch.randn_like(student[0].weight))
    return student


def test_on_grid_rounds_inside_and_restores_the_float_weights_after():
    student = off_grid_student()
    floats = {name: p.detach().clone() for name, p in student.named_parameters()}
    x = torch.randn(5, 16)
    with comera_fx.quantize.on_grid(student) as rounded:
        assert rounded == 1
        torch.testing.assert_close(
            student[0].weight.double(), rounded_reference(floats["0.weight"], 4, 16), rtol=0, atol=1e-6
        )
        for name in ("2.weight", "2.bias"):  # not quantized: untouched
            assert torch.equal(dict(student.named_parameters())[name], floats[name])
        student(x).sum().backward()
    for name, p in student.named_parameters():
        assert torch.equal(p, floats[name]), name
        assert p.grad is not None
    assert not torch.equal(student[0].weight, rounded_reference(floats["0.weight"], 4, 16).float())


def test_quant_aware_distillation_steps_with_the_gradient_taken_on_the_grid():
    """One AdamW step (first step: update = -lr' · g / (|g| + eps), the sign of g) of a student whose weight is off
    its int4 grid: with quant_aware, and by default (None: the whole run for a quantized student), the float weight
    moves against the gradient at the *rounded* weight (float64 reference), which differs in sign from the gradient
    at the float weight for some entries; with quant_aware=0, against the latter."""
    from comera_fx.pretrained import DistillConfig, match_teacher

    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(64, 16)

    def reference_gradient(weight64: torch.Tensor, student: nn.Module) -> torch.Tensor:
        w = weight64.clone().requires_grad_(True)
        second = student[2]
        out = torch.tanh(x.double() @ w.T) @ second.weight.double().T + second.bias.double()
        target = teacher(x).double().detach()
        ((out - target) ** 2).sum().backward()
        return w.grad

    signs = {}
    for quant_aware in (None, 1.0, 0.0):
        student = off_grid_student()
        before = student[0].weight.detach().clone()
        at_grid = reference_gradient(rounded_reference(before, 4, 16), student)
        at_float = reference_gradient(before.double(), student)
        match_teacher(
            student,
            teacher,
            [x],
            steps=1,
            budget_seconds=None,
            config=DistillConfig(
                progress=False, lr=1e-2, loss_fn=lambda s, t: ((s - t) ** 2).sum(), quant_aware=quant_aware
            ),
        )
        moved = (before - student[0].weight.detach()).double()
        expected = at_float if quant_aware == 0.0 else at_grid
        clear = expected.abs() > 1e-6
        assert torch.equal(moved[clear].sign(), expected[clear].sign()), quant_aware
        signs[quant_aware] = (at_grid.sign() != at_float.sign()).sum().item()
    assert signs[1.0] > 0, "the test needs entries whose gradient sign differs between the grid and the float weight"


def test_quant_aware_defaults_to_the_whole_run_only_for_quantized_students():
    from comera_fx.pretrained import DistillConfig
    from comera_fx.pretrained.distill_config import resolved

    teacher = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))
    assert resolved(DistillConfig(), off_grid_student(), teacher).quant_aware == 1.0
    assert resolved(DistillConfig(), teacher, teacher).quant_aware == 0.0
    assert resolved(DistillConfig(quant_aware=0.1), off_grid_student(), teacher).quant_aware == 0.1


def test_quant_aware_refusals_name_the_fix():
    from comera_fx.pretrained import DistillConfig, match_teacher

    teacher = nn.Linear(4, 4)
    x = [torch.randn(2, 4)]
    with pytest.raises(ValueError, match="quantize_ or comera_fx.apply_formats_"):
        match_teacher(
            nn.Linear(4, 4),
            teacher,
            x,
            steps=1,
            budget_seconds=None,
            config=DistillConfig(progress=False, quant_aware=0.5),
        )
    for bad in (1.5, -0.1, True, "0.3"):
        with pytest.raises(ValueError, match="quant_aware must be a fraction"):
            match_teacher(
                off_grid_student(),
                teacher,
                x,
                steps=1,
                budget_seconds=None,
                config=DistillConfig(progress=False, quant_aware=bad),
            )


def reference_clipped_scales(weight: torch.Tensor, importance: torch.Tensor, bits: int, group: int, ratios):
    """Per group, the scale among ratio · max|w| / qmax minimizing Σ importance · (w - q(w))², searched in float64
    one group at a time (first ratio wins ties)."""
    qmax = 2 ** (bits - 1) - 1
    w = weight.double().reshape(-1, group)
    imp = importance.double().expand(weight.shape).reshape(-1, group)
    found = []
    for row, row_imp in zip(w, imp):
        best = None
        for ratio in ratios:
            scale = float(row.abs().max()) * ratio / qmax or 1.0
            q = torch.clamp(torch.round(row / scale), -qmax, qmax) * scale
            error = float(((q - row) ** 2 * row_imp).sum())
            if best is None or error < best[0] * (1 - 1e-9):
                best = (error, scale)
        found.append(best)
    return torch.tensor([s for _, s in found], dtype=torch.float64), torch.tensor([e for e, _ in found])


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([3, 4, 8]), group=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**16))
def test_importance_searches_each_groups_scale_and_the_result_stays_on_a_max_grid(bits, group, seed):
    """With per-input importance, each group's scale is the float64 brute-force search's (same ratios), its
    weighted error is never above max|w| scaling's, and rounding the result again by max|w| (a save, a pack,
    ``requantize_``) keeps it bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    # heavy tails (a normal over a uniform), drawn from the example's own generator: clipping pays
    weight = torch.randn(12, 32, generator=gen) / torch.rand(12, 32, generator=gen).clamp_min(0.05) * 0.05
    importance = torch.rand(32, generator=gen) ** 2 * 4
    codes, scales = quantize_groups(weight, QuantSpec(bits, group), importance)
    ref_scales, ref_errors = reference_clipped_scales(weight, importance, bits, group, CLIP_RATIOS)
    assert torch.allclose(scales.double(), ref_scales, rtol=1e-5)
    q = dequantize(codes, scales, QuantSpec(bits, group), weight.shape, torch.float32)
    _, plain_errors = reference_clipped_scales(weight, importance, bits, group, (1.0,))
    assert bool((ref_errors <= plain_errors * (1 + 1e-9)).all())
    assert torch.equal(fake_quant(q, bits, group), q)
    assert torch.equal(fake_quant(q, bits, group, importance), q)


def test_importance_lowers_the_calibrated_error_of_a_heavy_tailed_layer():
    """On a layer with outlier weights and uneven input scales, searched scales give a lower tr(Eᵀ C E) than
    max|w| scales (C: the float64 input second moment, computed here)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(torch.distributions.StudentT(2.5).sample((48, 64)) * 0.05)
    x = torch.randn(512, 64) * torch.linspace(0.1, 3.0, 64)
    gram = (x.double().T @ x.double()) / x.shape[0]

    def error(model):
        e = (model[0].weight.detach().double() - layer.weight.detach().double()).T
        return float((e * (gram @ e)).sum())

    plain = nn.Sequential(nn.Linear(64, 48))
    searched = nn.Sequential(nn.Linear(64, 48))
    for m in (plain, searched):
        m.load_state_dict(nn.Sequential(layer).state_dict())
    comera_fx.quantize_(plain, 4, 64, dense_linears=True)
    comera_fx.quantize_(searched, 4, 64, dense_linears=True, importance=gram.diagonal().float())
    assert error(searched) < 0.9 * error(plain)


def test_importance_refusals_name_the_fix_before_any_weight_changes():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="dense_linears=True"):
        comera_fx.quantize_(model, 4, 4, importance=torch.ones(8))
    with pytest.raises(ValueError, match="one weight per input feature"):
        comera_fx.quantize_(model, 4, 4, dense_linears=True, importance=torch.ones(8))  # layer 1 has 4 inputs
    with pytest.raises(ValueError, match="non-negative"):
        comera_fx.quantize_(model, 4, 4, dense_linears=True, include=r"^0$", importance=-torch.ones(8))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        clipped_scales(torch.randn(2, 4), torch.ones(2, 4), 7, ratios=(1.0, 1.1))
