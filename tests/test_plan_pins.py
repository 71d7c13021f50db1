"""A deep copy of a TT model keeps its plan pins (the shared, immutable envelopes of its layout), so a copy
compiled before it ever ran eagerly traces no read of the global plan cache, which Dynamo would guard by its keys
(on torch 2.11 that guard failed when the cache changed). A checkpoint still drops them."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import comera_fx
from comera_fx.backend import make_backend
from comera_fx.tt import layers
from comera_fx.tt.layers import TTMatrix


def tt_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=6, min_numel=1))
    return model


def matrices(model):
    return [m for m in model.modules() if isinstance(m, TTMatrix)]


def test_a_deep_copy_shares_the_pins_and_a_checkpoint_drops_them():
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
    loaded = torch.load(buffer, weights_only=False)
    assert all(m._plan_pins == {} for m in matrices(loaded))


def test_a_compiled_copy_reads_only_its_pins(monkeypatch):
    model = tt_model()
    x = torch.randn(5, 64, dtype=torch.float64)
    model.double()
    expected = model(x).detach()  # an eager call pins the plans
    clone = copy.deepcopy(model)

    def refuse(*args, **kwargs):
        raise AssertionError("traced code read the global plan cache")

    monkeypatch.setattr(layers, "cached_envelope", refuse)
    torch._dynamo.reset()
    # fullgraph: a read of the global cache would reach ``refuse`` inside the trace and fail the compile, instead
    # of breaking the graph and running that part eagerly
    compiled = torch.compile(clone, backend=make_backend(inductor=False), fullgraph=True)
    got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got.detach(), expected, rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()


if __name__ == "__main__":
    pytest.main([__file__])
