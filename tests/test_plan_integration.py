"""The planner drives every execution path: eager TT modules, the graph pass, and torch.compile with dynamic shapes.

References are dense float64 products; the planner's own envelope is only used to know which plan to expect.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import comera_fx
from comera_fx import TensorizeConfig, TTLinear
from comera_fx.tt.plan_cache import choose_plan, planned_envelope


def _dense_and_tt(d_in=96, d_out=80, rank=6):
    torch.manual_seed(0)
    dense = torch.nn.Linear(d_in, d_out).double()
    return dense, TTLinear.from_dense(dense, max_rank=rank)


def test_eager_module_runs_the_plan_of_each_batch_interval(monkeypatch):
    _, tt = _dense_and_tt()
    envelope = comera_fx.plan(tt)
    assert len(envelope.pieces) >= 2, "this layer should switch plans between small and large batches"
    used = []
    for name in ("execute", "execute_function"):  # plain autograd, or the custom autograd.Function
        real = getattr(comera_fx.tt.plan, name)
        monkeypatch.setattr(comera_fx.tt.plan, name, lambda p, *a, real=real: used.append(p) or real(p, *a))
    reference = tt.tt.dense().detach()  # M = Wᵀ, built once: the independent dense product
    for piece in envelope.pieces:
        batch = piece.first
        x = torch.randn(batch, 96, dtype=torch.float64)
        torch.testing.assert_close(tt(x), x @ reference + tt.bias, rtol=1e-10, atol=1e-12)
        assert used[-1] == piece.plan


def test_plan_of_tied_head_is_the_transposed_product():
    emb = torch.nn.Embedding(300, 64).double()
    tt_emb = comera_fx.TTEmbedding.from_dense(emb, max_rank=10**9)
    head = TTLinear(tt_emb.tt, transposed=True)
    assert comera_fx.plan(head).network.op == "matmul_t"
    x = torch.randn(7, 64, dtype=torch.float64)
    torch.testing.assert_close(head(x), x @ emb.weight.t(), rtol=1e-10, atol=1e-12)


def _batch_sizes_crossing(envelope, top=4096):
    """1..128 densely, then a stride up to ``top``, plus both sides of every breakpoint.

    Not all 4096 sizes: each compiled call costs guard evaluation on a shared 2-core machine; the sizes that can
    trigger a recompile are the breakpoints' neighbours and the 0/1 specialisation, all included here.
    """
    sizes = set(range(1, 129)) | set(range(129, top + 1, 61)) | {top}
    for piece in envelope.pieces:
        sizes |= {max(1, piece.first - 1), piece.first, piece.first + 1}
    return sorted(s for s in sizes if 1 <= s <= top)


# About 80 s on 2 cores (one compiled call per size): the slow suite. The default run keeps the same property on
# fewer sizes in tests/test_backend.py::test_dynamic_shapes_give_one_graph_per_planner_interval.
@pytest.mark.slow
def test_dynamic_compile_recompiles_only_at_breakpoints():
    _, tt = _dense_and_tt()
    envelope = comera_fx.plan(tt)
    tt.tt.prepare_plans()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tt, backend="eager", dynamic=True)
    reference = tt.tt.dense().detach()
    for batch in _batch_sizes_crossing(envelope):
        x = torch.randn(batch, 96, dtype=torch.float64)
        y = compiled(x)
        if batch in (1, 4096) or batch in {p.first for p in envelope.pieces}:
            torch.testing.assert_close(y, x @ reference + tt.bias, rtol=1e-10, atol=1e-12)
    graphs = counters["stats"]["unique_graphs"]
    # One graph per planner interval, plus at most one for Dynamo's specialisation of size 1.
    assert graphs <= len(envelope.breakpoints) + 2, (graphs, str(envelope))
    assert graphs >= len(envelope.pieces)  # each interval really got its own plan
    torch._dynamo.reset()


def test_choose_plan_matches_the_envelope_everywhere():
    _, tt = _dense_and_tt()
    envelope = planned_envelope(tt.tt.layout, "matmul", device="cpu")
    for batch in range(0, 300):
        expected = envelope.pieces[0].plan if batch == 0 else envelope.choose(batch)
        assert choose_plan(envelope, batch) == expected


def test_graph_pass_uses_the_plan_for_the_exported_batch():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(96, 80)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    net = Net().double()
    config = TensorizeConfig(max_rank=6, min_numel=1, min_dim=1)
    for batch in (1, 512):
        x = torch.randn(batch, 96, dtype=torch.float64)
        gm = comera_fx.passes.tensorize(torch.export.export(copy.deepcopy(net), (x,)).module(), config)
        tt = gm.get_submodule("comera_tt_fc_weight")
        expected = planned_envelope(tt.layout, "matmul", device="cpu").choose(batch)
        mms = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.mm)
        assert mms == len(expected.steps), (batch, str(expected))
        torch.testing.assert_close(gm(x), x @ tt.dense().detach() + net.fc.bias, rtol=1e-10, atol=1e-12)


def test_report_shows_the_chosen_plan_per_layer():
    _, tt = _dense_and_tt()
    model = torch.nn.Sequential(tt)
    rep = comera_fx.report(model, batch=4096)
    expected = str(comera_fx.plan(tt).choose(4096))
    assert rep.layers[0].plan == expected
    assert expected in str(rep)


@pytest.mark.parametrize("batch", [0, 3])
def test_zero_and_small_batches_run(batch):
    dense, tt = _dense_and_tt()
    x = torch.randn(batch, 96, dtype=torch.float64)
    assert tt(x).shape == (batch, 80)
