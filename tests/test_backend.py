"""``comera_fx.backend``: compiled results equal eager ones, graphs are counted, dense weights are reported once.

References: the dense float64 model a full-rank TT copy was made from (outputs, input gradients), and the eager
run of the same TT model (core and gate gradients, which the dense model does not have). Most checks use
``inductor=False`` (AOTAutograd graphs run as they are, seconds per compile); each Inductor compile takes 10–60 s on
2 busy cores, so the Inductor checks are few: the demo's training, dropout, embedding backward, and a property on
random TT models (2 examples by default, 10 in the slow suite).
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
import transformers  # a test dependency (pyproject's [test] extra)
from torch import nn

import comera_fx
from comera_fx import BackendConfig, DenseWeightsWarning, TensorizeConfig
from comera_fx.testing import assert_rewrite_equivalent, strategies
from comera_fx.testing.models import FunctionalLinear
from helpers_models import MLP, load_demo

FULL = TensorizeConfig(min_numel=1024, min_dim=16, max_rank=None)  # full rank: the TT model equals the dense one
DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_code_lm.py"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def eager_backend(**fields):
    return comera_fx.make_backend(inductor=False, **fields)


def full_rank_copy(dense: nn.Module, example):
    tt_model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(tt_model, FULL, example_inputs=(example,))
    assert summary.converted, summary
    return tt_model


def outputs_and_grads(model: nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    y = model(x)
    y.pow(2).sum().backward()
    grads = {
        name.removeprefix("_orig_mod."): p.grad.detach().clone()  # torch.compile's wrapper adds the prefix
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return y.detach(), (x.grad.detach() if x.grad is not None else None), grads


def assert_compiled_matches(dense: nn.Module, tt_model: nn.Module, compiled, inputs, rtol=1e-9, atol=1e-10):
    for x in inputs:
        y_ref, dx_ref, _ = outputs_and_grads(dense, x)
        _, _, g_eager = outputs_and_grads(tt_model, x)
        y, dx, g = outputs_and_grads(compiled, x)
        torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
        if dx_ref is not None:
            torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol)
        assert g.keys() == g_eager.keys()
        for name in g:
            torch.testing.assert_close(g[name], g_eager[name], rtol=rtol, atol=atol, msg=name)


class Block(nn.Module):
    """A pre-norm transformer block with nn.Linear projections (attention + MLP)."""

    def __init__(self, d=64, heads=4, ff=128):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _mlp(n):
    return MLP(128, 256, 100), lambda t: torch.randn(t, 128)


def _block(n):
    return Block(), lambda t: torch.randn(2, -(-t // 2), 64)


def _functional(n):
    return FunctionalLinear(128, 256), lambda t: torch.randn(t, 128)


def last_interval_start(model: nn.Module) -> int:
    """Tokens from which every TT product of ``model`` runs its large-batch plan (the last planner interval)."""
    start = 1
    for module in model.modules():
        if isinstance(module, comera_fx.TTMatrix):
            for op in ("matmul", "matmul_t"):
                start = max(start, comera_fx.plan(module, op=op).envelope[-1].first)
    return start


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("make", [_mlp, _block, _functional], ids=["mlp", "block", "functional"])
def test_backend_matches_dense_and_eager(make, dynamic):
    torch.manual_seed(0)
    dense, make_input = make(0)
    dense = dense.double()
    tt_model = full_rank_copy(dense, make_input(4).double())
    tokens = last_interval_start(tt_model) + 2
    inputs = [make_input(t).double() for t in (tokens, tokens, tokens + 6)]
    backend = eager_backend()
    compiled = torch.compile(tt_model, backend=backend, dynamic=dynamic)
    assert_compiled_matches(dense, tt_model, compiled, inputs)
    # Static shapes: the repeated size reuses its graph and the new size adds one. Dynamic: the sizes lie in one
    # planner interval, so one graph serves both.
    assert backend.stats.graphs == (1 if dynamic else 2), backend.stats


def test_functional_parameters_are_contracted_without_building_the_dense_weight():
    torch.manual_seed(0)
    model = FunctionalLinear(128, 256).double()
    x = torch.randn(300, 128, dtype=torch.float64)
    comera_fx.tensorize_(model, TensorizeConfig(min_numel=1024, min_dim=16, max_rank=8), example_inputs=(x,))
    tt = model.weight_tt
    shapes = []

    def record_shapes(gm, is_backward):
        shapes.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        return gm

    backend = eager_backend(post_aot_passes=(record_shapes,))
    compiled = torch.compile(model, backend=backend)
    xr = x.clone().requires_grad_()
    y = compiled(xr)
    y.pow(2).sum().backward()
    dense = tt.dense().detach()  # reference: the product with the dense matrix the cores define
    xd = x.clone().requires_grad_()
    y_ref = F.linear(xd, dense.t(), model.bias.detach())
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xr.grad, xd.grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is not None for p in tt.parameters())
    assert backend.stats.reconstructed_contracted == 1
    assert shapes and not {(128, 256), (256, 128)} & set(shapes), "the dense weight was rebuilt"


def test_recognition_leaves_other_functions_of_the_cores_alone():
    """The weight's subgraph is identified numerically: 2·M or M with one core left out is not M."""
    torch.manual_seed(0)
    tt = comera_fx.TTMatrix.random(
        96,
        64,
        format=comera_fx.TTFormat.TT,
        row_modes=(8, 12),
        col_modes=(8, 8),
        max_rank=6,
        std=0.1,
        dtype=torch.float64,
    )

    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.tt = tt

        def forward(self, x):
            m = self.tt.dense()
            return F.linear(x, m.t()) + x @ m + F.linear(x, 2 * m.t()) + x @ (m * self.tt.cores[0].sum())

    module = Uses()
    x = torch.randn(5, 96, dtype=torch.float64)
    expected = module(x)
    counts = []

    def rewrite(gm, example_inputs):  # the pass on the graph Dynamo captures, parameters as inputs
        gm = comera_fx.passes.contract_reconstructed_tt(gm, example_inputs, matrices=[tt])
        counts.append(gm.meta["comera_fx_reconstructed"])
        return gm.forward

    torch.testing.assert_close(torch.compile(module, backend=rewrite)(x), expected, rtol=1e-10, atol=1e-12)
    assert counts == [2]  # the first two terms only


def test_dense_weights_are_reported_once_naming_the_fix():
    torch.manual_seed(0)
    model = MLP(256, 512, 256)  # weights above the default "large" threshold (65536 elements)
    backend = eager_backend()
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 5, 6, 7):  # recompiles (static, then dynamic) must not repeat the report
            compiled(torch.randn(n, 256))
    reports = [w for w in caught if issubclass(w.category, DenseWeightsWarning)]
    assert len(reports) == 1, [str(w.message) for w in caught]
    message = str(reports[0].message)
    assert "comera_fx.tensorize_(model, config)" in message and "comera_fx.compile" in message
    assert "fc1.weight (512, 256)" in message and "fc2.weight (256, 512)" in message
    assert backend.stats.graphs >= 2

    comera_fx.tensorize_(model, example_inputs=(torch.randn(4, 256),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend=eager_backend())(torch.randn(4, 256))
    assert not [w for w in caught if issubclass(w.category, DenseWeightsWarning)]


def test_post_aot_passes_see_forward_and_backward_and_options_route():
    seen = []

    def note(gm, is_backward):
        seen.append(is_backward)
        return gm

    torch.manual_seed(0)
    model, make_input = _mlp(0)
    inputs = [make_input(6)]
    comera_fx.tensorize_(model, FULL, example_inputs=(inputs[0],))
    backend = comera_fx.make_backend()  # Inductor by default; the options below switch it off for this compile
    compiled = torch.compile(model, backend=backend, options={"inductor": False, "post_aot_passes": [note]})
    compiled(inputs[0]).sum().backward()
    assert seen == [False, True]
    config = BackendConfig().with_options({"inductor": False, "max_autotune": True})
    assert config.inductor is False and dict(config.inductor_options) == {"max_autotune": True}


def test_backend_is_registered_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("comera_fx") is comera_fx.backend


def test_dynamic_shapes_give_one_graph_per_planner_interval():
    torch.manual_seed(0)
    layer = comera_fx.TTLinear(
        comera_fx.TTMatrix.random(
            768,
            768,
            format=comera_fx.TTFormat.TT,
            row_modes=(12, 8, 8),
            col_modes=(8, 8, 12),
            max_rank=30,
            std=0.02,
            dtype=torch.float64,
        )
    )
    envelope = comera_fx.plan(layer)
    layer.tt.prepare_plans()
    backend = eager_backend()
    compiled = torch.compile(layer, backend=backend, dynamic=True)
    dense = layer.tt.dense().detach()
    sizes = sorted(
        {1, 2, 3, 4096}
        | {s for p in envelope.pieces for s in (p.first, p.first + 1) if s is not None and s <= 4096}
        | {int(b) + d for b in envelope.breakpoints for d in (0, 1)}
    )
    for batch in sizes:
        x = torch.randn(batch, 768, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), x @ dense, rtol=1e-10, atol=1e-12)
    assert len(envelope.pieces) <= backend.stats.graphs <= len(envelope.breakpoints) + 2, (backend.stats, envelope)


# ---------------------------------------------------------------------------------- the demo's transformer


@pytest.fixture(scope="module")
def demo():
    return load_demo("train_code_lm_for_backend_tests")


def tiny_demo_model(demo, dtype=torch.float32):
    torch.manual_seed(0)
    preset = demo.PRESETS["tiny"]
    model = demo.GPT(preset).to(dtype)
    ids = torch.randint(0, demo.VOCAB, (2, preset.seq_len))
    return model, ids, preset


def test_fullgraph_on_the_demo_transformer(demo):
    model, ids, _ = tiny_demo_model(demo, torch.float64)
    dense = copy.deepcopy(model)
    comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096, max_rank=None), example_inputs=(ids,))
    backend = eager_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    y = compiled(ids)
    torch.testing.assert_close(y, dense(ids), rtol=1e-9, atol=1e-10)
    y.pow(2).mean().backward()
    assert backend.stats.graphs == 1
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bf16_autocast_on_cpu(demo):
    model, ids, _ = tiny_demo_model(demo)
    comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096, max_rank=16), example_inputs=(ids,))
    compiled = torch.compile(model, backend=eager_backend())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(ids)
        y = compiled(ids)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=0, atol=0)  # the same bf16 ops, in the same order
    y.float().pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.fixture(scope="module")
def inductor_training(demo):
    """30 steps of AdamW on the tiny demo model: eager vs comera_fx.compile (Inductor), from identical copies."""
    model, ids, preset = tiny_demo_model(demo)
    config = TensorizeConfig(min_numel=4096, max_rank=16)
    eager = copy.deepcopy(model)
    comera_fx.tensorize_(eager, config, example_inputs=(ids,))
    compiled = comera_fx.compile(model, config, example_inputs=(ids,))
    text = torch.tensor(list(DEMO.read_bytes()[:4096]))  # learnable bytes, so the losses move
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(text) - preset.seq_len - 1, (30, 4), generator=generator)
    batches = [torch.stack([text[s : s + preset.seq_len + 1] for s in row.tolist()]) for row in starts]
    losses = {}
    for name, net in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses[name] = []
        for batch in batches:
            loss = F.cross_entropy(net(batch[:, :-1]).reshape(-1, demo.VOCAB), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    return losses, compiled


def test_inductor_training_matches_eager(inductor_training):
    losses, compiled = inductor_training
    assert losses["eager"][-1] < losses["eager"][0] - 0.5  # it trains
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=2e-4, atol=2e-4)
    assert compiled.comera_fx_summary.converted


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 96), nn.Linear(96, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(torch.tanh(self.fc1(x)))))


def test_inductor_dropout_on_cpu_draws_eager_masks():
    """On CPU, with ``fast_dropout=False``, the backend has Inductor fall back to aten's random ops
    (``fallback_random``): after the same ``torch.manual_seed`` the compiled TT model drops the units the dense
    float64 model drops in eager mode. (The default fast dropout draws other masks: tests/test_dropout.py.)"""
    torch.manual_seed(0)
    dense = DropoutMLP().double().train()
    x = torch.randn(8, 64, dtype=torch.float64)
    tt_model = full_rank_copy(dense, x)
    compiled = torch.compile(tt_model, backend=comera_fx.make_backend(warn_dense=False, fast_dropout=False))
    for seed in (1, 2):  # the first call compiles; the second runs the compiled code only
        torch.manual_seed(seed)
        expected, expected_dx, _ = outputs_and_grads(dense, x)
        torch.manual_seed(seed)
        got, got_dx, _ = outputs_and_grads(compiled, x)
        assert (expected == 0).float().mean() > 0.3  # dropout is live: about half the outputs are zero
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(got_dx, expected_dx, rtol=1e-9, atol=1e-10)


class EmbeddingHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, ids):
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("kernels", [None, ()], ids=["aten-kernel", "decomposed"])
def test_inductor_cpu_embedding_backward_runs_aten_kernel(kernels):
    """On CPU the backend keeps ``aten.embedding_dense_backward`` out of Inductor's decompositions (its
    scatter-add loop was 2.8-3x slower), so the backward graph calls aten's kernel; ``cpu_aten_kernels=()`` restores
    the decomposition. Either way the gradients equal eager float64 ones, repeated indices included."""
    torch.manual_seed(0)
    model = EmbeddingHead().double()
    ids = torch.tensor([[1, 4, 4, 7], [0, 4, 49, 1]])
    backward_ops = []

    def record(gm, is_backward):
        if is_backward:
            backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fields = {} if kernels is None else {"cpu_aten_kernels": kernels}
    compiled = torch.compile(
        copy.deepcopy(model), backend=comera_fx.make_backend(warn_dense=False, post_aot_passes=(record,), **fields)
    )
    compiled(ids).pow(2).sum().backward()
    model(ids).pow(2).sum().backward()
    got = dict(compiled.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["_orig_mod." + name].grad, p.grad, rtol=1e-9, atol=1e-10)
    assert backward_ops
    assert ("aten.embedding_dense_backward.default" in backward_ops) == (kernels is None)


# ------------------------------------------------------------------------------------------ random models

EXACT = TensorizeConfig(min_numel=1, min_dim=1, max_rank=None)  # every weight converted, full rank: exact


def _tensorized(case):
    """A random model tensorized through Dynamo capture (F.linear on raw parameters becomes a reconstructing
    property), with a dense twin as the reference; inputs as drawn."""
    model, example_inputs = case
    tt_model = copy.deepcopy(model)
    comera_fx.tensorize_(tt_model, EXACT, example_inputs=example_inputs)
    return model, tt_model, example_inputs, case.more_inputs


def check_compiled_equals_dense(case) -> None:
    """The backend (inductor=False) on a random TT model equals the dense model it was made from at full rank:
    outputs and gradients, on two batches (the second recompiles when its shape differs)."""
    dense, tt_model, example_inputs, more = _tensorized(case)
    backend = eager_backend(warn_dense=False)
    assert_rewrite_equivalent(
        dense, lambda m: tt_model, example_inputs, graph=False, extra_inputs=more, compile_backend=backend
    )
    assert backend.stats.graphs >= 1


# Each example compiles forward and backward (AOTAutograd, no Inductor): about 4 s for one input and a small model,
# so the default suite runs 10 of them; the slow suite runs 50 on two inputs (the second recompiles, with dynamic
# shapes) and larger models (200 would take CI's slow-suite time alone).
@settings(max_examples=10)
@given(case=strategies.models(max_blocks=3, max_features=24))
def test_compiled_equals_dense_on_random_tensorized_models(case):
    check_compiled_equals_dense(case)


@pytest.mark.slow
@settings(max_examples=50)
@given(case=strategies.models(num_inputs=2))
def test_compiled_equals_dense_on_random_tensorized_models_thoroughly(case):
    check_compiled_equals_dense(case)


def check_inductor_equals_eager(case, max_rank) -> None:
    """The default backend (Inductor) on a random TT model (tensorized through Dynamo capture at ``max_rank``)
    computes what the same model computes eagerly: outputs, input gradients and every parameter's gradient, TT
    cores and gates included (the dense model has none), on each drawn input. Inductor reorders float64 sums, so
    the tolerance is 1e-9 relative, far below any wrong contraction, gate or plan."""
    model, example_inputs = case
    eager = copy.deepcopy(model)
    config = TensorizeConfig(min_numel=1, min_dim=1, max_rank=max_rank)
    summary = comera_fx.tensorize_(eager, config, example_inputs=example_inputs)
    assert summary.method == "dynamo", summary
    torch._dynamo.reset()  # every RandomModel shares one forward: a fresh cache per example
    backend = comera_fx.make_backend(warn_dense=False)
    assert backend.config.inductor
    compiled = torch.compile(copy.deepcopy(eager), backend=backend)
    for (x,) in [example_inputs, *case.more_inputs]:
        y_ref, dx_ref, g_ref = outputs_and_grads(eager, x)
        y, dx, g = outputs_and_grads(compiled, x)
        torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-12)
        if dx_ref is not None:
            torch.testing.assert_close(dx, dx_ref, rtol=1e-9, atol=1e-12)
        assert g.keys() == g_ref.keys(), (sorted(g), sorted(g_ref))
        for name in g:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-9, atol=1e-12, msg=name)
    assert backend.stats.graphs >= 1


# Each example compiles forward and backward with Inductor (C++ codegen: 10-60 s on 2 busy cores even for a tiny
# model), so the default run draws 2 small models with one input each; the slow suite 10, larger, with two inputs.
INDUCTOR_RANKS = st.sampled_from([None, 1, 3])


@settings(max_examples=2)
@given(case=strategies.models(max_blocks=2, max_features=12), max_rank=INDUCTOR_RANKS)
def test_inductor_equals_eager_on_random_tensorized_models(case, max_rank):
    check_inductor_equals_eager(case, max_rank)


@pytest.mark.slow
@settings(max_examples=10)
@given(case=strategies.models(max_blocks=3, max_features=24, num_inputs=2), max_rank=INDUCTOR_RANKS)
def test_inductor_equals_eager_on_random_tensorized_models_thoroughly(case, max_rank):
    check_inductor_equals_eager(case, max_rank)


# ---------------------------------------------------------------------------------- transformers models


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_backend_on_transformers_models(name):
    """GPT-2 (Conv1D weights, tied wte / lm_head) and BERT, full rank in float64: compiled = dense model."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        dense = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            intermediate_size=512,
            vocab_size=1000,
            max_position_embeddings=64,
        )
        dense = transformers.BertModel(config)
    dense = dense.double().eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, FULL, example_inputs={"input_ids": ids})
    assert any(d.kind == "embedding" for d in summary.converted)
    extra = {"use_cache": False} if name == "gpt2" else {}
    backend = eager_backend()
    compiled = torch.compile(model, backend=backend)

    def run(net):
        out = net(input_ids=ids, **extra)
        y = out.logits if name == "gpt2" else out.last_hidden_state
        y.pow(2).mean().backward()
        grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        net.zero_grad(set_to_none=True)
        return y.detach(), grads

    y_ref, _ = run(dense)
    _, g_eager = run(model)
    y, g = run(compiled)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    assert g_eager and g_eager.keys() <= g.keys()
    for key in g:  # AOTAutograd gives zeros, not None, to parameters of unused outputs (BERT's pooler)
        expected = g_eager.get(key, torch.zeros_like(g[key]))
        torch.testing.assert_close(g[key], expected, rtol=1e-8, atol=1e-10, msg=key)
    assert backend.stats.graphs >= 1


class Stack(nn.Module):
    """Three identical blocks behind a ModuleList (a transformer's layers), plus a head left eager."""

    def __init__(self, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_compile_regions_shares_one_graph_across_same_shaped_blocks_and_recompiles_a_shrunk_one():
    from comera_fx.runtime.shrink import shrink_

    torch.manual_seed(0)
    dense = Stack().double()
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    tt_model = full_rank_copy(dense, x)
    keys = list(tt_model.state_dict())
    backend = eager_backend()
    names = comera_fx.compile_regions(tt_model, backend=backend)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(tt_model.state_dict()) == keys  # compiled in place: no ``_orig_mod.`` in the keys
    y_ref, dx_ref, _ = outputs_and_grads(dense, x)  # full rank: the dense model is the reference
    y, dx, grads = outputs_and_grads(tt_model, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-9, atol=1e-10)
    assert any(name.startswith("blocks.2.") for name in grads)
    assert backend.stats.graphs == 1, "three blocks of one shape should share one compiled graph"

    fc = tt_model.blocks[1].fc.tt
    with torch.no_grad():
        fc.gates[0][0] = 0.0  # a dead rank slice: shrinking it is exact
    ranks = fc.layout.internal_ranks
    assert shrink_(fc) is not None and fc.layout.internal_ranks != ranks
    reference = copy.deepcopy(tt_model)  # the same TT model, shrunk, run eagerly
    for block in reference.blocks:
        block._compiled_call_impl = None
    y_ref, dx_ref, g_ref = outputs_and_grads(reference, x)
    y, dx, grads = outputs_and_grads(tt_model, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-9, atol=1e-10)
    for name in g_ref:
        torch.testing.assert_close(grads[name], g_ref[name], rtol=1e-9, atol=1e-10, msg=name)
    assert backend.stats.graphs == 2, "only the shrunk block compiles a graph of its own"
    assert torch._dynamo.config.recompile_limit >= 2 * len(names) + 1


def test_compile_regions_takes_classes_or_names_and_refuses_a_model_without_blocks():
    model = Stack()
    assert comera_fx.compile_regions(copy.deepcopy(model), (Block,), backend=eager_backend()) == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]
    assert comera_fx.compile_regions(copy.deepcopy(model), ["blocks.1"], backend=eager_backend()) == ["blocks.1"]
    with pytest.raises(AttributeError, match="nope"):
        comera_fx.compile_regions(copy.deepcopy(model), ["nope"], backend=eager_backend())
    with pytest.raises(ValueError, match=r"regions=\(YourBlock,\)"):
        comera_fx.compile_regions(MLP(16, 32, 4), backend=eager_backend())


def test_compile_compiles_repeated_blocks_regionally_by_default_and_other_models_whole():
    """``comera_fx.compile`` without ``regional``: a model with repeated blocks gets them compiled in place (one
    graph for the three, the head eager); a model without them is compiled whole; both equal the dense model."""
    torch.manual_seed(0)
    model = Stack().double()
    dense = copy.deepcopy(model)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    config = BackendConfig(inductor=False)
    returned = comera_fx.compile(model, FULL, example_inputs=(x,), backend_config=config)
    assert returned is model and returned.comera_fx_summary.converted
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=1e-9, atol=1e-10)

    mlp = MLP(128, 256, 100).double()
    dense_mlp = copy.deepcopy(mlp)
    x = torch.randn(3, 128, dtype=torch.float64)
    compiled = comera_fx.compile(mlp, FULL, example_inputs=(x,), backend_config=config)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and compiled._orig_mod is mlp
    assert compiled.comera_fx_summary.converted
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), dense_mlp(x), rtol=1e-9, atol=1e-10)
    whole = comera_fx.compile(
        Stack().double(),
        FULL,
        example_inputs=(torch.randn(2, 5, 64, dtype=torch.float64),),
        backend_config=config,
        regional=False,
    )
    assert isinstance(whole, torch._dynamo.eval_frame.OptimizedModule)


def test_a_post_aot_pass_is_keyed_by_source_and_plain_closure_values_or_not_cached():
    """A warm start may reuse a graph only if it was compiled with the same passes: a pass's closure values are part
    of its identity, and a pass closing over an object whose repr may not say what it is turns the cache off."""
    from comera_fx.backend import _pass_identity

    def make(threshold):
        def prune_small(gm):
            return gm if threshold else gm

        return prune_small

    assert _pass_identity(make(0.1)) != _pass_identity(make(0.2)) and _pass_identity(make(0.1)) is not None
    assert _pass_identity(make(object())) is None
    assert _pass_identity(len) is None  # a builtin: no source
    assert (
        _pass_identity(
            functools.partial(
                make(1),
            )
        )
        is not None
    )
    assert _pass_identity(functools.partial(make(1), object())) is None
