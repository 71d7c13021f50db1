"""comera_fx.export: one exported program for a declared range of batch / sequence sizes, equal to eager and to the
dense float64 model at every size tried; ranges the model cannot run are refused naming the dimension."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.export import Dim

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.runtime.shrink import remove_slices_
from comera_fx.tt import TTEmbedding, TTLinear
from comera_fx.tt import plan as planner

from helpers_models import MLP

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM(nn.Module):
    """Token + position embeddings, one pre-LN attention/MLP block, a head tied to the token embedding."""

    def __init__(self, vocab: int = 512, d: int = 64, positions: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(positions, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(x)


def dense_twin(dense: nn.Module, tensorized: nn.Module) -> nn.Module:
    """``dense`` with every weight replaced by the dense matrix its TT twin holds: the float64 reference."""
    twin = copy.deepcopy(dense)
    for name, module in tensorized.named_modules():
        if isinstance(module, (TTLinear, TTEmbedding)):
            twin.get_submodule(name).weight.data = module.weight.detach().clone()
    return twin


def prune_unevenly_(model: nn.Module) -> None:
    """Remove gate slices so the bonds end at different ranks (as rank adaptation leaves them)."""
    g = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(module, comera_fx.TTMatrix):
            masks = [torch.rand(gate.shape, generator=g) < 0.6 for gate in module.gates]
            for m in masks:
                m[0] = True
            remove_slices_(module, masks)


def aten_targets_only(program) -> bool:
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    return all(
        isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "aten"
        or n.target.__module__ in ("_operator", "operator")
        for n in nodes
    )


@pytest.mark.parametrize("pruned", [False, True])
def test_two_linear_model_one_program_for_the_whole_batch_range(pruned):
    torch.manual_seed(0)
    dense = MLP().double().eval()
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    if pruned:
        prune_unevenly_(model)
    reference = dense_twin(dense, model)
    program = comera_fx.export(
        model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b", min=1, max=1024)},)
    )
    assert aten_targets_only(program)
    run = program.module()
    # The eager planner switches plans at small sizes (both layers' envelopes have several pieces): the sizes
    # straddle its breakpoints and reach both ends of the declared range.
    breakpoints = {p.first for m in (model.fc1, model.fc2) for p in comera_fx.plan(m.tt).pieces}
    sizes = sorted({1, 2, 1024} | {b for p in breakpoints for b in (p - 1, p) if 1 <= b <= 1024})
    for batch in sizes:
        x = torch.randn(batch, 128, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(run(x), model(x), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(run(x), reference(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pruned", [False, True])
def test_tiny_lm_exports_with_dynamic_batch_and_sequence(pruned):
    torch.manual_seed(1)
    dense = TinyLM().double().eval()
    ids = torch.randint(0, 512, (2, 8))
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, TensorizeConfig(max_rank=6, min_numel=2**12), example_inputs=(ids,))
    assert any(d.kind == "embedding" for d in summary.converted)
    if pruned:
        prune_unevenly_(model)
    reference = dense_twin(dense, model)
    program = comera_fx.export(
        model, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=16), 1: Dim("seq", min=1, max=32)},)
    )
    assert aten_targets_only(program)
    run = program.module()
    for batch, seq in [(1, 1), (1, 32), (16, 1), (3, 7), (16, 32), (5, 12)]:
        x = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(batch * seq))
        with torch.no_grad():
            expected = reference(x)
            torch.testing.assert_close(run(x), model(x), rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(run(x), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("grad", [False, True])
def test_stock_torch_export_of_a_pruned_lm_runs_the_whole_declared_range(grad):
    """Plain ``torch.export.export`` (what users call first), with and without grad: no guard on the token count,
    so every (batch, seq) in the declared ranges runs and matches the float64 dense reference."""
    torch.manual_seed(4)
    dense = TinyLM().double().eval()
    ids = torch.randint(0, 512, (2, 8))
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=6, min_numel=2**12), example_inputs=(ids,))
    prune_unevenly_(model)
    reference = dense_twin(dense, model)
    with torch.set_grad_enabled(grad):
        program = torch.export.export(
            model, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=16), 1: Dim("seq", min=1, max=32)},)
        )
    run = program.module()
    # Token counts 1..512: across the eager planner's breakpoints (a guard on them failed at (1, 1) before).
    for batch, seq in [(1, 1), (1, 2), (2, 3), (1, 32), (16, 1), (3, 7), (16, 32), (5, 12)]:
        x = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(batch * seq))
        with torch.no_grad():
            torch.testing.assert_close(run(x), reference(x), rtol=1e-9, atol=1e-11)


def test_stock_torch_export_without_a_declared_max_runs_small_and_large_batches():
    torch.manual_seed(5)
    dense = MLP().double().eval()
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    prune_unevenly_(model)
    reference = dense_twin(dense, model)
    program = torch.export.export(model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b")},))
    run = program.module()
    for batch in (1, 2, 5, 300, 2048):
        x = torch.randn(batch, 128, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(run(x), reference(x), rtol=1e-10, atol=1e-12)


def test_a_range_past_the_position_table_is_refused_naming_the_dimension():
    torch.manual_seed(2)
    model = TinyLM(positions=32).double().eval()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=6, min_numel=2**12))
    ids = torch.randint(0, 512, (2, 8))
    with pytest.raises(comera_fx.ExportRangeError, match=r"ids\.size\(1\) = 48, the declared max"):
        comera_fx.export(model, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=48)},))


def test_a_dimension_without_a_max_is_refused():
    model = MLP().double().eval()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    with pytest.raises(comera_fx.ExportRangeError, match="max"):
        comera_fx.export(model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b")},))


def test_the_program_refuses_sizes_outside_the_declared_range_naming_the_dimension():
    model = MLP().double().eval()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    program = comera_fx.export(
        model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b", min=2, max=64)},)
    )
    run = program.module()
    with pytest.raises(Exception, match=r"x\.size\(\)\[0\] <= 64"):
        run(torch.randn(65, 128, dtype=torch.float64))
    with pytest.raises(Exception, match=r"x\.size\(\)\[1\]|128"):
        run(torch.randn(4, 100, dtype=torch.float64))


@pytest.mark.parametrize("extra", [(4, 128, 1), (1, 4, 128), (4, 1, 128)])
def test_the_program_refuses_an_input_with_more_dimensions(extra):
    """Same element count, another rank: the TT products flatten leading dims by count, so only the rank check
    refuses (4, 128, 1), which dense ``nn.Linear`` would reject too; eager and exported agree on (4, 128)."""
    model = MLP().double().eval()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    program = comera_fx.export(
        model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b", min=2, max=64)},)
    )
    run = program.module()
    x = torch.randn(4, 128, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-10, atol=1e-10)
    with pytest.raises(Exception, match="dimensions|size"):
        run(x.reshape(extra))


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 6), (3, 40), (1, 1024), (100, 4096)])
def test_plan_for_range_minimises_the_worst_ratio_at_every_size(lo, hi):
    """Brute force over every integer size: no plan of the envelope has a smaller worst ratio to the per-size best,
    and the reported ratio is the chosen plan's worst."""
    layout = comera_fx.TTMatrix.random(
        128, 256, format="tt", row_modes=(16, 8), col_modes=(16, 16), max_rank=8, std=0.1
    ).layout
    chosen = comera_fx.plan_for_range(layout, "matmul", lo, hi)
    candidates = planner.plan(layout, op="matmul", bounds=(1, None), backward=False).plans
    sizes = range(lo, hi + 1)

    def cost(p, b):
        c0, c1 = p.weighted_cost
        return c0 + c1 * b

    best = {b: min(cost(p, b) for p in candidates) for b in sizes}
    worst = {str(p): max(cost(p, b) / best[b] for b in sizes) for p in candidates}
    assert worst[str(chosen.plan)] == pytest.approx(min(worst.values()), rel=1e-12)
    assert chosen.worst_ratio == pytest.approx(worst[str(chosen.plan)], rel=1e-12)
    assert cost(chosen.plan, chosen.worst_at) / best[chosen.worst_at] == pytest.approx(chosen.worst_ratio)


@torch.library.custom_op("comera_fx_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_graph_calling_a_python_custom_op_is_refused():
    class CallsCustomOp(nn.Module):
        def forward(self, x):
            return _twice(x)

    with pytest.raises(RuntimeError, match="comera_fx_test.twice.*not an aten op"):
        comera_fx.export(CallsCustomOp(), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("b", min=1, max=8)},))


def test_hugging_face_gpt2_exports_with_dynamic_batch_and_sequence():
    torch.manual_seed(3)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 256, (2, 8))
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=2**12), example_inputs={"input_ids": ids})

    class Logits(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    wrapped = Logits(model)
    program = comera_fx.export(
        wrapped, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=32)},)
    )
    for batch, seq in [(1, 1), (8, 32), (3, 17)]:
        x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), wrapped(x), rtol=1e-9, atol=1e-11)
    with pytest.raises(comera_fx.ExportRangeError, match=r"ids\.size\(1\) = 64"):  # n_positions is 32
        comera_fx.export(
            wrapped, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=64)},)
        )
