"""``randomize_backward_(model, example_inputs=...)`` on raw parameters read by the forward's own code (F.linear,
x @ W, addmm): forward, dX and bias gradients exact, weight gradients unbiased, undone by ``restore_backward_``.
Reference: the unmodified model under plain float64 autograd."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_fx


class RawParams(nn.Module):
    """Raw parameters read three ways: F.linear with a bias, ``h @ U`` (U stored in × out) and addmm (GPT-2's
    spelling: bias, 2-D input, weight in × out)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(24, 16, generator=g, dtype=torch.float64) / 4)
        self.b = nn.Parameter(torch.randn(24, generator=g, dtype=torch.float64))
        self.u = nn.Parameter(torch.randn(24, 12, generator=g, dtype=torch.float64) / 4)
        self.m = nn.Parameter(torch.randn(12, 8, generator=g, dtype=torch.float64) / 4)
        self.c = nn.Parameter(torch.randn(8, generator=g, dtype=torch.float64))

    def forward(self, x):
        h = F.gelu(F.linear(x, self.w, self.b))
        h = F.gelu(h @ self.u)
        return torch.addmm(self.c, h.reshape(-1, h.shape[-1]), self.m)


class Outer(nn.Module):
    """The parameters live in ``inner`` but ``Outer.forward`` reads ``inner.w`` itself."""

    def __init__(self):
        super().__init__()
        self.inner = RawParams()

    def forward(self, x):
        return F.linear(x, self.inner.w) + self.inner(x).sum()


WEIGHTS = ("w", "u", "m")


def _inputs(tokens: int = 12):
    """x, and an output gradient correlated with the output (so each weight gradient is large next to the
    estimator's spread, and a wrong scale shows)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = RawParams()(x)
    return x, y + 0.5 * torch.randn(y.shape, generator=g, dtype=torch.float64)


def _gradients(model: nn.Module, x, dy):
    x = x.clone().requires_grad_()
    y = model(x)
    grads = torch.autograd.grad(y, [x, *model.parameters()], dy)
    return y.detach(), dict(zip(["x", *(n for n, _ in model.named_parameters())], grads))


def _randomized(rho: float = 0.5, sketch: str = "gaussian"):
    reference = RawParams()
    model = copy.deepcopy(reference)
    summary = comera_fx.randomize_backward_(model, rho=rho, sketch=sketch, example_inputs=(_inputs()[0],), min_numel=0)
    return reference, model, summary


def _bias_in_standard_errors(samples, exact) -> float:
    """‖mean − exact‖² / (total variance / n): about 1 for an unbiased estimator, far larger for a biased one."""
    n = samples.shape[0]
    return float(((samples.mean(0) - exact) ** 2).sum()) / (float(samples.var(0).sum()) / n)


def test_every_raw_linear_use_is_randomized_and_reported():
    _, model, summary = _randomized()
    decisions = {d.fqn: d for d in summary.layers}
    assert {fqn for fqn, d in decisions.items() if d.randomized} == set(WEIGHTS)
    assert all(decisions[name].kind == "functional" for name in WEIGHTS)
    assert type(model).__name__ == "RandomizedUsesRawParams" and isinstance(model, RawParams)
    assert {r.fqn for r in comera_fx.report(model).randomized} == set(WEIGHTS)


@pytest.mark.parametrize("sketch", ("gaussian", "srht"))
def test_forward_input_and_bias_gradients_are_exact(sketch):
    reference, model, _ = _randomized(sketch=sketch)
    x, dy = _inputs()
    y_ref, exact = _gradients(reference, x, dy)
    torch.manual_seed(0)
    y, grads = _gradients(model, x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name in ("x", "b", "c"):
        torch.testing.assert_close(grads[name], exact[name], rtol=1e-12, atol=1e-12)
    assert not any(torch.allclose(grads[name], exact[name]) for name in WEIGHTS)  # the weights are sketched


def test_weight_gradients_are_unbiased_and_a_wrong_scale_is_caught(one_thread):
    reference, model, _ = _randomized(rho=0.5)
    x, dy = _inputs()
    _, exact = _gradients(reference, x, dy)
    torch.manual_seed(0)
    samples = {name: [] for name in WEIGHTS}
    for _ in range(600):
        _, grads = _gradients(model, x, dy)
        for name in WEIGHTS:
            samples[name].append(grads[name])
    for name in WEIGHTS:
        stacked = torch.stack(samples[name])
        assert _bias_in_standard_errors(stacked, exact[name]) < 4.0, name
        assert _bias_in_standard_errors(stacked * 1.1, exact[name]) > 4.0, name  # the check can fail


def test_restore_eval_and_no_grad_give_the_exact_gradients_back():
    reference, model, _ = _randomized()
    params, keys = list(model.parameters()), list(model.state_dict())
    x, dy = _inputs()
    _, exact = _gradients(reference, x, dy)
    model.eval()
    _, grads = _gradients(model, x, dy)  # eval mode: the user's forward as it was
    model.train()
    for name in WEIGHTS:
        torch.testing.assert_close(grads[name], exact[name], rtol=1e-12, atol=1e-12)
    assert comera_fx.restore_backward_(model) == 1
    assert type(model) is RawParams and not hasattr(model, "rmm") and not hasattr(model, "rmm_parameters")
    assert list(model.parameters()) == params and list(model.state_dict()) == keys
    _, grads = _gradients(model, x, dy)
    for name, grad in exact.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-12)


def test_the_module_whose_forward_reads_the_parameter_is_the_one_randomized():
    reference = Outer()
    model = copy.deepcopy(reference)
    x, _ = _inputs()
    summary = comera_fx.randomize_backward_(model, rho=0.5, example_inputs=(x,), min_numel=0)
    assert {d.fqn for d in summary.randomized} == {"inner." + name for name in WEIGHTS}
    assert sorted(model.rmm_parameters) == ["inner.w"]  # read in Outer.forward
    assert sorted(model.inner.rmm_parameters) == sorted(WEIGHTS)
    y_ref, y = reference(x), model(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    grad_w = torch.autograd.grad(model(x), model.inner.w, dy)[0]
    exact_w = torch.autograd.grad(reference(x), reference.inner.w, dy)[0]
    assert not torch.allclose(grad_w, exact_w)  # both of w's uses are sketched
    assert comera_fx.restore_backward_(model) == 2 and type(model) is Outer and type(model.inner) is RawParams


def test_filter_fn_and_frozen_weights_stay_exact_with_a_reason():
    model = RawParams()
    model.u.requires_grad_(False)
    summary = comera_fx.randomize_backward_(
        model, example_inputs=(_inputs()[0],), min_numel=0, filter_fn=lambda module, fqn: fqn != "m"
    )
    decisions = {d.fqn: d for d in summary.layers}
    assert decisions["w"].randomized and not decisions["u"].randomized and not decisions["m"].randomized
    assert "frozen" in decisions["u"].reason and "filter_fn" in decisions["m"].reason
    assert model.rmm_parameters == ("w",)


def test_randomized_uses_pickle_and_deepcopy():
    _, model, _ = _randomized()
    x, _ = _inputs()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert type(other) is type(model) and other.rmm == model.rmm and other.rmm_parameters == model.rmm_parameters
        torch.testing.assert_close(other(x), model(x))
