"""The cached two-factor form of TT matrices for eager no-grad products (decoding): equal to the dense matrix,
rebuilt whenever the cores change, never used under autograd or a compiler, never saved."""

from __future__ import annotations

import copy

import torch
from torch import nn

import comera_fx
from comera_fx.runtime.shrink import shrink_
from comera_fx.tt import layers

FULL = comera_fx.TensorizeConfig(min_numel=1, min_dim=1, max_rank=None)


def tt_linear(seed=0, rows=48, cols=40):
    """A full-rank TT copy of a float64 nn.Linear, and the dense layer it equals."""
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(rows, cols)).double()
    model = copy.deepcopy(dense)
    assert comera_fx.tensorize_(model, FULL).converted
    return model, dense


def matrix_of(model):
    return next(m for m in model.modules() if isinstance(m, comera_fx.TTMatrix))


def test_no_grad_decode_uses_the_cache_and_equals_the_dense_layer():
    model, dense = tt_linear()
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
        first = matrix_of(model).__dict__.get("_merged")
        model(x)
        again = matrix_of(model).__dict__.get("_merged")
    assert first is not None and again is first, "the second call should reuse the cached factors"
    torch.testing.assert_close(y, dense(x).detach(), rtol=1e-10, atol=1e-10)


def test_tied_head_product_uses_the_cache_too():
    tt = matrix_of(tt_linear()[0])
    x = torch.randn(2, 40, dtype=torch.float64)
    reference = x @ tt.dense().detach().T  # the grad path builds M; the product below runs the cached factors
    with torch.no_grad():
        got = tt.matmul_t(x)
    assert "_merged" in tt.__dict__
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)


def test_an_optimizer_step_a_load_and_a_shrink_each_make_new_factors():
    model, _ = tt_linear()
    x = torch.randn(4, 48, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def assert_matches_the_planned_product():
        with torch.no_grad():
            got = model(x)
        expected = model(x).detach()  # grad enabled: the planned contraction, no cache
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)

    assert_matches_the_planned_product()
    model(x).pow(2).sum().backward()
    optimizer.step()
    assert_matches_the_planned_product()
    other, _ = tt_linear(seed=1)
    model.load_state_dict(other.state_dict())
    assert_matches_the_planned_product()
    tt = matrix_of(model)
    with torch.no_grad():
        tt.gates[0][0] = 0.0
    assert_matches_the_planned_product()  # a gate written in place
    assert shrink_(tt) is not None
    assert_matches_the_planned_product()


def test_grad_mode_large_batches_and_the_switch_leave_the_cache_alone(monkeypatch):
    model, dense = tt_linear()
    x = torch.randn(2, 48, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert "_merged" not in matrix_of(model).__dict__ and x.grad is not None
    with torch.no_grad():
        model(torch.randn(layers.MERGED_MAX_TOKENS + 1, 48, dtype=torch.float64))
    assert "_merged" not in matrix_of(model).__dict__
    monkeypatch.setattr(layers, "USE_MERGED_FORMS", False)
    with torch.no_grad():
        model(x)
    assert "_merged" not in matrix_of(model).__dict__


def test_the_cache_is_not_copied_saved_or_compiled(tmp_path):
    model, dense = tt_linear()
    x = torch.randn(2, 48, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    assert "_merged" in matrix_of(model).__dict__
    assert "_merged" not in matrix_of(copy.deepcopy(model)).__dict__
    assert not any("merged" in key for key in model.state_dict())
    torch.save(model, tmp_path / "m.pt")
    assert "_merged" not in matrix_of(torch.load(tmp_path / "m.pt", weights_only=False)).__dict__
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=comera_fx.make_backend(inductor=False))
    with torch.no_grad():
        y = compiled(x)
    torch.testing.assert_close(y, dense(x).detach(), rtol=1e-10, atol=1e-10)
    assert "_merged" not in matrix_of(compiled).__dict__, "compiled code must not build or read the cache"
    torch._dynamo.reset()
