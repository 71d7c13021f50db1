"""``TensorizeConfig(weight_space=True)``: a large weight read by an op with no TT rule is held in TT form and
rebuilt for those reads; off by default (it stays dense, the op named). References: the dense model (a deep copy
before conversion), float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx import RankAdaptive, BudgetConfig, TensorizeConfig

from helpers_models import Unsupported

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = TensorizeConfig(max_rank=10**6, min_numel=4096, weight_space=True)


class NormReader(nn.Module):
    """A linear whose weight is also read by ``norm`` (a weight-normalised output): one contracted use, one not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 96)

    def forward(self, x):
        return self.fc(x) / self.fc.weight.norm()


def test_off_by_default_the_op_is_named_with_the_switch():
    model = Unsupported()
    summary = comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096), example_inputs=(torch.randn(128, 128),))
    reason = {d.fqn: d.reason for d in summary.layers}["scale"]
    assert "mul" in reason and "weight_space=True" in reason
    assert isinstance(model.scale, nn.Parameter)


@pytest.mark.parametrize("model_fn", [Unsupported, NormReader])
def test_full_rank_is_exact_and_every_weight_is_converted(model_fn):
    torch.manual_seed(0)
    model = model_fn().double()
    dense = copy.deepcopy(model)
    x = torch.randn(128, 128, dtype=torch.float64)
    summary = comera_fx.tensorize_(model, FULL, example_inputs=(x,))
    assert not [d for d in summary.layers if not d.converted and "earlier" not in str(d.reason)]
    notes = [n for d in summary.converted for n in d.notes if n.startswith("weight-space")]
    assert notes and not any(
        isinstance(p, nn.Parameter) and p.dim() == 2 for p in model.parameters() if p.shape in ((128, 128), (96, 128))
    )
    torch.testing.assert_close(model(x), dense(x), rtol=1e-10, atol=1e-10)


def test_train_prune_save_load_compile_and_report():
    torch.manual_seed(0)
    model = Unsupported()
    x = torch.randn(128, 128)
    comera_fx.tensorize_(model, FULL.replace(max_rank=16), example_inputs=(x,))
    rows = {r.fqn for r in comera_fx.report(model).layers}
    assert {"scale", "left"} <= rows
    target = torch.randn(128, 128)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=6, prunes=1))
    before = comera_fx.report(model).tt_params
    for _ in range(6):
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        hook.observe(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert comera_fx.report(model).tt_params < before
    expected = model(x)

    fresh = Unsupported()
    comera_fx.tensorize_(fresh, FULL.replace(max_rank=16), example_inputs=(x,))
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)

    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager")
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_save_tensorized_round_trips_it(tmp_path):
    model = Unsupported()
    x = torch.randn(128, 128)
    comera_fx.tensorize_(model, FULL.replace(max_rank=16), example_inputs=(x,))
    path = tmp_path / "ws.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, Unsupported)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_the_switch_is_validated():
    with pytest.raises(ValueError, match="weight_space"):
        TensorizeConfig(weight_space="yes")


def test_the_graph_pass_feeds_the_rebuilt_weight_to_ops_without_a_tt_rule():
    torch.manual_seed(0)
    model = Unsupported().double()
    x = torch.randn(128, 128, dtype=torch.float64)
    expected = model(x)
    gm = comera_fx.passes.tensorize(torch.fx.symbolic_trace(model), FULL)
    decisions = {d.fqn: d for d in gm.meta["comera_fx"].layers}
    assert all(decisions[f].converted for f in ("scale", "left", "fc.weight"))
    assert not [n for n, p in gm.named_parameters() if p.dim() == 2 and ".cores." not in n]
    torch.testing.assert_close(gm(x), expected, rtol=1e-10, atol=1e-10)
    plain = comera_fx.passes.tensorize(torch.fx.symbolic_trace(Unsupported()), TensorizeConfig(min_numel=4096))
    assert "cannot contract" in {d.fqn: d for d in plain.meta["comera_fx"].layers}["scale"].reason
