"""Packed layers multiplying in bf16 / fp16 (``set_compute_dtype_``): the products of the stored weights to within
the low-precision rounding (checked against float64), only where the call has enough rows, and nothing else of the
model touched."""

import threading

import pytest
import torch
from test_packed import packed_tt_reference, tt_model
from torch import nn

import comera_fx
from comera_fx.packed import PackedLinear, PackedTTLinear, pack_linears_, set_compute_dtype_, workspace
from comera_fx.packed import compute as compute_module
from comera_fx.packed.linear import LOW_PRECISION_MIN_ROWS
from comera_fx.packed.tt import LOW_PRECISION_MIN_ROWS as TT_MIN_ROWS
from comera_fx.quantize import QuantSpec, dequantize, quantize_groups

#: Relative (Frobenius) error of a product whose input and output are rounded to bf16 (2^-9 each, relative): a few
#: times 2^-9 at most; what fp32 gives is ~1e-7, what a wrong scale or a dropped group gives is ~1.
BF16_TOLERANCE = 1e-2


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).norm() / expected.norm())


def linear_reference(linear: nn.Linear, spec: QuantSpec, x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_groups(linear.weight.detach(), spec)
    weight = dequantize(codes, scales, spec, tuple(linear.weight.shape), torch.float64)
    bias = 0 if linear.bias is None else linear.bias.detach().double()
    return x.double() @ weight.t() + bias


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, None), (4, 128), (4, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_in_low_precision_is_the_stored_weights_product(bits, group, dtype, bias):
    torch.manual_seed(bits + (group or 0))
    linear = nn.Linear(128, 96, bias=bias)
    spec = QuantSpec(bits, group)
    layer = PackedLinear.from_linear(linear, spec)
    layer.compute_dtype = dtype
    many = torch.randn(2, LOW_PRECISION_MIN_ROWS // 2 + 3, 128)  # enough rows: the GEMM in ``dtype``
    few = torch.randn(3, 5, 128)  # too few: fp32, exact
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            out = layer(many)
            assert out.dtype == torch.float32 and out.shape == (*many.shape[:-1], 96)
            error = relative_error(out, linear_reference(linear, spec, many))
            assert 1e-5 < error < BF16_TOLERANCE  # rounded (it ran in ``dtype``), and only that much
            torch.testing.assert_close(layer(few).double(), linear_reference(linear, spec, few), rtol=0, atol=2e-5)
    x = many.clone().requires_grad_()  # a call recording a gradient: the same product, and x gets its gradient
    out = layer(x)
    assert relative_error(out.detach(), linear_reference(linear, spec, many)) < BF16_TOLERANCE
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("bits,group", [(4, 32), (8, None)])
def test_low_precision_blocks_under_the_workspace_cap(bits, group, monkeypatch):
    """A weight over ``workspace.MAX_BYTES`` in ``dtype`` is rebuilt and multiplied a block of output rows at a
    time; the blocks' products line up as the whole one's."""
    monkeypatch.setattr(workspace, "_WORKSPACE", threading.local())
    cap = 128 * 2 * 23  # 23 bf16 rows of 128 inputs
    monkeypatch.setattr(workspace, "MAX_BYTES", cap)
    torch.manual_seed(5)
    linear = nn.Linear(128, 101)
    spec = QuantSpec(bits, group)
    layer = PackedLinear.from_linear(linear, spec)
    layer.compute_dtype = torch.bfloat16
    x = torch.randn(LOW_PRECISION_MIN_ROWS + 10, 128)
    with torch.inference_mode():
        error = relative_error(layer(x), linear_reference(linear, spec, x))
    assert 1e-5 < error < BF16_TOLERANCE
    assert 0 < workspace.workspace_bytes() <= cap


def test_packed_tt_in_low_precision_is_the_stored_cores_product():
    model = tt_model(7)
    comera_fx.quantize_(model, 4, 16)  # all cores on one grid, whole groups: the shared-workspace path
    for layer in (model[0], model[2]):
        packed = PackedTTLinear.from_tt_linear(layer)
        packed.compute_dtype = torch.bfloat16
        x = torch.randn(TT_MIN_ROWS + 6, packed.in_features)
        for mode in (torch.inference_mode, torch.enable_grad):
            with mode():
                out = packed(x)
            assert out.dtype == torch.float32
            assert 1e-5 < relative_error(out.detach(), packed_tt_reference(packed, x)) < BF16_TOLERANCE
        few = torch.randn(TT_MIN_ROWS - 1, packed.in_features)  # one row short of the floor: fp32, exact
        torch.testing.assert_close(packed(few).double(), packed_tt_reference(packed, few), rtol=0, atol=2e-5)


def small_packed_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))
    comera_fx.quantize_(model, 4, 32, dense_linears=True)
    assert not pack_linears_(model)
    return model


def test_set_compute_dtype_sets_the_packed_layers_only_and_is_not_saved(monkeypatch):
    model = small_packed_model()
    keys = set(model.state_dict())
    x = torch.randn(LOW_PRECISION_MIN_ROWS, 64)
    with torch.inference_mode():
        exact = model(x)
        assert set_compute_dtype_(model, torch.bfloat16) is torch.bfloat16
        assert [m.compute_dtype for m in model if isinstance(m, PackedLinear)] == [torch.bfloat16] * 2
        assert not hasattr(model[3], "compute_dtype")  # the rest of the model is not changed
        assert 1e-5 < relative_error(model(x), exact.double()) < BF16_TOLERANCE
        assert set(model.state_dict()) == keys  # a runtime choice, not state
        assert set_compute_dtype_(model, None) is None
        torch.testing.assert_close(model(x), exact, rtol=0, atol=0)
    monkeypatch.setattr(compute_module, "bf16_native", lambda: False)
    assert set_compute_dtype_(model, "auto") is None
    monkeypatch.setattr(compute_module, "bf16_native", lambda: True)
    assert set_compute_dtype_(model, "auto") is torch.bfloat16


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "bf16", 16])
def test_set_compute_dtype_refuses_what_it_cannot_run(bad):
    model = small_packed_model()
    with pytest.raises(ValueError, match='torch.bfloat16, torch.float16, None or "auto"'):
        set_compute_dtype_(model, bad)
    assert all(m.compute_dtype is None for m in model if isinstance(m, PackedLinear))


def test_set_compute_dtype_on_a_model_without_packed_layers_names_the_fix():
    with pytest.raises(ValueError, match="pack_linears_"):
        set_compute_dtype_(nn.Sequential(nn.Linear(4, 4)), torch.bfloat16)


def test_low_precision_traces_under_compile():
    model = small_packed_model()
    set_compute_dtype_(model, torch.bfloat16)
    x = torch.randn(LOW_PRECISION_MIN_ROWS, 64)
    with torch.inference_mode():
        expected = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-2, atol=1e-2)
