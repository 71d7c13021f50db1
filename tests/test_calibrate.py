"""comera_fx.calibrate (input second moments) and tensorize_ with a calibration, against dense float64 references."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx import Calibration, TensorizeConfig

from helpers_models import Anisotropic


def make_batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, 128, generator=g) for _ in range(n)]


def test_second_moments_match_the_inputs():
    torch.manual_seed(0)
    model = Anisotropic()
    batches = make_batches()
    cal = comera_fx.calibrate(model, batches, config=TensorizeConfig(min_numel=1000))
    assert set(cal) == {"net.fc1.weight", "net.fc2.weight"}
    with torch.no_grad():
        x1 = torch.cat([(b @ model.mix.T).reshape(-1, 128) for b in batches]).double()
        x2 = torch.tanh(model.net.fc1(x1.float())).double()
    for fqn, x in (("net.fc1.weight", x1), ("net.fc2.weight", x2)):
        stats = cal[fqn]
        assert stats.tokens == x.shape[0] == 4 * 16 * 8
        assert stats.second_moment.dtype == torch.float64
        torch.testing.assert_close(stats.second_moment, x.T @ x / x.shape[0], rtol=1e-5, atol=1e-7)


class TwoLayers(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x, attention_mask=None):  # the mask is for calibrate's token_mask only
        return self.fc2(torch.tanh(self.fc1(x)))


BATCH_SHAPES = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5)), min_size=1, max_size=3)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # one thread for the test: not per example
@given(
    sizes=st.tuples(*[st.integers(1, 24)] * 3),
    shapes=BATCH_SHAPES,
    masked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_second_moments_of_drawn_batches_equal_a_float64_reference(sizes, shapes, masked, seed, one_thread):
    """Drawn widths and (batch, seq) shapes, with or without a token mask (padding rows, sometimes all of a batch's
    or all of them): each layer's C = XᵀX / n over its real input rows, X built here in float64 (the second layer's
    from the first layer applied to those rows). A layer that saw no real row has no entry."""
    d_in, hidden, d_out = sizes
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TwoLayers(d_in, hidden, d_out)
    batches = [
        {"x": torch.randn(b, t, d_in, generator=g), "attention_mask": (torch.rand(b, t, generator=g) < 0.6).long()}
        for b, t in shapes
    ]
    cal = comera_fx.calibrate(
        model,
        batches,
        config=TensorizeConfig(min_numel=1, min_dim=1),
        token_mask=(lambda batch: batch["attention_mask"]) if masked else None,
    )
    rows = torch.cat([b["x"][b["attention_mask"].bool()] if masked else b["x"].reshape(-1, d_in) for b in batches])
    with torch.no_grad():
        inputs = {"fc1.weight": rows.double(), "fc2.weight": torch.tanh(model.fc1(rows)).double()}
    assert cal.batches == len(shapes)
    for fqn, x in inputs.items():
        if x.shape[0] == 0:
            assert fqn not in cal
            continue
        assert cal[fqn].tokens == x.shape[0]
        torch.testing.assert_close(cal[fqn].second_moment, x.T @ x / x.shape[0], rtol=1e-5, atol=1e-6)


class SharedInput(nn.Module):
    """q and k read the same tensor (one XᵀX is shared), v reads another of the same shape and address pattern."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(128, 512), nn.Linear(128, 512), nn.Linear(128, 512)

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(torch.tanh(x))


def test_layers_sharing_an_input_get_the_right_moments():
    model = SharedInput()
    batches = make_batches(3)
    cal = comera_fx.calibrate(model, batches)
    x = torch.cat([b.reshape(-1, 128) for b in batches]).double()
    for fqn, inputs in (("q.weight", x), ("k.weight", x), ("v.weight", torch.tanh(x))):
        torch.testing.assert_close(cal[fqn].second_moment, inputs.T @ inputs / x.shape[0], rtol=1e-5, atol=1e-7)
        assert cal[fqn].tokens == x.shape[0]


def test_calibrate_leaves_the_model_and_rng_alone():
    model = nn.Sequential(nn.Linear(128, 512), nn.Dropout(0.5), nn.Linear(512, 128))
    model.train()
    model[2].eval()  # a mixed state must come back exactly
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    reference = torch.rand(3)
    torch.manual_seed(7)
    comera_fx.calibrate(model, lambda: torch.randn(4, 128), max_batches=3)  # the batches draw from the global RNG
    assert torch.equal(torch.rand(3), reference)
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules())


def test_batch_forms_and_max_batches():
    model = nn.Sequential(nn.Linear(128, 512))
    x = torch.randn(6, 128)
    as_tensor = comera_fx.calibrate(model, [x, x, x], max_batches=2)
    assert as_tensor.batches == 2 and as_tensor["0.weight"].tokens == 12
    as_tuple = comera_fx.calibrate(model, [(x,)])
    as_dict = comera_fx.calibrate(model, [{"input": x}])
    as_callable = comera_fx.calibrate(model, lambda: x, max_batches=3)
    for cal in (as_tuple, as_dict, as_callable):
        torch.testing.assert_close(cal["0.weight"].second_moment, as_tensor["0.weight"].second_moment)
    with pytest.raises(ValueError, match="no batches"):
        comera_fx.calibrate(model, [])
    with pytest.raises(ValueError, match="max_batches"):
        comera_fx.calibrate(model, [x], max_batches=0)
    skipped = comera_fx.calibrate(model, [x], filter_fn=lambda module, name: name != "0")
    assert len(skipped) == 0


def test_calibration_saves_and_loads(tmp_path):
    model = nn.Sequential(nn.Linear(128, 512))
    cal = comera_fx.calibrate(model, [torch.randn(5, 128)])
    cal.save(tmp_path / "cal.pt")
    back = Calibration.load(tmp_path / "cal.pt")
    torch.save(cal, tmp_path / "pickled.pt")
    pickled = torch.load(tmp_path / "pickled.pt", weights_only=False)
    for other in (back, pickled):
        assert list(other) == list(cal) and other["0.weight"].tokens == 5
        assert torch.equal(other["0.weight"].second_moment, cal["0.weight"].second_moment)


def output_error(model, dense_weights, batches):
    """sum over converted layers of ||X (W - Ŵ)ᵀ||_F², X each layer's real inputs in the *dense* model (float64)."""
    cal = comera_fx.calibrate(dense_weights["model"], batches, config=TensorizeConfig(min_numel=1000))
    total = 0.0
    for fqn, stats in cal.items():
        w = dense_weights[fqn].double()
        w_hat = model.get_submodule(fqn.rpartition(".")[0]).weight.detach().double()
        e = w - w_hat
        total += float(torch.einsum("oi,ij,oj->", e, stats.second_moment, e))
    return total


@pytest.mark.parametrize("budget", [None, 0.3])
def test_tensorize_with_calibration_lowers_the_output_error(budget):
    torch.manual_seed(0)
    dense = Anisotropic()
    weights = {"model": dense, **{k: v.clone() for k, v in dense.state_dict().items()}}
    batches = make_batches()
    cal = comera_fx.calibrate(dense, batches, config=TensorizeConfig(min_numel=1000))
    config = TensorizeConfig(max_rank=8, min_numel=1000, size_target=budget)
    errors, ranks = {}, {}
    for name, calibration in (("plain", None), ("whitened", cal)):
        model = Anisotropic()
        model.load_state_dict(dense.state_dict())
        summary = comera_fx.tensorize_(model, config, calibration=calibration)
        errors[name] = output_error(model, weights, batches)
        ranks[name] = summary.ranks
        notes = [n for d in summary.converted for n in d.notes]
        assert any("activation-aware" in n for n in notes) == (calibration is not None)
    assert ranks["plain"] == ranks["whitened"]  # the same parameters...
    assert errors["whitened"] < 0.7 * errors["plain"]  # ...and a clearly smaller error on real inputs


def test_one_mode_per_side_is_the_whitened_low_rank_optimum():
    """num_modes=1: two cores per weight, a rank-r matrix; with a calibration that matrix must be SVD-LLM's
    optimum of the weighted error tr(E C Eᵀ), computed here from a Cholesky factor of C."""
    torch.manual_seed(0)
    dense = Anisotropic()
    weights = {k: v.clone().double() for k, v in dense.state_dict().items()}
    cal = comera_fx.calibrate(dense, make_batches(), config=TensorizeConfig(min_numel=1000))
    rank = 6
    model = Anisotropic()
    model.load_state_dict(dense.state_dict())
    comera_fx.tensorize_(model, TensorizeConfig(num_modes=1, max_rank=rank, min_numel=1000), calibration=cal)
    for fqn, stats in cal.items():
        layer = model.get_submodule(fqn.rpartition(".")[0])
        assert len(layer.tt.cores) == 2 and layer.tt.cores[0].shape[-1] == rank  # one bond: a rank-6 matrix
        w, c = weights[fqn], stats.second_moment
        chol = torch.linalg.cholesky(c)  # C = L Lᵀ: tr(E C Eᵀ) = ||E L||²
        u, s, vh = torch.linalg.svd(w @ chol)
        best = torch.linalg.solve_triangular(chol, (u[:, :rank] * s[:rank]) @ vh[:rank], upper=False, left=False)
        e_best, e_tt = w - best, w - layer.weight.detach().double()
        optimum = float(torch.einsum("oi,ij,oj->", e_best, c, e_best))
        reached = float(torch.einsum("oi,ij,oj->", e_tt, c, e_tt))
        assert reached == pytest.approx(optimum, rel=1e-3), fqn


def test_calibration_of_another_model_is_refused():
    cal = comera_fx.calibrate(nn.Sequential(nn.Linear(256, 512)), [torch.randn(3, 256)])
    model = nn.Sequential(nn.Linear(128, 512))
    with pytest.raises(ValueError, match="256 input features"):
        comera_fx.tensorize_(model, TensorizeConfig(), calibration=cal)
    with pytest.raises(ValueError, match="rel_tol"):
        comera_fx.tensorize_(model, TensorizeConfig(rel_tol=0.1), calibration={})


def test_small_bert_keys_match_tensorize():
    """The FQNs calibrate records are the ones tensorize_ reports: every linear weight is whitened."""
    config = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=500,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    batches = [{"input_ids": torch.randint(0, 500, (2, 16))} for _ in range(2)]
    cal = comera_fx.calibrate(model, batches, config=TensorizeConfig(min_numel=10_000))
    summary = comera_fx.tensorize_(
        model, TensorizeConfig(min_numel=10_000, size_target=0.3, allocation="energy"), calibration=cal
    )
    linear = [d for d in summary.converted if d.kind == "linear"]
    assert {d.fqn for d in linear} == set(cal) and len(linear) == 7  # q, k, v, o, ff in/out, pooler
    assert all(any("activation-aware" in n for n in d.notes) for d in linear)
    assert summary.size_target.reached <= summary.size_target.asked
    with torch.no_grad():
        out = model(**batches[0]).last_hidden_state
    assert torch.isfinite(out).all()


def test_tokenizer_batch_encodings_are_keyword_inputs():
    """A tokenizer's output (BatchEncoding: a Mapping, not a dict) is called as keyword inputs, like a dict."""
    config = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=256,
        vocab_size=100,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    plain = {"input_ids": torch.randint(0, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    encoded = transformers.BatchEncoding(plain)
    assert not isinstance(encoded, dict)
    config = TensorizeConfig(min_numel=10_000)
    want = comera_fx.calibrate(model, [plain], config=config)
    got = comera_fx.calibrate(model, [encoded], config=config)
    assert set(got) == set(want) and len(want) > 0
    for fqn in want:
        assert torch.equal(got[fqn].second_moment, want[fqn].second_moment)


def test_gpt2_conv1d_inputs_are_recorded():
    """transformers' Conv1D (y = x W + b, W stored in × out): its inputs are recorded and its weight whitened."""
    config = transformers.GPT2Config(n_layer=1, n_embd=128, n_head=4, vocab_size=300, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 300, (2, 12))
    cal = comera_fx.calibrate(model, [ids], config=TensorizeConfig(min_numel=10_000))
    assert set(cal) == {f"transformer.h.0.{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    with torch.no_grad():
        hidden = model.transformer.h[0].ln_1(model.transformer.wte(ids) + model.transformer.wpe(torch.arange(12)))
    x = hidden.reshape(-1, 128).double()  # the input of c_attn: ln_1 of the embeddings
    torch.testing.assert_close(
        cal["transformer.h.0.attn.c_attn.weight"].second_moment, x.T @ x / 24, rtol=1e-5, atol=1e-7
    )
    summary = comera_fx.tensorize_(model, TensorizeConfig(min_numel=10_000, max_rank=8), calibration=cal)
    whitened = {d.fqn for d in summary.converted if any("activation-aware" in n for n in d.notes)}
    assert whitened == set(cal)
