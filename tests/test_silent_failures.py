"""Inputs that used to give a silently wrong or surprising result (issue 12), each pinned by a test.

Every test here failed before its fix. Numbers are checked against dense float64 computations or against the
model as it was before the call (a deep copy kept untouched), never against the code under test.
"""

import copy
import io
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig, TTLinear, TTMatrix
from comera_fx.passes.find import find_in_model as find
from comera_fx.tt import plan_cache
from comera_fx.tt.layers import make_tt_matrix
from comera_fx.tt.layout import TTFormat
from comera_fx.passes.holders import PROPERTY_MATRICES
from helpers_models import MLP, FunctionalLinear, Mixed

tensorize_module = sys.modules["comera_fx.passes.tensorize"]  # comera_fx.passes.tensorize is the graph pass


def dense_8x8(seed):
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_checkpoint_with_swapped_modes_is_refused_naming_layer_and_shapes(fmt):
    """Two 8×8 TT-matrices with modes (2,4)|(4,2) and (4,2)|(2,4): same number of cores, other modes. Loading one
    into the other used to say "All keys matched successfully" and then compute another matrix (max error 13)."""
    a = TTLinear(
        make_tt_matrix(dense_8x8(0), kind="linear", format=fmt, max_rank=100, row_modes=(2, 4), col_modes=(4, 2))
    )
    b = TTLinear(
        make_tt_matrix(dense_8x8(1), kind="linear", format=fmt, max_rank=100, row_modes=(4, 2), col_modes=(2, 4))
    )
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
    ttm = make_tt_matrix(
        dense_8x8(0), kind="linear", format=TTFormat.TTM, max_rank=100, row_modes=(2, 4), col_modes=(4, 2)
    )
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
    monkeypatch.setattr(plan_cache, "_ENVELOPES", OrderedDict())
    monkeypatch.setattr(plan_cache, "ENVELOPE_CACHE_SIZE", 3)
    x = torch.randn(5, 8, dtype=torch.float64)
    matrices = [
        make_tt_matrix(dense_8x8(seed), kind="linear", max_rank=rank, row_modes=(2, 4), col_modes=(4, 2))
        for seed, rank in enumerate((1, 2, 3, 4))
    ]  # four ranks: four layouts
    for tt in matrices[:3]:
        tt.matmul(x)
    matrices[0].matmul(x)  # a hit: the first layout becomes the most recent
    matrices[3].matmul(x)  # a fourth layout evicts the least recent one, the second
    assert len(plan_cache._ENVELOPES) == 3
    assert (matrices[1].layout, "matmul", "cpu") not in plan_cache._ENVELOPES
    assert (matrices[0].layout, "matmul", "cpu") in plan_cache._ENVELOPES

    evicted = matrices[1]
    compiled = torch.compile(evicted.matmul, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x @ evicted.dense().detach(), rtol=1e-12, atol=1e-12)
    assert (evicted.layout, "matmul", "cpu") not in plan_cache._ENVELOPES  # compiled code never plans
    torch.testing.assert_close(evicted.matmul(x), x @ evicted.dense().detach(), rtol=1e-12, atol=1e-12)
    assert (evicted.layout, "matmul", "cpu") in plan_cache._ENVELOPES and len(plan_cache._ENVELOPES) == 3


# ------------------------------------------------------------------------------------------------------ capture


class NormDropNet(nn.Module):
    """BatchNorm (train mode: a forward updates running stats and num_batches_tracked) and dropout (consumes the
    global RNG) around two large linears, with a graph break so that Dynamo compiles the forward's own frames."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = (
            nn.Linear(64, 128),
            nn.BatchNorm1d(128),
            nn.Dropout(0.5),
            nn.Linear(128, 64),
        )

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


# --------------------------------------------------------------------- what tensorize_ keeps of what it replaces

SMALL = TensorizeConfig(max_rank=8, min_numel=4096)


def ids_input(vocab=300, shape=(3, 9), seed=2):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_frozen_weights_give_frozen_cores_and_gates_and_a_frozen_bias():
    """nn.Linear (swapped for a TTLinear) and F.linear on raw parameters (a property): a frozen weight used to
    become trainable cores, and the frozen bias a new trainable copy."""
    torch.manual_seed(0)
    mlp, functional = MLP(), FunctionalLinear()
    for p in (mlp.fc1.weight, mlp.fc1.bias, functional.w1, functional.b1):
        p.requires_grad_(False)
    bias = mlp.fc1.bias
    comera_fx.tensorize_(mlp, SMALL, example_inputs=torch.randn(4, 128))
    comera_fx.tensorize_(functional, SMALL, example_inputs=torch.randn(4, 128))
    assert isinstance(mlp.fc1, TTLinear) and isinstance(mlp.fc2, TTLinear)
    assert not any(p.requires_grad for p in mlp.fc1.tt.parameters())
    assert mlp.fc1.bias is bias and not bias.requires_grad
    assert all(p.requires_grad for p in mlp.fc2.parameters())
    assert not any(p.requires_grad for p in functional.w1_tt.parameters())
    assert all(p.requires_grad for p in functional.w2_tt.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cores_keep_the_weights_dtype(dtype):
    model = MLP().to(dtype)
    comera_fx.tensorize_(model, SMALL)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


def test_forward_hooks_and_pre_hooks_move_to_the_tt_module():
    torch.manual_seed(0)
    model = MLP()
    seen = []
    pre = model.fc1.register_forward_pre_hook(lambda module, args: seen.append(("pre", type(module).__name__)))
    model.fc1.register_forward_hook(lambda module, args, out: seen.append(("post", tuple(out.shape))))
    model.fc2.register_forward_hook(lambda module, args, out: out * 0)  # a hook that changes the output
    comera_fx.tensorize_(model, SMALL)
    out = model(torch.randn(4, 128))
    assert seen == [("pre", "TTLinear"), ("post", (4, 256))]
    assert torch.equal(out, torch.zeros(4, 100))
    pre.remove()  # the user's handle still works
    model(torch.randn(4, 128))
    assert seen[2:] == [("post", (4, 256))]


def test_a_module_with_state_dict_hooks_is_skipped_with_a_reason():
    model = MLP()
    model.fc1._register_state_dict_hook(lambda module, state, prefix, local: state)
    summary = comera_fx.tensorize_(model, SMALL)
    reasons = {d.fqn: d.reason for d in summary.layers}
    assert "state_dict hooks" in reasons["fc1.weight"] and reasons["fc2.weight"] is None
    assert type(model.fc1) is nn.Linear and isinstance(model.fc2, TTLinear)


# ------------------------------------------------------------------------------------------------ atomicity


def snapshot(model):
    return (
        [(name, id(m), type(m)) for name, m in model.named_modules(remove_duplicate=False)],
        [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)],
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def assert_unchanged(model, before):
    modules, params, state = before
    assert [(name, id(m), type(m)) for name, m in model.named_modules(remove_duplicate=False)] == modules
    assert [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)] == params
    now = model.state_dict()
    assert list(now) == list(state)
    for key, value in state.items():
        torch.testing.assert_close(now[key], value, rtol=0, atol=0, equal_nan=True)


def test_a_nan_weight_raises_naming_the_layer_and_changes_nothing():
    model = MLP()
    with torch.no_grad():
        model.fc2.weight[3, 5] = float("nan")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"fc2\.weight .*NaN/Inf"):
        comera_fx.tensorize_(model, SMALL)
    assert_unchanged(model, before)


@pytest.mark.parametrize("where", ["prepare_plans", "attach_tt_property"])
def test_a_failure_while_swapping_modules_rolls_everything_back(monkeypatch, where):
    """Mixed has a tied embedding + head (two swaps), an nn.Linear and properties on the root for F.linear /
    addmm / matmul parameters. The failure comes after some modules were swapped (prepare_plans: after the
    second layer) or half-way through giving the root a property (its parameter deleted, its class changed)."""
    torch.manual_seed(0)
    model, ids = Mixed().double(), ids_input()
    with torch.no_grad():
        expected = model(ids)
    before = snapshot(model)
    real = {"prepare_plans": TTMatrix.prepare_plans, "attach_tt_property": tensorize_module.attach_tt_property}[where]
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        result = real(*args, **kwargs)
        if len(calls) == 2:
            raise KeyboardInterrupt("boom")  # not an Exception: nothing may catch it on the way
        return result

    if where == "prepare_plans":
        monkeypatch.setattr(TTMatrix, "prepare_plans", fail_second)
    else:
        monkeypatch.setattr(tensorize_module, "attach_tt_property", fail_second)
    with pytest.raises(KeyboardInterrupt, match="boom"):
        comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    assert len(calls) == 2
    assert_unchanged(model, before)
    assert type(model) is Mixed and model.head.weight is model.emb.weight
    assert not any(tt for tt in PROPERTY_MATRICES if any(tt is m for m in model.modules()))
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


# ------------------------------------------------------------------------ saving, copying, tying, in-place init


def test_torch_save_and_load_of_a_model_with_property_holders():
    """Mixed's root holds F.linear / addmm / matmul parameters, so its class becomes a subclass made at run time,
    which pickle could not find by name: torch.save(model) raised."""
    torch.manual_seed(0)
    model, ids = Mixed().double(), ids_input()
    comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    assert type(model).__name__ == "TTMixed"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded).__name__ == "TTMixed" and isinstance(loaded, Mixed) and type(loaded) is not type(model)
    assert loaded.head.tt is loaded.emb.tt  # the tie survives
    assert any(tt is loaded.w_tt for tt in PROPERTY_MATRICES)  # the backend still finds its property matrices
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
        torch.testing.assert_close(loaded.w, model.w, rtol=0, atol=0)


def test_deepcopy_keeps_ties_and_gives_the_copy_its_own_class():
    torch.manual_seed(0)
    model, ids = Mixed().double(), ids_input()
    comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    twin = copy.deepcopy(model)
    assert twin.head.tt is twin.emb.tt and twin.head.tt is not model.head.tt
    assert type(twin) is not type(model)  # so a later change to one holder's properties cannot reach the other
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), model(ids), rtol=0, atol=0)


def gpt2(tie):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=320,
        n_positions=32,
        n_embd=64,
        n_layer=1,
        n_head=2,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double().eval()


def test_tied_gpt2_deepcopy_keeps_one_tt_matrix():
    model, ids = gpt2(tie=True), ids_input(vocab=320)
    comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    assert model.lm_head.tt is model.transformer.wte.tt
    twin = copy.deepcopy(model)
    assert twin.lm_head.tt is twin.transformer.wte.tt


def test_tie_weights_assignment_shares_the_embeddings_tt_matrix():
    """``output_embeddings.weight = input_embeddings.weight`` (transformers' tie_weights) used to raise "property
    'weight' of 'TTLinear' object has no setter"; now the head shares the embedding's TTMatrix."""
    model, ids = gpt2(tie=False), ids_input(vocab=320)
    comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    head, wte = model.lm_head, model.transformer.wte
    assert head.tt is not wte.tt
    head.weight = wte.weight
    head.out_features = wte.num_embeddings  # transformers' _adjust_bias: the same value is accepted
    assert head.tt is wte.tt
    with torch.no_grad():
        hidden = model.transformer(ids).last_hidden_state
        expected = hidden @ wte.tt.dense().t()  # logits against the (TT) embedding table, built densely
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError, match="nn.Parameter.*stored as TT cores"):
        head.weight = nn.Parameter(torch.zeros(320, 64, dtype=torch.float64))
    with pytest.raises(AttributeError, match="fixed by the TT cores"):
        head.out_features = 321


def test_tie_assignment_to_a_property_holder():
    torch.manual_seed(0)
    model = FunctionalLinear().double()
    comera_fx.tensorize_(model, SMALL, example_inputs=torch.randn(4, 128, dtype=torch.float64))
    other = FunctionalLinear().double()
    comera_fx.tensorize_(other, SMALL, example_inputs=torch.randn(4, 128, dtype=torch.float64))
    model.w2 = other.w2
    assert model.w2_tt is other.w2_tt
    torch.testing.assert_close(model.w2, other.w2, rtol=0, atol=0)
    with pytest.raises(TypeError, match="stored as TT cores"):
        model.w1 = torch.zeros(256, 128, dtype=torch.float64)


@pytest.fixture(scope="module")
def tensorized_mixed():
    torch.manual_seed(0)
    model, ids = Mixed().double(), ids_input()
    comera_fx.tensorize_(model, SMALL, example_inputs=(ids,))
    return model


@pytest.mark.parametrize("holder", ["tt_linear", "tt_embedding", "property"])
@pytest.mark.parametrize("write", ["init.normal_", "copy_", "setitem", "requires_grad_"])
def test_in_place_changes_to_a_rebuilt_weight_raise(tensorized_mixed, holder, write):
    """``torch.nn.init.normal_(module.weight)`` used to change a temporary copy and silently do nothing."""
    model = tensorized_mixed
    owner, name = {"tt_linear": (model.fc, "weight"), "tt_embedding": (model.emb, "weight"), "property": (model, "w")}[
        holder
    ]
    cores = [p.detach().clone() for p in model.parameters()]
    weight = getattr(owner, name)
    action = {
        "init.normal_": lambda: nn.init.normal_(weight),
        "copy_": lambda: weight.copy_(weight * 2),
        "setitem": lambda: weight.__setitem__(0, 1.0),
        "requires_grad_": lambda: weight.requires_grad_(False),
    }
    with pytest.raises(RuntimeError, match="rebuilds from TT cores"):
        with torch.no_grad():
            action[write]()
    assert len(cores) > 5 and all(torch.equal(a, b) for a, b in zip(cores, model.parameters()))


def test_a_rebuilt_weight_still_computes_and_trains_like_the_dense_one():
    """The view is for eager code: reads give plain tensors, gradients reach the cores."""
    torch.manual_seed(0)
    model = FunctionalLinear().double()
    comera_fx.tensorize_(model, SMALL, example_inputs=torch.randn(4, 128, dtype=torch.float64))
    x = torch.randn(4, 128, dtype=torch.float64)
    y = torch.nn.functional.linear(x, model.w1)
    assert type(y) is torch.Tensor
    torch.testing.assert_close(y, x @ model.w1_tt.dense().detach(), rtol=1e-12, atol=1e-12)  # M = w1ᵀ
    y.sum().backward()
    assert all(p.grad is not None for p in model.w1_tt.cores)


# ------------------------------------------------------------------------------------- a second tensorize_ call


def test_a_second_call_with_other_settings_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model = MLP()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=4, min_numel=4096))
    ranks = (model.fc1.tt.ranks, model.fc2.tt.ranks)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"already tensorized.*fc1\.weight \(max_rank 4 -> 8\)"):
        comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=4096))
    assert_unchanged(model, before)
    assert (model.fc1.tt.ranks, model.fc2.tt.ranks) == ranks


def test_a_second_call_converts_what_it_selects_and_lists_the_earlier_tt_layers():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(100, 128))
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=4, min_numel=4096), filter_fn=lambda m, name: name != "1")
    assert isinstance(model[0].fc1, TTLinear) and type(model[1]) is nn.Linear
    same = comera_fx.tensorize_(model, TensorizeConfig(max_rank=4, min_numel=4096))  # same settings: fine
    assert isinstance(model[1], TTLinear) and model[1].tt.ranks == (1, 4, 4, 4, 1)
    reasons = {d.fqn: d.reason for d in same.layers}
    assert "already in TT form" in reasons["0.fc1.weight"] and reasons["1.weight"] is None
    # other settings, with the earlier layers left out: only the dense ones would be converted (none are left)
    other = comera_fx.tensorize_(
        model, TensorizeConfig(max_rank=8, min_numel=4096, skip=(r"^0\.",)), filter_fn=lambda m, name: name != "1"
    )
    assert not other.converted


# --------------------------------------------------------------------------- sizes without balanced factors


def test_a_layer_without_balanced_modes_is_skipped_not_fatal():
    """131 is prime: with max_pad_fraction 0 no size factors into balanced modes. That used to abort the call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 131), nn.Linear(131, 128), nn.Linear(128, 128))
    config = TensorizeConfig(max_rank=4, min_numel=4096, max_pad_fraction=0.0)
    summary = comera_fx.tensorize_(model, config)
    reasons = {d.fqn: d.reason for d in summary.layers}
    assert "no balanced factorisation" in reasons["0.weight"] and "max_pad_fraction" in reasons["0.weight"]
    assert "no balanced factorisation" in reasons["1.weight"]
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, TTLinear]
    assert "skipped   0.weight" in str(summary)

    gm = comera_fx.passes.tensorize(
        torch.fx.symbolic_trace(nn.Sequential(nn.Linear(128, 131), nn.Linear(131, 128))), config
    )
    assert all("no balanced factorisation" in d.reason for d in gm.meta["comera_fx"].layers)
