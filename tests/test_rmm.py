"""RMM (randomized backward): exactness where it must be exact, unbiasedness and variance of the estimates, the
memory it saves, seeds, entry points and refusals. References: exact autograd in float64 and dense algebra."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx.rmm import rmm_linear, rmm_tt_product, sketch_matrix
from comera_fx.rmm.sketch import _hadamard_selected, hadamard_rows
from comera_fx.testing import strategies
from helpers_models import assert_bf16_autocast_grads_close, tt_dense_reference

SKETCHES = ("gaussian", "rademacher", "srht")


class Block(nn.Module):
    """A pre-norm transformer block: Q, K and V read one tensor, so their sketches can be shared."""

    def __init__(self, d: int = 32, heads: int = 4, ff: int = 64):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).reshape(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class QKV(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)


def _block(dtype=torch.float64, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block().to(dtype)


def _saved_activation_bytes(model: nn.Module, fn) -> int:
    """Bytes of the unique storages autograd keeps for backward, parameters excluded (they live anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# -- exact where it must be ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sketch", SKETCHES)
def test_forward_input_and_other_gradients_are_exact_on_a_transformer_block(sketch):
    exact = _block()
    randomized = copy.deepcopy(exact)
    summary = comera_fx.randomize_backward_(randomized, rho=0.25, sketch=sketch, min_numel=0)
    assert len(summary.randomized) == 6
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    dy = torch.randn(2, 12, 32, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_exact, y_rmm = exact(x1), randomized(x2)
    assert torch.equal(y_exact, y_rmm)
    y_exact.backward(dy)
    y_rmm.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    weights = {f"{n}.weight" for n in ("q", "k", "v", "o", "up", "down")}
    for (name, p_exact), (_, p_rmm) in zip(exact.named_parameters(), randomized.named_parameters()):
        if name in weights:
            assert p_rmm.grad.shape == p_exact.grad.shape
            assert not torch.allclose(p_rmm.grad, p_exact.grad)  # an estimate, not the exact gradient
        else:  # biases and LayerNorm parameters
            torch.testing.assert_close(p_rmm.grad, p_exact.grad, rtol=1e-12, atol=1e-12)


# Leading shapes with a token axis (RMM refuses an input without one), empty ones included; any rho in (0, 1].
TOKEN_SHAPES = st.lists(st.integers(0, 9), min_size=1, max_size=2).map(tuple)
RHOS = st.one_of(st.sampled_from([1.0, 0.5, 0.25]), st.floats(0.01, 1.0))


def _cotangent(y: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


ONE_THREAD = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # not reset per example: fine


@ONE_THREAD
@given(
    d_in=st.integers(1, 20),
    d_out=st.integers(1, 20),
    bias=st.booleans(),
    rho=RHOS,
    sketch=st.sampled_from(SKETCHES),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_rmm_linear_forward_input_and_bias_gradients_are_exact_on_drawn_shapes(
    d_in, d_out, bias, rho, sketch, seed, data, one_thread
):
    """Against dense float64 algebra: y = x Wᵀ + b, dX = dY W, db = Σ dY over tokens; dW has W's shape and is
    finite. Inputs in any memory layout (strided, transposed, expanded)."""
    g = torch.Generator().manual_seed(seed)
    x = data.draw(strategies.float_tensors(d_in, batch_shapes=TOKEN_SHAPES), label="x").requires_grad_()
    weight = torch.randn(d_out, d_in, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(d_out, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    y = rmm_linear(x, weight, b, rho=rho, sketch=sketch)
    dy = _cotangent(y, seed + 1)
    y.backward(dy)
    w = weight.detach()
    expected = x.detach() @ w.t() + (b.detach() if bias else 0)
    torch.testing.assert_close(y.detach(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dy @ w, rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(b.grad, dy.reshape(-1, d_out).sum(0), rtol=1e-12, atol=1e-12)
    assert weight.grad.shape == weight.shape and torch.isfinite(weight.grad).all()


@ONE_THREAD
@given(
    spec=strategies.tt_specs(max_modes=3, max_rank=4),
    transposed=st.booleans(),
    rho=RHOS,
    sketch=st.sampled_from(SKETCHES),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_rmm_tt_product_forward_and_input_gradient_are_exact_on_drawn_matrices(
    spec, transposed, rho, sketch, seed, data, one_thread
):
    """x @ M (or x @ Mᵀ) of a drawn TT matrix (TT or TTM, padded sizes, dead gates) and its dX, against M built by
    opt_einsum in float64; the core and gate gradients have their parameters' shapes and are finite."""
    tt = spec.matrix()
    x = data.draw(
        strategies.tt_inputs(tt.layout, side="cols" if transposed else "rows", batch_shapes=TOKEN_SHAPES), label="x"
    ).requires_grad_()
    y = rmm_tt_product(x, tt, transposed=transposed, rho=rho, sketch=sketch)
    dy = _cotangent(y, seed)
    y.backward(dy)
    matrix = tt_dense_reference(tt)
    matrix = matrix.t() if transposed else matrix
    torch.testing.assert_close(y.detach(), x.detach() @ matrix, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, dy @ matrix.t(), rtol=1e-10, atol=1e-10)
    for p in tt.parameters():
        assert p.grad is None or (p.grad.shape == p.shape and torch.isfinite(p.grad).all())


def test_sketch_matrices_have_identity_second_moment_and_srht_at_rho_one_is_orthogonal(one_thread):
    for kind in SKETCHES:
        total = torch.zeros(12, 12, dtype=torch.float64)
        n = 3000
        for i in range(n):
            s = sketch_matrix(torch.tensor(i), 12, 3, kind)
            assert s.shape == (3, 12)
            total += s.t() @ s
        # E[SᵀS] = I; each entry's Monte-Carlo error is about sqrt(2 / (rows·n)) ~ 0.015
        assert (total / n - torch.eye(12, dtype=torch.float64)).abs().max() < 0.08, kind
    s = sketch_matrix(torch.tensor(5), 16, 16, "srht")
    torch.testing.assert_close(s.t() @ s, torch.eye(16, dtype=torch.float64))


def _sylvester_reference(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_transforms_match_the_sylvester_matrix():
    n = 256  # hadamard_rows: two factors (64 and 4)
    x = torch.randn(n, 3, dtype=torch.float64)
    torch.testing.assert_close(hadamard_rows(x), _sylvester_reference(n) @ x)
    for n in (512, 2048):  # the two-GEMM path with the signs folded in, rows gathered
        x = torch.randn(n, 3, dtype=torch.float64)
        signs = torch.randint(0, 2, (n,)).double() * 2 - 1
        chosen = torch.randperm(n)[: n // 3]
        expected = (_sylvester_reference(n) @ (signs[:, None] * x))[chosen]
        torch.testing.assert_close(_hadamard_selected(x, chosen, signs), expected)


# -- unbiasedness and variance ------------------------------------------------------------------------------------


def _linear_problem(tokens=64, n_in=6, n_out=5, noise=0.5):
    """x and an output gradient correlated with it, so that xᵀdY is large next to the estimator's spread."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, n_in, dtype=torch.float64, generator=g)
    dy = x @ torch.randn(n_in, n_out, dtype=torch.float64, generator=g) + noise * torch.randn(
        tokens, n_out, dtype=torch.float64, generator=g
    )
    return x, dy


def _weight_gradient_samples(x, dy, rho, sketch, n, scale=1.0):
    weight = torch.zeros(dy.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True)
    torch.manual_seed(0)
    samples = []
    for _ in range(n):
        (grad,) = torch.autograd.grad(rmm_linear(x, weight, rho=rho, sketch=sketch), weight, dy)
        samples.append(grad * scale)
    return torch.stack(samples)


def _bias_in_standard_errors(samples, exact) -> float:
    """‖mean − exact‖² / (total variance / n): about 1 for an unbiased estimator (a sum of squared z-scores over
    the entries divided by their count, up to correlations), far larger for a biased one."""
    n = samples.shape[0]
    err2 = float(((samples.mean(0) - exact) ** 2).sum())
    return err2 / (float(samples.var(0).sum()) / n)


@pytest.mark.parametrize("sketch", SKETCHES)
def test_weight_gradient_is_unbiased_and_a_wrong_scale_is_caught(sketch, one_thread):
    x, dy = _linear_problem()
    exact = dy.t() @ x
    samples = _weight_gradient_samples(x, dy, 0.5, sketch, 1000)
    assert _bias_in_standard_errors(samples, exact) < 4.0
    assert _bias_in_standard_errors(samples * 1.1, exact) > 4.0  # the test can fail: a 10% scale error does


def test_gaussian_variance_matches_the_formula(one_thread):
    x, dy = _linear_problem(n_in=2, n_out=2, noise=0.1)  # few, aligned columns: the cross term is large
    rows = 16  # rho 0.25 of 64 tokens
    samples = _weight_gradient_samples(x, dy, 0.25, "gaussian", 3000)
    measured = float(samples.var(0).sum())
    formula = (float(x.pow(2).sum() * dy.pow(2).sum()) + float((x.t() @ dy).pow(2).sum())) / rows
    assert measured == pytest.approx(formula, rel=0.12)
    without_cross = float(x.pow(2).sum() * dy.pow(2).sum()) / rows
    assert abs(measured - without_cross) / measured > 0.3  # the cross term matters here: the check has teeth


def _tt_problem():
    torch.manual_seed(3)
    tt = comera_fx.TTLinear.from_dense(nn.Linear(8, 6).double(), max_rank=3, row_modes=(2, 4), col_modes=(2, 3))
    x = torch.randn(48, 8, dtype=torch.float64)
    dy = torch.randn(48, 6, dtype=torch.float64)
    return tt, x, dy


@pytest.mark.parametrize("sketch", ("gaussian", "srht"))
def test_tt_core_and_gate_gradients_are_unbiased(sketch, one_thread):
    tt, x, dy = _tt_problem()
    params = list(tt.tt.parameters())
    # Reference: autograd through the dense reconstruction M (no planner, no RMM)
    exact = torch.autograd.grad(x @ tt.tt.dense(), params, dy)
    torch.manual_seed(0)
    samples = [[] for _ in params]
    for _ in range(1000):
        y = rmm_tt_product(x, tt.tt, rho=0.5, sketch=sketch)
        for store, grad in zip(samples, torch.autograd.grad(y, params, dy)):
            store.append(grad)
    stacked = [torch.stack(s) for s in samples]
    flat = torch.cat([s.reshape(len(s), -1) for s in stacked], 1)
    flat_exact = torch.cat([e.reshape(-1) for e in exact])
    assert _bias_in_standard_errors(flat, flat_exact) < 4.0
    assert _bias_in_standard_errors(flat * 1.1, flat_exact) > 4.0


def test_tt_forward_and_input_gradient_are_exact():
    tt, x, dy = _tt_problem()
    comera_fx.randomize_backward_(tt, rho=0.5, min_numel=0)
    x1 = x.clone().requires_grad_()
    y = tt(x1)
    reference = x @ tt.tt.dense() + tt.bias
    torch.testing.assert_close(y, reference, rtol=1e-12, atol=1e-12)
    y.backward(dy)
    torch.testing.assert_close(x1.grad, dy @ tt.tt.dense().t(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tt.bias.grad, dy.sum(0), rtol=1e-12, atol=1e-12)


def test_srht_at_rho_one_gives_the_exact_weight_gradient():
    """S = P·H·D/√B with P a permutation is orthogonal: a backward that regenerated another S would be wrong."""
    for tokens in (32, 512):  # one Hadamard factor; two (the blocked path)
        x, dy = _linear_problem(tokens=tokens)
        for grad in _weight_gradient_samples(x, dy, 1.0, "srht", 2):
            torch.testing.assert_close(grad, dy.t() @ x)


# -- memory ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rho", (0.5, 0.25))
def test_shared_input_is_sketched_once(rho):
    torch.manual_seed(0)
    model = QKV()
    x = torch.randn(4, 32, 64)
    exact = _saved_activation_bytes(model, lambda: model(x))
    assert exact == x.numel() * 4  # exact autograd keeps the shared input once
    comera_fx.randomize_backward_(model, rho=rho, min_numel=0)
    randomized = _saved_activation_bytes(model, lambda: model(x))
    assert randomized <= rho * exact + 64  # one sketch (rho of the tokens) and one 8-byte seed


def test_tt_saved_bytes_per_token_are_rho_times_the_input():
    torch.manual_seed(0)
    layer = comera_fx.TTLinear.from_dense(nn.Linear(256, 256), max_rank=8)

    def per_token():
        sizes = []
        for tokens in (64, 128):
            x = torch.randn(tokens, 256)
            sizes.append(_saved_activation_bytes(layer, lambda: layer(x)))
        return (sizes[1] - sizes[0]) / 64

    exact = per_token()
    assert exact >= 256 * 4  # the planned product keeps at least x
    comera_fx.randomize_backward_(layer, rho=0.25)
    assert per_token() == pytest.approx(0.25 * 256 * 4)


# -- seeds ----------------------------------------------------------------------------------------------------------


def test_each_call_draws_its_own_sketch_and_backward_regenerates_it():
    model = _block()
    comera_fx.randomize_backward_(model, rho=0.25, min_numel=0)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    dy = torch.randn(2, 8, 32, dtype=torch.float64)

    def grads(out):
        return torch.autograd.grad(out, [model.q.weight, model.up.weight], dy)

    torch.manual_seed(11)
    alone = grads(model(x))
    torch.manual_seed(11)
    first, second = model(x), model(x)  # the same input tensor twice: two forward passes, two sketches
    g_second = grads(second)
    g_first = grads(first)
    for a, b in zip(alone, g_first):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(g_first[0], g_second[0])


def test_activation_checkpointing_regenerates_the_same_sketch():
    from torch.utils.checkpoint import checkpoint

    model = _block()
    comera_fx.randomize_backward_(model, rho=0.25, min_numel=0)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    dy = torch.randn(2, 8, 32, dtype=torch.float64)
    torch.manual_seed(5)
    plain = torch.autograd.grad(model(x), list(model.parameters()), dy)
    torch.manual_seed(5)
    recomputed = torch.autograd.grad(checkpoint(model, x, use_reentrant=False), list(model.parameters()), dy)
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eval_mode_and_no_grad_draw_nothing():
    model = _block()
    comera_fx.randomize_backward_(model, rho=0.25, min_numel=0)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    state = torch.get_rng_state()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)
    model.train()
    model(x)
    assert not torch.equal(torch.get_rng_state(), state)  # training does draw: the check above has teeth


# -- entry points ---------------------------------------------------------------------------------------------------


def test_restore_state_dict_pickle_and_deepcopy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), comera_fx.TTLinear.from_dense(nn.Linear(128, 64), max_rank=4))
    params = list(model.parameters())
    keys = list(model.state_dict())
    comera_fx.randomize_backward_(model, rho=0.5, min_numel=0)
    assert [p for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert type(model[0]).__name__ == "RandomizedLinear" and isinstance(model[0], nn.Linear)
    x = torch.randn(16, 64)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        assert type(other[0]) is type(model[0]) and other[2].rmm == model[2].rmm
        torch.testing.assert_close(other(x), model(x))
    assert comera_fx.restore_backward_(model) == 2
    assert type(model[0]) is nn.Linear and type(model[2]) is comera_fx.TTLinear
    assert not hasattr(model[0], "rmm") and list(model.parameters()) == params


def test_summary_filter_min_numel_and_frozen_weights():
    model = _block()
    model.v.weight.requires_grad_(False)
    summary = comera_fx.randomize_backward_(model, rho=0.5, min_numel=0, filter_fn=lambda module, fqn: fqn != "o")
    decisions = {d.fqn: d for d in summary.layers}
    assert {fqn for fqn, d in decisions.items() if d.randomized} == {"q", "k", "up", "down"}
    assert "frozen" in decisions["v"].reason and "filter_fn" in decisions["o"].reason
    assert "randomized" in str(summary) and "frozen" in str(summary)
    report = comera_fx.report(model)
    assert {r.fqn for r in report.randomized} == {"q", "k", "up", "down"}
    assert "rho=0.5" in str(report)
    small = comera_fx.randomize_backward_(_block(), min_numel=2048)  # q..o are 32 x 32, up / down 32 x 64
    assert {d.fqn for d in small.randomized} == {"up", "down"}
    assert "min_numel" in {d.fqn: d for d in small.layers}["q"].reason


@pytest.mark.parametrize("bad", (0, -0.5, 1.5, float("nan"), float("inf"), "0.5", True))
def test_bad_rho_is_refused(bad):
    with pytest.raises(ValueError, match="rho"):
        comera_fx.randomize_backward_(nn.Linear(4, 4), rho=bad)
    with pytest.raises(ValueError, match="rho"):
        rmm_linear(torch.randn(3, 4), nn.Parameter(torch.randn(2, 4)), rho=bad)


def test_bad_sketch_and_missing_token_dimension_are_refused():
    with pytest.raises(ValueError, match="sketch must be one of"):
        comera_fx.randomize_backward_(nn.Linear(4, 4), sketch="dct")
    with pytest.raises(ValueError, match="rmm"):
        comera_fx.BackendConfig(rmm="fast")
    layer = nn.Linear(8, 4)
    comera_fx.randomize_backward_(layer, min_numel=0)
    with pytest.raises(ValueError, match="no token dimension"):
        layer(torch.randn(8))


def test_gpt2_conv1d_and_tied_head_found_through_the_graph():
    import transformers  # a test dependency (pyproject [test]): a missing one fails, never skips

    config = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=300, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 300, (2, 16))
    expected = model(ids).logits
    summary = comera_fx.randomize_backward_(model, rho=0.5, example_inputs=(ids,), min_numel=0)
    kinds = {d.fqn: d.kind for d in summary.randomized}
    assert summary.method == "dynamo"
    assert kinds["transformer.h.0.attn.c_attn"] == "conv1d" and kinds["transformer.h.0.mlp.c_fc"] == "conv1d"
    assert kinds["lm_head"] == "linear"
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected)
    out.loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad.shape == (64, 192)


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16) / 4)
        self.fc = nn.Linear(32, 8)

    def forward(self, x):
        # GELU saves its input, not its output (ReLU would keep fc's input alive anyway, and a sketch beside it
        # would only add memory)
        return self.fc(F.gelu(F.linear(x, self.w)))


def test_functional_use_is_randomized_by_the_model_transform_and_the_graph_pass():
    torch.manual_seed(0)
    model = _Functional().double()
    x = torch.randn(20, 16, dtype=torch.float64)
    summary = comera_fx.randomize_backward_(copy.deepcopy(model), example_inputs=(x,), min_numel=0)
    functional = [d for d in summary.layers if d.kind == "functional"]
    assert [d.fqn for d in functional] == ["w"] and functional[0].randomized  # tests/test_rmm_uses.py: the numbers
    gm = comera_fx.passes.randomize_backward(torch.fx.symbolic_trace(model), rho=0.5, min_numel=0)
    assert gm.meta["comera_fx_rmm_rewritten"] == 2
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = gm(x1), model(x2)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    assert _saved_activation_bytes(gm, lambda: gm(x)) < _saved_activation_bytes(model, lambda: model(x))


# -- compiled ------------------------------------------------------------------------------------------------------


def _assert_matches_reference(compiled, reference, inputs) -> None:
    """Outputs and input gradients equal on every input; parameter gradients (summed over them) at the end."""
    for x in inputs:
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, y_ref = compiled(x1), reference(x2)
        torch.testing.assert_close(y, y_ref)
        y.sum().backward()
        y_ref.sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad)
    for p, q in zip(compiled.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_backend_option_randomizes_dense_linears_with_one_graph_over_token_counts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    reference = copy.deepcopy(model)
    backend = comera_fx.make_backend(
        comera_fx.BackendConfig(rmm=comera_fx.RMMConfig(rho=1.0, sketch="srht", min_numel=0), inductor=False)
    )
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    # powers of two: SRHT at rho 1 is exact, so the weight gradients are checkable
    _assert_matches_reference(compiled, reference, [torch.randn(tokens, 32) for tokens in (16, 32, 64)])
    assert backend.stats.graphs == 1 and backend.stats.rmm_rewritten == 2


def test_compiled_randomized_block_shares_sketches_and_tt_compiles():
    torch.manual_seed(0)
    block = Block()
    comera_fx.randomize_backward_(block, rho=0.5, min_numel=0)
    backend = comera_fx.make_backend(inductor=False)
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for tokens in (8, 12, 20):
        x = torch.randn(2, tokens, 32, requires_grad=True)
        compiled(x).sum().backward()
    assert backend.stats.graphs == 1
    assert backend.stats.sketches_shared == 2  # K and V reuse Q's sketch of the shared LayerNorm output

    layer = comera_fx.TTLinear.from_dense(nn.Linear(64, 48), max_rank=4)
    reference = copy.deepcopy(layer)
    comera_fx.randomize_backward_(layer, rho=1.0, sketch="srht")
    compiled_tt = torch.compile(layer, backend=comera_fx.make_backend(inductor=False), fullgraph=True, dynamic=True)
    _assert_matches_reference(compiled_tt, reference, [torch.randn(tokens, 64) for tokens in (16, 32)])


class _DenseAndTT(nn.Module):
    """A dense and a TT linear on separate inputs: each weight gradient gets its own well-conditioned problem."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.dense = nn.Linear(6, 5).double()
        self.tt = _tt_problem()[0]

    def forward(self, x, z):
        return self.dense(x), self.tt(z)


def check_compiled_rmm_below_rho_one(backend, sketch: str, seeds: int) -> None:
    """The compiled randomized backward at rho 0.5, run once per seed. Against dense float64 algebra: outputs, input
    gradients and bias gradients equal at every seed; the weight, core and gate gradients, averaged over the seeds,
    equal the exact ones within the estimate's spread (and a 10% scale error would not)."""
    model = _DenseAndTT()
    x, dy = _linear_problem()
    _, z, dz = _tt_problem()
    weight, bias = model.dense.weight.detach().clone(), model.dense.bias.detach().clone()
    tt_params = list(model.tt.tt.parameters())
    exact_tt = torch.autograd.grad(z @ model.tt.tt.dense(), tt_params, dz)  # through the reconstruction M
    matrix = model.tt.tt.dense().detach()
    expected = {
        "y": x @ weight.t() + bias,
        "dx": dy @ weight,
        "db": dy.sum(0),
        "y_tt": z @ matrix + model.tt.bias.detach(),
        "dz": dz @ matrix.t(),
        "db_tt": dz.sum(0),
    }
    exact = torch.cat([(dy.t() @ x).reshape(-1)] + [g.reshape(-1) for g in exact_tt])
    comera_fx.randomize_backward_(model, rho=0.5, sketch=sketch, min_numel=0)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    samples = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        x1, z1 = x.clone().requires_grad_(), z.clone().requires_grad_()
        y, y_tt = compiled(x1, z1)
        torch.autograd.backward((y, y_tt), (dy, dz))
        got = {
            "y": y,
            "dx": x1.grad,
            "db": model.dense.bias.grad,
            "y_tt": y_tt,
            "dz": z1.grad,
            "db_tt": model.tt.bias.grad,
        }
        for name, value in expected.items():
            torch.testing.assert_close(got[name].detach(), value, rtol=1e-10, atol=1e-10, msg=name)
        samples.append(torch.cat([model.dense.weight.grad.reshape(-1)] + [p.grad.reshape(-1) for p in tt_params]))
        model.zero_grad(set_to_none=True)
    samples = torch.stack(samples)
    assert not torch.allclose(samples[0], samples[1])  # each call draws its own sketch
    assert _bias_in_standard_errors(samples, exact) < 4.0
    assert _bias_in_standard_errors(samples * 1.1, exact) > 4.0


# 300 seeds tell the true mean from a 10% scale error by a wide margin (the statistic ~1 against ~10 for Gaussian
# sketches, ~20 for SRHT) at ~10 s here; the slow suite runs SRHT and Inductor at 1000.
def test_compiled_randomized_backward_below_rho_one(one_thread):
    """The backend without Inductor (AOTAutograd's graphs run as captured): one compile, 300 calls."""
    torch._dynamo.reset()
    check_compiled_rmm_below_rho_one(comera_fx.make_backend(inductor=False), "gaussian", seeds=300)


@pytest.mark.slow
@pytest.mark.parametrize("sketch, inductor", [("srht", False), ("gaussian", True)])
def test_compiled_randomized_backward_below_rho_one_thoroughly(sketch, inductor, one_thread):
    torch._dynamo.reset()
    check_compiled_rmm_below_rho_one(comera_fx.make_backend(inductor=inductor), sketch, seeds=1000)


def test_inductor_compiles_the_randomized_backward():
    torch.manual_seed(0)
    model = QKV(32)
    reference = copy.deepcopy(model)
    comera_fx.randomize_backward_(model, rho=1.0, sketch="srht", min_numel=0)
    compiled = torch.compile(model, backend=comera_fx.backend, fullgraph=True)
    x = torch.randn(2, 16, 32)
    y, y_ref = compiled(x), reference(x)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


# -- recomputation options ------------------------------------------------------------------------------------------


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


def test_checkpointed_blocks_keep_only_their_inputs_and_match_the_plain_randomized_model():
    torch.manual_seed(0)
    plain = _Stack().double()
    checkpointed = copy.deepcopy(plain)
    comera_fx.randomize_backward_(plain, rho=0.25, min_numel=0)
    summary = comera_fx.randomize_backward_(checkpointed, rho=0.25, min_numel=0, checkpoint=(Block,))
    assert summary.checkpointed == ["blocks.0", "blocks.1"] and "recomputed" in str(summary)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    dy = torch.randn(2, 16, 32, dtype=torch.float64)
    assert _saved_activation_bytes(checkpointed, lambda: checkpointed(x)) == 2 * x.numel() * 8  # two block inputs
    assert _saved_activation_bytes(plain, lambda: plain(x)) > 10 * x.numel() * 8
    torch.manual_seed(1)
    expected = torch.autograd.grad(plain(x), list(plain.parameters()), dy)
    torch.manual_seed(1)
    got = torch.autograd.grad(checkpointed(x), list(checkpointed.parameters()), dy)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    buffer = io.BytesIO()
    torch.save(checkpointed, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False).blocks[0]).__name__ == "CheckpointedBlock"
    assert comera_fx.restore_backward_(checkpointed) == 2 + 12
    assert all(type(b) is Block for b in checkpointed.blocks) and type(checkpointed.blocks[0].q) is nn.Linear


def test_backend_activation_memory_budget_recomputes_in_backward():
    saved = {}
    for budget in (None, 0.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Block()
        compiled = torch.compile(model, backend=comera_fx.make_backend(inductor=False, activation_memory_budget=budget))
        x = torch.randn(4, 16, 32)
        saved[budget] = _saved_activation_bytes(model, lambda: compiled(x))
    assert saved[0.0] < saved[None] / 4
    with pytest.raises(ValueError, match="activation_memory_budget"):
        comera_fx.BackendConfig(activation_memory_budget=1.5)


def test_cpu_autocast_bf16_matches_float32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), comera_fx.TTLinear.from_dense(nn.Linear(128, 64), max_rank=4))
    reference = copy.deepcopy(model)
    comera_fx.randomize_backward_(model, rho=1.0, sketch="srht", min_numel=0)  # exact at rho 1: comparable
    assert_bf16_autocast_grads_close(model, reference, torch.randn(32, 64))


def test_a_checkpointed_randomized_layer_pickles_and_restores():
    """A swap over a swap: the made class names its whole chain (Linear, Randomized, Checkpointed) to pickle."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    comera_fx.randomize_backward_(model, min_numel=0, checkpoint=(nn.Linear,))
    assert type(model[0]).__name__ == "CheckpointedRandomizedLinear"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[0]) is type(model[0])
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model(x))
    assert comera_fx.restore_backward_(loaded) == 4 and [type(m) for m in loaded] == [nn.Linear, nn.GELU, nn.Linear]
