"""Expert calibration (``pretrained.expert_stats.calibrate_experts``): each expert's input statistics come from the
tokens routed to it, and the activation-aware TT-SVD they drive lowers the experts' output error on those tokens
at the parameters of plain TT-SVD. Reference: the dense experts modules on the calibration set's own inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.pretrained.expert_stats import calibrate_experts

transformers = pytest.importorskip("transformers")
from comera_fx.testing.moe_families import build, families  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = dict(families())
SIZES = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=128)


def holds_experts(module, path) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (4, 32), generator=generator) for _ in range(3)]


def experts_error(model, dense, recorded) -> float:
    """||converted experts(x) − dense experts(x)|| / ||dense experts(x)|| over the recorded experts calls."""
    num = den = 0.0
    with torch.no_grad():
        for path, calls in recorded.items():
            for args, kwargs in calls:
                y, r = model.get_submodule(path)(*args, **kwargs), dense.get_submodule(path)(*args, **kwargs)
                num, den = num + float((y - r).pow(2).sum()), den + float(r.pow(2).sum())
    return (num / den) ** 0.5


def record_experts_calls(dense, data):
    paths = [n for n, m in dense.named_modules() if holds_experts(m, n)]
    recorded = {p: [] for p in paths}
    handles = [
        dense.get_submodule(p).register_forward_hook(
            lambda m, a, k, o, p=p: recorded[p].append((a, k)), with_kwargs=True
        )
        for p in paths
    ]
    with torch.no_grad():
        for batch in data:
            dense(batch)
    for handle in handles:
        handle.remove()
    return recorded


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_statistics_count_the_routed_tokens_of_each_expert(family):
    model = build(family, FAMILIES[family], **SIZES)
    implementation = model.config._experts_implementation
    data = batches()
    calibration = calibrate_experts(model, data)
    assert model.config._experts_implementation == implementation  # the eager loop only during calibration
    tokens = sum(b.numel() for b in data)
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts.down_proj."
        counts = [calibration[n].tokens for n in calibration if n.startswith(prefix)]
        assert sum(counts) == tokens * model.config.num_experts_per_tok  # every (token, slot) pair once


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_calibrated_experts_err_less_than_plain_tt_svd_at_equal_parameters(family):
    dense = build(family, FAMILIES[family], **SIZES)
    data = batches()
    recorded = record_experts_calls(dense, data)
    calibration = calibrate_experts(dense, data)
    config = TensorizeConfig(max_rank=8, min_numel=0, min_dim=1)
    errors, params = {}, {}
    for name, stats in (("plain", None), ("calibrated", calibration)):
        model = copy.deepcopy(dense)
        summary = comera_fx.tensorize_(model, config, filter_fn=holds_experts, calibration=stats)
        params[name] = sum(d.params for d in summary.converted)
        errors[name] = experts_error(model, dense, recorded)
        if stats is not None:
            assert all(any(n.startswith("activation-aware") for n in d.notes) for d in summary.converted)
    assert params["calibrated"] == params["plain"]
    assert errors["calibrated"] < 0.97 * errors["plain"]
