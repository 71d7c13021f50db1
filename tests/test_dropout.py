"""``passes.fast_dropout``: dropout masks from bulk random words (the backend's default on CPU graphs).

References: the dense float64 computation the dropout is applied to (kept values are exactly ``scale`` times it,
the input gradient is the dense gradient through the same mask), binomial bounds for the keep rate of every lane
and of lane pairs (independence), and eager ``F.dropout`` for what the pass must leave alone.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.passes import fast_dropout
from comera_fx.passes.dropout import dropout_from_words, lane_threshold, rounded_drop_rate

FULL = TensorizeConfig(min_numel=1024, min_dim=16, max_rank=None)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def within_binomial(count: int, trials: int, prob: float, sigmas: float = 6.0) -> bool:
    return abs(count - trials * prob) <= sigmas * math.sqrt(trials * prob * (1 - prob))


def test_rates_and_thresholds():
    assert rounded_drop_rate(0.1) == 6554 / 65536
    assert lane_threshold(0.1) == -32768 + 6554
    assert lane_threshold(0.5) == 0
    assert abs(rounded_drop_rate(0.3) - 0.3) <= 2**-17


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_rate_lanes_and_scale(p):
    """Kept values are x * 1/(1-p') exactly, dropped ones 0; every one of the four lanes of a word, and pairs of
    neighbouring lanes, keep at the rates independent draws would (6 sigma)."""
    torch.manual_seed(0)
    x = torch.rand(1 << 20, dtype=torch.float64) + 0.5  # no zeros: the output's zeros are the dropped elements
    scale = 1 / (1 - rounded_drop_rate(p))
    y = dropout_from_words(x, lane_threshold(p), scale)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] * scale, rtol=0, atol=0)
    keep = 1 - rounded_drop_rate(p)
    assert within_binomial(int(kept.sum()), kept.numel(), keep)
    lanes = kept.view(-1, 4)
    for lane in range(4):
        assert within_binomial(int(lanes[:, lane].sum()), lanes.shape[0], keep), lane
    for a, b in ((0, 1), (1, 2), (3, 0)):  # (3, 0): the last lane of a word and the first lane of the next
        first = lanes[:, a] if b else lanes[:-1, a]
        second = lanes[:, b] if b else lanes[1:, b]
        assert within_binomial(int((first & second).sum()), first.numel(), keep * keep), (a, b)
    # the expectation is the input: mean of y / x over 2**20 draws within 6 sigma of 1
    ratio = (y / x).mean().item()
    assert abs(ratio - 1) <= 6 * math.sqrt(rounded_drop_rate(p) / keep / x.numel())


def test_gradient_is_the_same_mask_and_scale():
    x = torch.randn(37, 11, dtype=torch.float64, requires_grad=True)  # numel not a multiple of 4
    dy = torch.randn(37, 11, dtype=torch.float64)
    y = dropout_from_words(x, lane_threshold(0.25), 1 / 0.75)
    y.backward(dy)
    kept = (y != 0).to(torch.float64)
    torch.testing.assert_close(x.grad, kept * dy / 0.75, rtol=1e-15, atol=0)


def test_manual_seed_reproduces_the_masks():
    x = torch.ones(4096)
    masks = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        masks.append(dropout_from_words(x, lane_threshold(0.5), 2.0) != 0)
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], masks[2])


class Sites(nn.Module):
    """Dropout as graphs spell it: F.dropout by position and by keyword, torch.dropout; and the ones left alone."""

    def forward(self, x, rate):
        a = F.dropout(x, 0.2, True)
        b = F.dropout(x, p=0.3)  # training defaults to True in the functional form
        c = torch.dropout(x, 0.4, True)
        left = (
            F.dropout(x, 0.2, training=False)
            + F.dropout(x.clone(), 0.2, True, True)
            + F.dropout(x, 1.0, True)
            + torch.dropout(x, rate, True)
        )
        return a, b, c, left


def test_pass_rewrites_training_dropouts_only():
    gm = fx.symbolic_trace(Sites())
    gm = fast_dropout(gm)
    assert gm.meta["comera_fx_dropouts_rewritten"] == 3
    rewritten = [n for n in gm.graph.nodes if n.target is dropout_from_words]
    assert sorted(n.args[1] for n in rewritten) == sorted(lane_threshold(p) for p in (0.2, 0.3, 0.4))
    remaining = [n for n in gm.graph.nodes if n.target in (F.dropout, torch.dropout)]
    assert len(remaining) == 4  # eval mode, in place, rate 1, and a rate that is a graph input
    torch.manual_seed(0)
    x = torch.rand(64, 64) + 0.5
    a, b, c, _ = gm(x, 0.5)
    for y, p in ((a, 0.2), (b, 0.3), (c, 0.4)):
        kept = y != 0
        torch.testing.assert_close(y[kept], x[kept] / (1 - rounded_drop_rate(p)))
        assert within_binomial(int(kept.sum()), kept.numel(), 1 - rounded_drop_rate(p))


def test_pass_leaves_a_graph_without_dropout_untouched():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    code = gm.code
    assert fast_dropout(gm).code == code
    assert gm.meta["comera_fx_dropouts_rewritten"] == 0


class LinearDropout(nn.Module):
    def __init__(self, p=0.25):
        super().__init__()
        self.fc = nn.Linear(64, 48)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc(x))


def check_against_dense(compiled, dense, x, p):
    """Compiled TT output = dense float64 output through the mask read off the compiled output; input gradient =
    the dense gradient through that mask."""
    x = x.detach().clone().requires_grad_(True)
    y = compiled(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    with torch.no_grad():
        z = dense.fc(x)
    kept = (y != 0).to(x.dtype)
    scale = 1 / (1 - rounded_drop_rate(p))
    torch.testing.assert_close(y.detach(), kept * z * scale, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(x.grad, (kept * dy * scale) @ dense.fc.weight, rtol=1e-9, atol=1e-10)
    assert within_binomial(int(kept.sum()), kept.numel(), 1 - rounded_drop_rate(p))


def _tt_copy(dense, x):
    model = copy.deepcopy(dense)
    assert comera_fx.tensorize_(model, FULL, example_inputs=(x,)).converted
    return model


def test_backend_draws_dropout_from_words_on_cpu():
    """Through the backend (AOTAutograd graphs run as they are): the dropout is rewritten, the forward graph has no
    aten dropout or Bernoulli draw left, values and gradients match dense float64 through the drawn mask, also at
    a second batch size under dynamic shapes; ``fast_dropout=False`` keeps aten's dropout."""
    torch.manual_seed(0)
    dense = LinearDropout().double().train()
    x = torch.randn(32, 64, dtype=torch.float64)
    model = _tt_copy(dense, x)
    forward_ops = []

    def record(gm, is_backward):
        if not is_backward:
            forward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    backend = comera_fx.make_backend(inductor=False, warn_dense=False, post_aot_passes=(record,))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    check_against_dense(compiled, dense, x, 0.25)
    check_against_dense(compiled, dense, torch.randn(24, 64, dtype=torch.float64), 0.25)
    assert backend.stats.dropouts_rewritten == backend.stats.graphs >= 1
    assert forward_ops and not any("dropout" in op or "bernoulli" in op for op in forward_ops)
    assert any("randint" in op for op in forward_ops)

    torch._dynamo.reset()
    forward_ops.clear()
    exact = comera_fx.make_backend(inductor=False, warn_dense=False, fast_dropout=False, post_aot_passes=(record,))
    torch.compile(model, backend=exact)(x).sum().backward()
    assert exact.stats.dropouts_rewritten == 0
    assert any("dropout" in op or "bernoulli" in op for op in forward_ops)


def test_eval_mode_graph_keeps_no_dropout():
    torch.manual_seed(0)
    dense = LinearDropout().double().eval()
    x = torch.randn(8, 64, dtype=torch.float64)
    model = _tt_copy(dense, x).eval()
    backend = comera_fx.make_backend(inductor=False, warn_dense=False)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), dense(x), rtol=1e-9, atol=1e-10)
    assert backend.stats.dropouts_rewritten == 0


def test_inductor_lowers_the_word_dropout():
    """One Inductor compile (C++ on CPU) of the default backend: the same checks as above."""
    torch.manual_seed(0)
    dense = LinearDropout(p=0.1).double().train()
    x = torch.randn(16, 64, dtype=torch.float64)
    backend = comera_fx.make_backend(warn_dense=False)
    compiled = torch.compile(_tt_copy(dense, x), backend=backend)
    for seed in (1, 2):  # the first call compiles; the second runs the compiled code only
        torch.manual_seed(seed)
        check_against_dense(compiled, dense, x, 0.1)
    assert backend.stats.dropouts_rewritten == 1
