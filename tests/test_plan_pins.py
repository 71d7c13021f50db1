"""A deep copy of a TT model keeps its plan pins (the shared, immutable envelopes of its layout), and a loaded one
(``torch.load`` of the module, ``comera_fx.load_tensorized``) plans its own, so a model compiled before it ever ran
eagerly traces no read of the global plan cache, which Dynamo would guard by its keys (on torch 2.11 that guard failed
when the cache changed)."""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import comera_fx
from comera_fx.backend import make_backend
from comera_fx.tt import layers, plan_cache
from comera_fx.tt.layers import TTLinear, TTMatrix


def tt_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=6, min_numel=1))
    return model


def matrices(model):
    return [m for m in model.modules() if isinstance(m, TTMatrix)]


def test_a_deep_copy_shares_the_pins_and_a_loaded_module_plans_its_own(monkeypatch):
    model = tt_model()
    model(torch.randn(3, 64)).sum().backward()
    clone = copy.deepcopy(model)
    for original, copied in zip(matrices(model), matrices(clone)):
        assert copied._plan_pins
        assert all(copied._plan_pins[op] is original._plan_pins[op] for op in original._plan_pins)
        assert copied._plan_pins is not original._plan_pins
        assert copied.cores[0] is not original.cores[0] and torch.equal(copied.cores[0], original.cores[0])
    buffer = io.BytesIO()
    torch.save(clone, buffer)
    buffer.seek(0)
    monkeypatch.setattr(plan_cache, "_ENVELOPES", OrderedDict())  # as in a fresh process: nothing planned yet
    loaded = torch.load(buffer, weights_only=False)
    for original, reloaded in zip(matrices(clone), matrices(loaded)):
        assert set(reloaded._plan_pins) == {"matmul", "matmul_t"}
        for op, envelope in reloaded._plan_pins.items():
            assert envelope is not original._plan_pins.get(op)  # planned afresh, not unpickled
            assert envelope.network.layout == reloaded.layout


def test_a_compiled_copy_reads_only_its_pins(monkeypatch):
    model = tt_model()
    x = torch.randn(5, 64, dtype=torch.float64)
    model.double()
    expected = model(x).detach()  # an eager call pins the plans
    clone = copy.deepcopy(model)
    got = _compiled_without_the_global_cache(clone, x, monkeypatch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def _compiled_without_the_global_cache(model, x, monkeypatch):
    """``model(x)`` (forward and backward) compiled with ``fullgraph=True`` while the global plan cache refuses
    every read: a read inside the trace fails the compile instead of breaking the graph and running eagerly."""

    def refuse(*args, **kwargs):
        raise AssertionError("traced code read the global plan cache")

    monkeypatch.setattr(layers, "cached_envelope", refuse)
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=make_backend(inductor=False), fullgraph=True)(x)
        out.sum().backward()
        return out.detach()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("load", ["torch.load", "load_tensorized"])
def test_a_loaded_model_compiles_before_any_eager_call(load, tmp_path, monkeypatch):
    model = tt_model().double()
    x = torch.randn(5, 64, dtype=torch.float64)
    with torch.no_grad():  # float64 reference: each TT layer as the dense matrix its cores make
        expected = x
        for layer in model:
            expected = F.linear(expected, layer.weight, layer.bias) if isinstance(layer, TTLinear) else layer(expected)
    if load == "torch.load":
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    else:
        comera_fx.save_tensorized(model, tmp_path / "model.safetensors")

        def build():
            torch.manual_seed(1)
            return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).double()

        loaded = comera_fx.load_tensorized(tmp_path / "model.safetensors", build)
    assert any(isinstance(layer, TTLinear) for layer in loaded)
    got = _compiled_without_the_global_cache(loaded, x, monkeypatch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


if __name__ == "__main__":
    pytest.main([__file__])
