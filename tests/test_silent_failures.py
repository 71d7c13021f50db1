"""Inputs that used to give a silently wrong or surprising result (issue 12), each pinned by a test.

Every test here failed before its fix. Numbers are checked against dense float64 computations or against the
model as it was before the call (a deep copy kept untouched), never against the code under test.
"""

import copy
import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig, TTLinear, TTMatrix
from comera_fx.passes.find import find_in_model as find
from comera_fx.tt import layers
from comera_fx.tt.layers import make_tt_matrix
from comera_fx.tt.layout import TTFormat


def dense_8x8(seed):
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_checkpoint_with_swapped_modes_is_refused_naming_layer_and_shapes(fmt):
    """Two 8×8 TT-matrices with modes (2,4)|(4,2) and (4,2)|(2,4): same number of cores, other modes. Loading one
    into the other used to say "All keys matched successfully" and then compute another matrix (max error 13)."""
    a = TTLinear(make_tt_matrix(dense_8x8(0), kind="linear", format=fmt, max_rank=100,
                                row_modes=(2, 4), col_modes=(4, 2)))
    b = TTLinear(make_tt_matrix(dense_8x8(1), kind="linear", format=fmt, max_rank=100,
                                row_modes=(4, 2), col_modes=(2, 4)))
    model, saved = nn.Sequential(a), nn.Sequential(b).state_dict()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(saved)
    message = str(info.value)
    assert "'0.tt'" in message  # the layer, by its prefix
    assert str([tuple(c.shape) for c in b.tt.cores]) in message and str([tuple(c.shape) for c in a.tt.cores]) in message
    with pytest.raises(RuntimeError, match="more than the rank axes"):
        model.load_state_dict(saved, strict=False)  # strict=False skips missing keys, never wrong shapes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_checkpoint_of_another_format_is_refused():
    tt = make_tt_matrix(dense_8x8(0), kind="linear", format=TTFormat.TT, max_rank=100, row_modes=(8,), col_modes=(8,))
    ttm = make_tt_matrix(dense_8x8(0), kind="linear", format=TTFormat.TTM, max_rank=100, row_modes=(2, 4),
                         col_modes=(4, 2))
    assert len(tt.cores) == len(ttm.cores)
    with pytest.raises(RuntimeError, match=r"'<root>'.*more than the rank axes"):
        tt.load_state_dict(ttm.state_dict())


def test_checkpoint_with_broken_rank_chain_is_refused():
    a = make_tt_matrix(dense_8x8(0), kind="linear", max_rank=100, row_modes=(2, 4), col_modes=(4, 2))
    state = a.state_dict()
    state["cores.1"] = state["cores.1"][:1]  # the bond between cores 0 and 1 no longer agrees
    with pytest.raises(RuntimeError, match="do not form a TT chain"):
        a.load_state_dict(state)


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_pruned_checkpoint_still_loads(fmt):
    """Only the rank axes differ: the checkpoint's ranks are adopted and the loaded matrix is the saved one."""
    pruned = make_tt_matrix(dense_8x8(0), kind="linear", format=fmt, max_rank=2, row_modes=(2, 4), col_modes=(4, 2))
    fresh = make_tt_matrix(dense_8x8(1), kind="linear", format=fmt, max_rank=100, row_modes=(2, 4), col_modes=(4, 2))
    assert pruned.ranks != fresh.ranks
    fresh.load_state_dict(pruned.state_dict())
    assert fresh.ranks == pruned.ranks
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.allclose(fresh.matmul(x), x @ pruned.dense(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ plan-envelope cache


def test_envelope_cache_is_bounded_lru_and_eviction_is_safe(monkeypatch):
    """Every pruned layout used to add an entry for good. Now at most ENVELOPE_CACHE_SIZE stay (least recently
    used first out); an evicted layout re-plans on its next eager call, and a region compiled while it is absent
    runs the fixed order — both still compute x @ M (checked against the dense float64 product)."""
    monkeypatch.setattr(layers, "_ENVELOPES", OrderedDict())
    monkeypatch.setattr(layers, "ENVELOPE_CACHE_SIZE", 3)
    x = torch.randn(5, 8, dtype=torch.float64)
    matrices = [make_tt_matrix(dense_8x8(seed), kind="linear", max_rank=rank, row_modes=(2, 4), col_modes=(4, 2))
                for seed, rank in enumerate((1, 2, 3, 4))]  # four ranks: four layouts
    for tt in matrices[:3]:
        tt.matmul(x)
    matrices[0].matmul(x)  # a hit: the first layout becomes the most recent
    matrices[3].matmul(x)  # a fourth layout evicts the least recent one, the second
    assert len(layers._ENVELOPES) == 3
    assert (matrices[1].layout, "matmul") not in layers._ENVELOPES
    assert (matrices[0].layout, "matmul") in layers._ENVELOPES

    evicted = matrices[1]
    compiled = torch.compile(evicted.matmul, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x @ evicted.dense().detach(), rtol=1e-12, atol=1e-12)
    assert (evicted.layout, "matmul") not in layers._ENVELOPES  # compiled code never plans
    torch.testing.assert_close(evicted.matmul(x), x @ evicted.dense().detach(), rtol=1e-12, atol=1e-12)
    assert (evicted.layout, "matmul") in layers._ENVELOPES and len(layers._ENVELOPES) == 3


# ------------------------------------------------------------------------------------------------------ capture


class NormDropNet(nn.Module):
    """BatchNorm (train mode: a forward updates running stats and num_batches_tracked) and dropout (consumes the
    global RNG) around two large linears, with a graph break so that Dynamo compiles the forward's own frames."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Dropout(0.5), nn.Linear(128, 64)

    def forward(self, x):
        h = self.drop(self.bn(self.fc1(x)))
        torch._dynamo.graph_break()
        return self.fc2(h.relu())


CAPTURE_CONFIG = TensorizeConfig(max_rank=8, min_numel=4096)


def test_capture_leaves_buffers_and_rng_state_as_they_were():
    torch.manual_seed(0)
    model = NormDropNet().train()
    x = torch.randn(16, 64)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    summary = comera_fx.tensorize_(model, CAPTURE_CONFIG, example_inputs=x)
    assert summary.method == "dynamo" and len(summary.converted) == 2
    for name, value in buffers.items():
        assert torch.equal(model.get_buffer(name), value), name
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert model.training


def _counting_backend():
    calls = []

    def backend(gm, inputs):
        calls.append([tuple(i.shape) if isinstance(i, torch.Tensor) else i for i in inputs])
        return gm.forward

    return backend, calls


def test_capture_leaves_no_dynamo_state_behind_for_the_users_compile():
    """Ten captures of models of one class used to leave ten cache entries on its forward: the user's own
    torch.compile of an eleventh then hit Dynamo's recompile limit and silently ran eagerly, and a compile at
    another batch size started with dynamic shapes (the capture's sizes were in the automatic-dynamic profile)."""
    for seed in range(10):
        torch.manual_seed(seed)
        find(NormDropNet(), torch.randn(16, 64))
    code = NormDropNet.forward.__code__
    assert torch._dynamo.eval_frame._get_total_cache_entry_count(code) == 0
    backend, calls = _counting_backend()
    model = NormDropNet().eval()
    torch.compile(model, backend=backend)(torch.randn(8, 64))
    assert len(calls) == 2  # the two graphs around the break were compiled, not skipped
    assert (8, 64) in calls[0]  # static: the batch size is a plain int, not a symbol


def test_capture_keeps_the_users_compiled_code():
    backend, calls = _counting_backend()
    model = NormDropNet().eval()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 64)
    compiled(x)
    compiled_once = len(calls)
    assert find(model, x).method == "dynamo"
    compiled(x)
    assert len(calls) == compiled_once  # no reset, no recompile
