"""tensorize_: in-place conversion, checked against the ORIGINAL dense model (a deep copy kept untouched).

At full rank (max_rank far above what any layer can use, init="svd") the TT model must compute what the dense
model computes; in float64 to ~1e-10 relative, in float32 to ~1e-5. Checked with
comera_fx.testing.assert_rewrite_equivalent: outputs, and in float64 also gradients w.r.t. float inputs and the
parameters left dense.
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
import transformers  # a test dependency (pyproject's [test] extra): missing, the suite fails here, loudly
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig, TTEmbedding, TTLinear, TTMatrix
from comera_fx.passes.find import Candidate, Use, UseKind
from comera_fx.passes.tensorize import skip_reason
from comera_fx.testing import assert_rewrite_equivalent, strategies
from comera_fx.testing.models import BlockSpec, ModelSpec, build_model, make_example_input
from helpers_models import (
    MLP,
    EmbeddingModel,
    FunctionalLinear,
    LinearAndMatmul,
    MatmulModel,
    Mixed,
    TiedLM,
    large_2d_parameters,
    Tiny,
    num_params,
    relative_tolerance,
)

tensorize_module = sys.modules["comera_fx.passes.tensorize"]  # comera_fx.passes.tensorize is the graph pass

FULL = TensorizeConfig(max_rank=10**9, min_numel=4096)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_tensorize_equivalent(dense, example_inputs, config=FULL, dtype=torch.float64, **kwargs):
    """tensorize_ a copy of ``dense`` (built in ``dtype``) in place and compare it with ``dense`` to relative error
    TOL[dtype]; returns (TT model, summary).

    ``example_inputs`` (a tuple, or a dict of keyword inputs) both drive the comparison and go to tensorize_;
    ``capture_inputs=None`` asks for the module scan. Gradients are compared in float64 only: in float32 the
    rounding of the summed-up parameter gradients exceeds the 1e-5 the outputs are held to.
    """
    capture = kwargs.pop("capture_inputs", example_inputs)
    summaries = []
    model = assert_rewrite_equivalent(
        dense,
        lambda m: summaries.append(comera_fx.tensorize_(m, config, example_inputs=capture, **kwargs)),
        example_inputs,
        dtype=dtype,
        graph=False,
        grads=dtype == torch.float64,
        **relative_tolerance(dense, example_inputs, TOL[dtype]),
    )
    return model, summaries[0]


def float_input(dtype, rows=6, width=128, seed=1):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def id_input(vocab=300, shape=(3, 9), seed=2):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


SMALL_MODELS = {
    "mlp": (MLP, lambda dtype: float_input(dtype)),
    "functional": (FunctionalLinear, lambda dtype: float_input(dtype)),
    "matmul": (MatmulModel, lambda dtype: float_input(dtype)),
    "linear_and_matmul": (LinearAndMatmul, lambda dtype: float_input(dtype)),
    "tied": (TiedLM, lambda dtype: id_input()),
    "mixed": (Mixed, lambda dtype: id_input()),
}


def build(name, dtype, seed=0):
    torch.manual_seed(seed)
    cls, make_input = SMALL_MODELS[name]
    dense = cls().to(dtype)
    return dense, make_input(dtype)


# ------------------------------------------------------------------------------------------- small models


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(SMALL_MODELS))
def test_full_rank_matches_dense_model(name, dtype):
    """Outputs; in float64 also gradients w.r.t. the (float) input and the parameters left dense."""
    dense, x = build(name, dtype)
    model, summary = assert_tensorize_equivalent(dense, (x,), dtype=dtype)
    assert summary.method == "dynamo"
    assert [d.fqn for d in summary.converted] == large_2d_parameters(dense, FULL)
    assert summary.converted, "nothing was converted: the comparison would be vacuous"
    with torch.no_grad():
        assert model(x).dtype == dtype
    # the converted dense weights are really gone
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert not names & set(large_2d_parameters(dense, FULL))


def test_module_swaps_and_structure_of_mixed_model():
    dense, x = build("mixed", torch.float64)
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(model, FULL, example_inputs=(x,))
    assert isinstance(model.emb, TTEmbedding) and isinstance(model.head, TTLinear)
    assert model.emb.tt is model.head.tt  # the tied weight is ONE TTMatrix
    assert isinstance(model.fc, TTLinear)
    # raw parameters read functionally become TT matrices behind a reconstructing property
    assert isinstance(model.w_tt, TTMatrix) and isinstance(model.w2_tt, TTMatrix)
    assert "w" not in model._parameters and "w2" not in model._parameters
    assert torch.allclose(model.w, dense.w, rtol=0, atol=1e-12)
    assert torch.allclose(model.w2, dense.w2, rtol=0, atol=1e-12)
    assert torch.allclose(model.head.weight, dense.head.weight, rtol=0, atol=1e-12)
    assert model.b2 is not dense.b2 and torch.equal(model.b2, dense.b2)  # 1-D parameters untouched


def test_tied_embedding_and_head_share_one_tt_matrix():
    dense, ids = build("tied", torch.float64)
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, TensorizeConfig(max_rank=16, min_numel=4096), example_inputs=(ids,))
    assert model.emb.tt is model.head.tt
    tied = next(d for d in summary.layers if d.fqn == "emb.weight")
    assert tied.aliases == ("emb.weight", "head.weight") and tied.kind == "embedding"
    # the TT matrix is counted once by the optimizer's view of the model
    cores = list(model.emb.tt.parameters())
    assert sum(1 for p in model.parameters() if any(p is c for c in cores)) == len(cores)
    # training the head trains the embedding: one set of gradients on the shared cores
    model(ids).sum().backward()
    assert all(c.grad is not None for c in model.emb.tt.cores)
    # and both views read the same weight
    assert torch.allclose(model.head.weight, model.emb.weight, rtol=0, atol=1e-12)


def test_default_config_reduces_the_parameter_count():
    torch.manual_seed(0)
    dense = MLP(256, 512, 256)  # 131,072-element weights: above the default 2**16 threshold
    model = copy.deepcopy(dense)
    x = float_input(torch.float32, width=256)
    summary = comera_fx.tensorize_(model, example_inputs=(x,))
    assert [d.fqn for d in summary.converted] == ["fc1.weight", "fc2.weight"]
    assert all(max(d.ranks) <= 32 for d in summary.converted)
    assert num_params(model) < num_params(dense) / 4
    rep = comera_fx.report(model)
    assert rep.model_params == num_params(model)
    assert rep.dense_model_params == num_params(dense)


def test_state_dict_loads_into_a_copy_built_with_other_ranks():
    dense, ids = build("mixed", torch.float64)
    source = copy.deepcopy(dense)
    comera_fx.tensorize_(source, TensorizeConfig(max_rank=8, min_numel=4096), example_inputs=(ids,))
    # perturb the gates so that loading them matters
    with torch.no_grad():
        for name, p in source.named_parameters():
            if ".gates." in name:
                p.mul_(torch.linspace(0.5, 1.5, p.numel(), dtype=p.dtype))
    target = copy.deepcopy(dense)
    comera_fx.tensorize_(target, TensorizeConfig(max_rank=4, min_numel=4096), example_inputs=(ids,))
    assert max(target.fc.tt.ranks) == 4 and max(source.fc.tt.ranks) == 8
    state = source.state_dict()
    assert set(state) == set(target.state_dict())
    target.load_state_dict(state)
    assert target.fc.tt.ranks == source.fc.tt.ranks
    assert target.emb.tt is target.head.tt and target.emb.tt.ranks == source.emb.tt.ranks
    with torch.no_grad():
        assert torch.equal(target(ids), source(ids))
    # and the loaded model trains: gradients reach every adopted parameter
    target(ids).sum().backward()
    assert all(p.grad is not None for p in target.fc.tt.parameters())


def test_state_dict_loads_into_a_default_config_copy():
    dense, x = build("mlp", torch.float64)
    source = copy.deepcopy(dense)
    comera_fx.tensorize_(source, TensorizeConfig(max_rank=8, min_numel=4096), example_inputs=(x,))
    target = copy.deepcopy(dense)
    comera_fx.tensorize_(target, TensorizeConfig(min_numel=4096), example_inputs=(x,))  # default max_rank 32
    target.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert torch.equal(target(x), source(x))


def test_filter_fn_excluding_a_layer_leaves_it_dense():
    dense, x = build("mlp", torch.float64)
    seen = []

    def keep_fc1_only(module, path):
        seen.append((type(module).__name__, path))
        return path != "fc2"

    model, summary = assert_tensorize_equivalent(dense, (x,), filter_fn=keep_fc1_only)
    assert ("Linear", "fc2") in seen and ("Linear", "fc1") in seen
    assert isinstance(model.fc1, TTLinear)
    assert type(model.fc2) is nn.Linear and torch.equal(model.fc2.weight, dense.fc2.weight)
    decision = next(d for d in summary.layers if d.fqn == "fc2.weight")
    assert not decision.converted and "filter_fn" in decision.reason and "fc2" in decision.reason


def test_filter_fn_must_accept_every_holder_of_a_tied_weight():
    dense, ids = build("tied", torch.float64)
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, FULL, example_inputs=(ids,), filter_fn=lambda m, path: path != "head")
    assert type(model.emb) is nn.Embedding and type(model.head) is nn.Linear
    assert model.emb.weight is model.head.weight  # still tied
    assert "head" in next(d for d in summary.layers if d.fqn == "emb.weight").reason


def test_skip_and_overrides_take_effect():
    torch.manual_seed(0)
    dense = MatmulModel()
    model = copy.deepcopy(dense)
    config = TensorizeConfig(
        max_rank=8,
        min_numel=4096,
        skip=[r"^w_mm$"],
        overrides={r"w_at": {"max_rank": 3}, r"w_method": {"skip": True}, r"w_matmul": {"max_rank": 5, "num_modes": 3}},
    )
    summary = comera_fx.tensorize_(model, config, example_inputs=(float_input(torch.float32),))
    decisions = {d.fqn: d for d in summary.layers}
    assert not decisions["w_mm"].converted and "skip" in decisions["w_mm"].reason
    assert not decisions["w_method"].converted and "skip" in decisions["w_method"].reason
    assert isinstance(model.w_mm, nn.Parameter) and torch.equal(model.w_mm, dense.w_mm)
    assert isinstance(model.w_method, nn.Parameter)
    assert max(model.w_at_tt.ranks) == 3
    assert max(model.w_matmul_tt.ranks) == 5
    assert len(model.w_matmul_tt.row_modes) == 3 and len(model.w_matmul_tt.col_modes) == 3
    assert max(model.w_addmm_tt.ranks) == 8
    assert decisions["w_at"].ranks == model.w_at_tt.ranks


def test_random_init_with_seed_is_deterministic():
    torch.manual_seed(0)
    dense = MLP(256, 512, 256)
    x = float_input(torch.float32, width=256)
    config = TensorizeConfig(init="random", seed=123, max_rank=16, min_numel=4096)
    models = []
    for cfg in (config, config, config.replace(seed=124)):
        m = copy.deepcopy(dense)
        torch.manual_seed(len(models))  # a different global RNG state each time must not matter with a seed
        comera_fx.tensorize_(m, cfg, example_inputs=(x,))
        models.append(m)
    a, b, c = (dict(m.state_dict()) for m in models)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if ".cores." in k)
    # random init is not TT-SVD: the weights changed, with the dense default init's scale
    reference_std = nn.Linear(256, 512).weight.std().item()  # U(±1/√256): std 1/√(3·256)
    std = models[0].fc1.weight.std().item()
    assert not torch.allclose(models[0].fc1.weight, dense.fc1.weight, atol=1e-3)
    assert 0.5 * reference_std < std < 2 * reference_std


def test_model_with_nothing_large_is_unchanged():
    torch.manual_seed(0)
    model = Tiny()
    before = copy.deepcopy(model.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    summary = comera_fx.tensorize_(model, example_inputs=(ids,))
    assert summary.converted == []
    assert "nothing converted" in str(summary)
    assert all("size threshold" in d.reason for d in summary.layers)
    assert type(model.fc) is nn.Linear and type(model.emb) is nn.Embedding
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_max_rank_above_feasible_is_clamped_and_noted():
    dense, x = build("mlp", torch.float64)
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, TensorizeConfig(max_rank=500, min_numel=4096), example_inputs=(x,))
    fc1 = next(d for d in summary.layers if d.fqn == "fc1.weight")
    assert any("clamped" in note for note in fc1.notes)
    assert "clamped" in str(summary)
    # the largest bond of a full TT of a 256×128 weight is its matrix rank bound min(256, 128)
    assert max(fc1.ranks) == 128
    capped = copy.deepcopy(dense)
    s2 = comera_fx.tensorize_(capped, TensorizeConfig(max_rank=16, min_numel=4096), example_inputs=(x,))
    assert not any("clamped" in n for d in s2.layers for n in d.notes)


def test_skip_reason_for_non_floating_weights():
    cand = Candidate("w", ("w",), (256, 256), torch.int8, [Use(UseKind.LINEAR, "linear", "linear")])
    reason = skip_reason(cand, TensorizeConfig())
    assert reason is not None and "not floating point" in reason and "int8" in reason
    floating = Candidate("w", ("w",), (256, 256), torch.float16, [Use(UseKind.LINEAR, "linear", "linear")])
    assert skip_reason(floating, TensorizeConfig()) is None


def test_integer_parameter_is_skipped_by_module_scan():
    class IntHolder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)
            self.fc.weight = nn.Parameter(torch.ones(256, 256, dtype=torch.int8), requires_grad=False)

        def forward(self, x):
            return x

    model = IntHolder()
    summary = comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096))
    assert not summary.converted and "not floating point" in summary.layers[0].reason
    assert type(model.fc) is nn.Linear and model.fc.weight.dtype == torch.int8


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_an_error_during_conversion_leaves_the_model_unchanged(monkeypatch, error):
    dense, ids = build("mixed", torch.float64)
    model = copy.deepcopy(dense)
    real = tensorize_module.make_tt_matrix
    calls = []

    def failing_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(tensorize_module, "make_tt_matrix", failing_second_call)
    with pytest.raises(error, match="boom"):
        comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=4096), example_inputs=(ids,))
    assert len(calls) == 2
    assert type(model) is type(dense)
    assert [type(m) for m in model.modules()] == [type(m) for m in dense.modules()]
    assert model.emb.weight is model.head.weight
    expected, actual = dense.state_dict(), model.state_dict()
    assert list(actual) == list(expected)
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    with torch.no_grad():
        assert torch.equal(model(ids), dense(ids))


def test_value_errors_name_the_layer(monkeypatch):
    dense, x = build("mlp", torch.float64)

    def bad(*args, **kwargs):
        raise ValueError("cannot factor")

    monkeypatch.setattr(tensorize_module, "make_tt_matrix", bad)
    with pytest.raises(ValueError, match=r"cannot tensorize fc1\.weight"):
        comera_fx.tensorize_(copy.deepcopy(dense), FULL, example_inputs=(x,))


@pytest.mark.parametrize("padding_idx", [0, 7, -1])
def test_embedding_with_padding_idx_matches_nn_embedding(padding_idx):
    torch.manual_seed(0)
    dense = EmbeddingModel(nn.Embedding(300, 128, padding_idx=padding_idx)).double()
    with torch.no_grad():  # a non-zero padding row: nn.Embedding returns whatever the row holds
        dense.emb.weight[padding_idx] = torch.linspace(-1, 1, 128, dtype=torch.float64)
    pad = padding_idx % 300
    ids = id_input()
    ids[0, :3] = pad
    # outputs, and the gradient of out.weight, which is (TT embedding output)ᵀ · cotangent: pins the lookups too
    full, _ = assert_tensorize_equivalent(dense, (ids,))
    assert isinstance(full.emb, TTEmbedding) and full.emb.padding_idx == pad
    # at a low rank the other rows are approximations, but the padding row stays exact
    low = copy.deepcopy(dense)
    comera_fx.tensorize_(low, TensorizeConfig(max_rank=2, min_numel=4096), example_inputs=(ids,))
    with torch.no_grad():
        out, ref = low.emb(ids), dense.emb(ids)
    assert torch.equal(out[0, :3], ref[0, :3])
    assert not torch.allclose(out[1], ref[1], atol=1e-3)
    # like nn.Embedding, the padding positions pass no gradient to the table
    full.emb(torch.full((4,), pad)).sum().backward()
    assert all(c.grad is None or torch.count_nonzero(c.grad) == 0 for c in full.emb.tt.cores)


def test_embedding_with_max_norm_is_skipped_with_a_reason():
    torch.manual_seed(0)
    model = EmbeddingModel(nn.Embedding(300, 128, max_norm=1.0))
    ids = id_input()
    summary = comera_fx.tensorize_(model, FULL, example_inputs=(ids,))
    decision = next(d for d in summary.layers if d.fqn == "emb.weight")
    assert not decision.converted and "max_norm" in decision.reason
    assert type(model.emb) is nn.Embedding


# ------------------------------------------------------------------------------------------ random models


EXACT = TensorizeConfig(max_rank=10**9, min_numel=1, min_dim=1)  # every weight "large", full rank: exact


def test_functional_linear_called_twice_is_converted_once():
    """One module registered twice (two aliases of its weight) got the TT property attached twice: KeyError."""
    spec = ModelSpec(
        "features",
        11,
        0,
        (BlockSpec("functional_linear", 11, 11), BlockSpec("shared", 11, 11, source=0)),
        "none",
        0,
        batch=2,
        seq_len=None,
        seed=0,
    )
    model, x = build_model(spec), make_example_input(spec)
    assert_rewrite_equivalent(model, lambda m: comera_fx.tensorize_(m, EXACT, example_inputs=(x,)), (x,), graph=False)


@given(case=strategies.models(num_inputs=2), capture=st.booleans())
def test_full_rank_tensorize_of_random_models_equals_the_dense_model(case, capture):
    """Any random model (ties, shared blocks, F.linear on raw parameters, awkward sizes and layouts), tensorized at
    full rank by module scan or by Dynamo capture, computes what the dense model computes: outputs, gradients
    w.r.t. inputs and every parameter left dense, on the capture's input and on another batch."""
    model, example_inputs = case
    summaries = []

    def rewrite(m: nn.Module) -> None:
        summaries.append(comera_fx.tensorize_(m, EXACT, example_inputs=example_inputs if capture else None))

    rewritten = assert_rewrite_equivalent(model, rewrite, example_inputs, graph=False, extra_inputs=case.more_inputs)
    summary = summaries[0]
    assert summary.method == ("dynamo" if capture else "module-scan"), summary  # no silent fallback
    assert all(d.reason for d in summary.skipped), summary
    # one TT matrix per converted weight (a tied weight is one decision), and no converted weight left dense
    assert len({id(m) for m in rewritten.modules() if isinstance(m, TTMatrix)}) == len(summary.converted), summary
    dense_left = dict(rewritten.named_parameters(remove_duplicate=False))
    assert not [d.fqn for d in summary.converted if d.fqn in dense_left], summary


# ---------------------------------------------------------------------------------- transformers models


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval()


def hf_ids():
    return id_input(1000, (2, 16), seed=3)


def hf_out(name, model, **inputs):
    out = model(**inputs)
    return out.logits if name == "gpt2" else out.last_hidden_state


def hf_inputs(name, **inputs):
    """Keyword inputs for assert_rewrite_equivalent. GPT-2 without its KV cache: a DynamicCache is no pytree node,
    so the toolkit would compare the two models' caches with ``==`` (identity) and report a difference."""
    return inputs | {"use_cache": False} if name == "gpt2" else inputs


HF = {"gpt2": tiny_gpt2, "bert": tiny_bert}


@pytest.fixture(scope="module", params=list(HF))
def hf_full_f64(request):
    """(name, dense float64 model, full-rank TT copy captured with Dynamo, summary): built once per model."""
    name = request.param
    dense = HF[name]().double()
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, FULL, example_inputs={"input_ids": hf_ids()})
    return name, dense, model, summary


def fixture_result(model):
    """The fixture's tensorize_ result as the rewrite: the Dynamo capture of an HF model is done once per model."""
    return lambda _copy: model


def test_hf_full_rank_float64_outputs_match(hf_full_f64):
    name, dense, model, summary = hf_full_f64
    assert summary.method == "dynamo"
    assert [d.fqn for d in summary.converted] == large_2d_parameters(dense, FULL)
    ids = hf_ids()
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    other = id_input(1000, (3, 40), seed=9)  # another batch and length than the capture's
    for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}, {"input_ids": other}):
        inputs = hf_inputs(name, **inputs)
        assert_rewrite_equivalent(
            dense, fixture_result(model), inputs, grads=False, graph=False, **relative_tolerance(dense, inputs, 1e-10)
        )


def test_hf_full_rank_float64_gradients_match(hf_full_f64):
    """Outputs and gradients w.r.t. inputs_embeds and every parameter left dense (LayerNorms, biases, ...)."""
    name, dense, model, _ = hf_full_f64
    inputs = hf_inputs(
        name, inputs_embeds=torch.randn(2, 12, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    )
    assert_rewrite_equivalent(
        dense, fixture_result(model), inputs, graph=False, **relative_tolerance(dense, inputs, 1e-10)
    )


def test_hf_modules_were_swapped(hf_full_f64):
    name, dense, model, summary = hf_full_f64
    if name == "gpt2":
        assert isinstance(model.transformer.wte, TTEmbedding) and isinstance(model.lm_head, TTLinear)
        assert model.lm_head.tt is model.transformer.wte.tt  # tied input/output embedding: one TT matrix
        assert isinstance(model.transformer.h[0].mlp.c_fc, TTLinear)  # transformers' Conv1D (addmm)
        tied = next(d for d in summary.layers if d.fqn == "transformer.wte.weight")
        assert set(tied.aliases) == {"transformer.wte.weight", "lm_head.weight"}
    else:
        assert isinstance(model.embeddings.word_embeddings, TTEmbedding)
        assert isinstance(model.encoder.layer[0].attention.self.query, TTLinear)
        assert type(model.embeddings.token_type_embeddings) is nn.Embedding  # 2 × 128: below the threshold


@pytest.mark.parametrize("name", list(HF))
def test_hf_full_rank_float32_outputs_match(name):
    dense = HF[name]()
    # module scan (no example inputs to tensorize_): no second Dynamo capture needed here
    _, summary = assert_tensorize_equivalent(
        dense, hf_inputs(name, input_ids=hf_ids()), dtype=torch.float32, capture_inputs=None
    )
    assert summary.method == "module-scan"
    assert [d.fqn for d in summary.converted] == large_2d_parameters(dense, FULL)


@pytest.mark.parametrize("name", list(HF))
def test_hf_default_config_reduces_parameters(name):
    dense = HF[name]()
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model)
    assert [d.fqn for d in summary.converted] == large_2d_parameters(dense, TensorizeConfig())
    assert num_params(model) < 0.6 * num_params(dense)
    rep = comera_fx.report(model)
    assert rep.model_params == num_params(model) and rep.dense_model_params == num_params(dense)
    with torch.no_grad():  # rank 32 approximates random weights, but the model still runs end to end
        out = hf_out(name, model, input_ids=hf_ids())
    assert out.shape == hf_out(name, dense, input_ids=hf_ids()).shape and torch.isfinite(out).all()


def test_symbolic_trace_of_a_model_with_a_reconstructed_weight():
    """``fx.symbolic_trace`` hands out proxies for parameters; TTMatrix read its ranks from them and raised a
    TraceError ("symbolically traced variables cannot be used as inputs to control flow")."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 16, dtype=torch.float64))

        def forward(self, x):
            return F.linear(x, self.w)

    model = Functional()
    x = torch.randn(4, 16, dtype=torch.float64)
    expected = model(x)
    comera_fx.tensorize_(model, EXACT, example_inputs=(x,))
    traced = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(traced(x), expected)
