"""PackedLinear: int8 / int4 codes in memory (the fp32 weight rebuilt per call), checked against a float64 matmul on the
dequantized weights (``comera_fx.quantize.dequantize``), and kept packed through state_dict and save/load."""

import copy

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx.packed import PackedLinear, kernel_group, pack_linears_
from comera_fx.quantize import QuantSpec, dequantize, fake_quant, quantize_groups

CASES = [(8, 32), (8, 64), (8, None), (8, 384), (4, 32), (4, 64), (4, 128), (4, None), (4, 384)]


def reference(linear: nn.Linear, spec: QuantSpec, x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_groups(linear.weight.detach(), spec)
    weight = dequantize(codes, scales, spec, tuple(linear.weight.shape), torch.float64)
    return x.double() @ weight.t() + linear.bias.double()


@pytest.mark.parametrize("bits,group", CASES)
def test_packed_output_is_the_dequantized_weights_matmul(bits, group):
    torch.manual_seed(bits + (group or 0))
    linear = nn.Linear(128, 48)
    spec = QuantSpec(bits, group)
    packed = PackedLinear.from_linear(linear, spec)
    x = torch.randn(3, 5, 128)
    out = packed(x)
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out.double(), reference(linear, spec, x), rtol=0, atol=2e-5)
    assert torch.equal(packed.dequantized(), fake_quant(linear.weight.detach(), bits, group))
    assert packed.nbytes() <= 1.3 * spec.nbytes(linear.weight.numel())  # held as codes, not fp32


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_state_dict_round_trip_and_portable_form(bits, group):
    torch.manual_seed(1)
    linear = nn.Linear(64, 32)
    packed = PackedLinear.from_linear(linear, QuantSpec(bits, group))
    state = packed.state_dict()
    assert set(state) == {"weight", "weight_scales", "bias"}
    fresh = PackedLinear(64, 32, QuantSpec(bits, group))
    fresh.load_state_dict(state)
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), packed(x))
    with pytest.raises(RuntimeError, match="weight_scales"):
        PackedLinear(64, 32, QuantSpec(bits, group)).load_state_dict({"weight": state["weight"], "bias": state["bias"]})


def test_groups_without_a_kernel_layout_are_refused():
    with pytest.raises(ValueError, match="divides"):
        kernel_group(QuantSpec(8, 40), 32, 64)
    with pytest.raises(ValueError, match="odd"):
        kernel_group(QuantSpec(4, 33), 8, 33)


def build():
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40))


def test_pack_linears_and_save_load_keep_the_layers_packed(tmp_path):
    torch.manual_seed(2)
    model = build()
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="^0$")
    comera_fx.quantize_(model, 8, 64, dense_linears=True, include="^2$")
    comera_fx.quantize_(model, 4, 40, dense_linears=True, include="^4$")  # groups of 40 straddle 48-wide rows
    x = torch.randn(6, 128)
    expected = model(x).detach()
    comera_fx.save_tensorized(model, tmp_path / "fake.st")
    loaded = comera_fx.load_tensorized(tmp_path / "fake.st", build, pack=True)
    assert [type(m).__name__ for m in loaded] == ["PackedLinear", "ReLU", "PackedLinear", "ReLU", "Linear"]
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=1e-5)
    packed = copy.deepcopy(model)
    left = pack_linears_(packed)
    assert list(left) == ["4"] and "40" in left["4"]
    torch.testing.assert_close(packed(x), expected, rtol=0, atol=1e-5)
    comera_fx.save_tensorized(packed, tmp_path / "packed.st")
    again = comera_fx.load_tensorized(tmp_path / "packed.st", build)
    assert isinstance(again[0], PackedLinear) and isinstance(again[2], PackedLinear)
    assert torch.equal(again(x), packed(x))
    path = tmp_path / "whole.pt"
    torch.save(packed, path)
    assert torch.equal(torch.load(path, weights_only=False)(x), packed(x))


def test_export_carries_the_codes_not_fp32_weights():
    """comera_fx.export of a packed model: the program holds the int8 / uint8 codes (no fp32 weight of a packed
    layer), and matches eager."""
    from torch.export import Dim

    torch.manual_seed(3)
    model = build()
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="^0$")
    comera_fx.quantize_(model, 8, 64, dense_linears=True, include="^2$")
    pack_linears_(model)
    model.eval()
    program = comera_fx.export(model, (torch.randn(4, 128),), dynamic_shapes=({0: Dim("b", max=64)},))
    held = {**program.state_dict, **program.constants}
    assert held["0.codes"].dtype == torch.uint8 and held["2.codes"].dtype == torch.int8
    assert not any(v.is_floating_point() and v.numel() >= 64 * 48 for v in held.values())
    x = torch.randn(9, 128)
    assert torch.equal(program.module()(x), model(x))
