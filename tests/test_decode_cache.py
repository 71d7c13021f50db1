"""The cached merged forms of TT and TTM matrices for eager no-grad products and lookups (decoding): equal to the
dense matrix, rebuilt whenever the cores change, never used under autograd or a compiler, never saved."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera_fx
from comera_fx.runtime.shrink import shrink_
from comera_fx.testing.strategies import batch_shapes, index_tensors, tt_inputs, tt_specs
from comera_fx.tt import TTFormat, TTLayout, TTMatrix, merged, ops
from comera_fx.tt.decompose import random_tt_cores
from helpers_models import tt_dense_reference

FULL = comera_fx.TensorizeConfig(min_numel=1, min_dim=1, max_rank=None)


def tt_linear(seed=0, rows=48, cols=40):
    """A full-rank TT copy of a float64 nn.Linear, and the dense layer it equals."""
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(rows, cols)).double()
    model = copy.deepcopy(dense)
    assert comera_fx.tensorize_(model, FULL).converted
    return model, dense


def matrix_of(model):
    return next(m for m in model.modules() if isinstance(m, comera_fx.TTMatrix))


def test_no_grad_decode_uses_the_cache_and_equals_the_dense_layer():
    model, dense = tt_linear()
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
        first = matrix_of(model).__dict__.get("_merged")
        model(x)
        again = matrix_of(model).__dict__.get("_merged")
    assert first is not None and again is first, "the second call should reuse the cached factors"
    torch.testing.assert_close(y, dense(x).detach(), rtol=1e-10, atol=1e-10)


def test_tied_head_product_uses_the_cache_too():
    tt = matrix_of(tt_linear()[0])
    x = torch.randn(2, 40, dtype=torch.float64)
    reference = x @ tt.dense().detach().T  # the grad path builds M; the product below runs the cached factors
    with torch.no_grad():
        got = tt.matmul_t(x)
    assert "_merged" in tt.__dict__
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)


def test_an_optimizer_step_a_load_and_a_shrink_each_make_new_factors():
    model, _ = tt_linear()
    x = torch.randn(4, 48, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def assert_matches_the_planned_product():
        with torch.no_grad():
            got = model(x)
        expected = model(x).detach()  # grad enabled: the planned contraction, no cache
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)

    assert_matches_the_planned_product()
    model(x).pow(2).sum().backward()
    optimizer.step()
    assert_matches_the_planned_product()
    other, _ = tt_linear(seed=1)
    model.load_state_dict(other.state_dict())
    assert_matches_the_planned_product()
    tt = matrix_of(model)
    with torch.no_grad():
        tt.gates[0][0] = 0.0
    assert_matches_the_planned_product()  # a gate written in place
    assert shrink_(tt) is not None
    assert_matches_the_planned_product()


def test_grad_mode_large_batches_and_the_switch_leave_the_cache_alone(monkeypatch):
    model, dense = tt_linear()
    x = torch.randn(2, 48, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert "_merged" not in matrix_of(model).__dict__ and x.grad is not None
    with torch.no_grad():
        model(torch.randn(merged.MERGED_MAX_TOKENS + 1, 48, dtype=torch.float64))
    assert "_merged" not in matrix_of(model).__dict__
    monkeypatch.setattr(merged, "USE_MERGED_FORMS", False)
    with torch.no_grad():
        model(x)
    assert "_merged" not in matrix_of(model).__dict__


def test_the_cache_is_not_copied_saved_or_compiled(tmp_path):
    model, dense = tt_linear()
    x = torch.randn(2, 48, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    assert "_merged" in matrix_of(model).__dict__
    assert "_merged" not in matrix_of(copy.deepcopy(model)).__dict__
    assert not any("merged" in key for key in model.state_dict())
    torch.save(model, tmp_path / "m.pt")
    assert "_merged" not in matrix_of(torch.load(tmp_path / "m.pt", weights_only=False)).__dict__
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=comera_fx.make_backend(inductor=False))
    with torch.no_grad():
        y = compiled(x)
    torch.testing.assert_close(y, dense(x).detach(), rtol=1e-10, atol=1e-10)
    assert "_merged" not in matrix_of(compiled).__dict__, "compiled code must not build or read the cache"
    torch._dynamo.reset()


@settings(deadline=None, max_examples=60)
@given(spec=tt_specs(max_modes=4), kind=st.sampled_from(["matmul", "matmul_t", "rows"]), data=st.data())
def test_every_format_and_product_from_the_cache_equals_the_dense_matrix(spec, kind, data):
    """TT and TTM (1–4 modes, padded, pruned gates): each cached product and lookup equals the dense M (float64)."""
    tt = spec.matrix()
    dense = ops.to_dense(ops.gate_cores(spec.cores, spec.gates, spec.layout), spec.layout)  # independent of merged
    if kind == "rows":
        x = data.draw(index_tensors(tt.rows, batch_shapes=batch_shapes(max_side=5)))
        expected = dense[x]
    else:
        x = data.draw(
            tt_inputs(spec.layout, side="rows" if kind == "matmul" else "cols", batch_shapes=batch_shapes(max_side=5))
        )
        expected = x @ (dense if kind == "matmul" else dense.T)
    with torch.no_grad():
        got = tt.take_rows(x) if kind == "rows" else getattr(tt, kind)(x)
    uses_cache = tt.layout.format is TTFormat.TT or tt.layout.n_cores >= 2
    assert (merged.cached_bytes(tt) > 0) == (uses_cache and not tt.stored_empty)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_a_tied_ttm_embedding_and_head_decode_from_the_cache():
    """GPT-2's layout: one TTM matrix serves the token lookup and the output head; both equal the dense table."""
    torch.manual_seed(0)
    vocab, width = 203, 24
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab, bias=False)).double()
    model[1].weight = model[0].weight
    reference = copy.deepcopy(model)
    tokens = torch.tensor([[5, 202, 0]])
    assert comera_fx.tensorize_(model, FULL, example_inputs=(tokens,)).converted
    tt = matrix_of(model)
    assert tt.layout.format is TTFormat.TTM and tt.layout.n_cores >= 2
    with torch.no_grad():
        got = model(tokens)
    assert set(tt.__dict__["_merged"].forms) == {"rows", "matmul_t"}
    assert merged.cached_bytes(tt) > 0
    torch.testing.assert_close(got, reference(tokens).detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["matmul", "matmul_t"])
@pytest.mark.parametrize("row_modes, col_modes", [((2, 3), (5, 2)), ((5, 2), (2, 3)), ((3, 2, 2), (2, 4, 5))])
def test_ttm_products_equal_dense_in_either_order_of_the_halves(row_modes, col_modes, kind):
    """The cheaper half goes first; these shapes make each order the cheaper one for some product."""
    ranks = (1,) + (3,) * (len(row_modes) - 1) + (1,)
    layout = TTLayout(TTFormat.TTM, math.prod(row_modes) - 1, math.prod(col_modes) - 1, row_modes, col_modes, ranks)
    tt = TTMatrix(
        layout,
        random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
    )
    dense = ops.to_dense(list(tt.cores), layout)
    x = torch.randn(4, layout.rows if kind == "matmul" else layout.cols, dtype=torch.float64)
    with torch.no_grad():
        got = getattr(tt, kind)(x)
    torch.testing.assert_close(got, x @ (dense if kind == "matmul" else dense.T), rtol=1e-10, atol=1e-10)


def test_both_orders_of_the_halves_are_covered_above():
    orders = {
        merged._left_half_first(TTLayout(TTFormat.TTM, math.prod(r), math.prod(c), r, c, (1, 3, 1)), kind)
        for r, c in [((2, 3), (5, 2)), ((5, 2), (2, 3))]
        for kind in ("matmul", "matmul_t")
    }
    assert orders == {True, False}


def test_forms_made_under_inference_mode_serve_no_grad_calls_and_leave_training_alone():
    model, dense = tt_linear()
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.inference_mode():
        first = model(x)
    with torch.no_grad():
        second = model(x)  # reads the inference-mode forms
    trained = model(x)
    trained.sum().backward()  # the planned path, with gradients
    for y in (first, second, trained.detach()):
        torch.testing.assert_close(y, dense(x).detach(), rtol=1e-10, atol=1e-10)
    assert all(p.grad is not None for p in matrix_of(model).parameters())


# -- in-place updates that do not bump the version counter ---------------------------------------------------------


def mlp_reference(model, x) -> torch.Tensor:
    """The TT MLP's output from its current parameters, dense and float64 (M by opt_einsum from the cores)."""
    h = x.double()
    for layer in model:
        if isinstance(layer, comera_fx.TTLinear):
            h = h @ tt_dense_reference(layer.tt) + layer.bias.detach().double()
        else:
            h = layer(h)
    return h


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.05, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.05, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_momentum_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}


def tt_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40))
    assert len(comera_fx.tensorize_(model, FULL).converted) == 2
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_decoding_after_each_optimizer_step_serves_the_current_weights(name):
    """Fused steps (transformers' Trainer default) write the cores without bumping ``_version``: the cache must
    still see them. Three rounds of decode, train, decode; every served output equals the float64 reference."""
    model = tt_mlp()
    optimizer = OPTIMIZERS[name](model.parameters())
    x = torch.randn(3, 48)
    for _ in range(3):
        with torch.no_grad():
            before = model(x)
        torch.testing.assert_close(before.double(), mlp_reference(model, x), rtol=1e-4, atol=1e-4)
        model(torch.randn(8, 48)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            after = model(x)
        assert not torch.allclose(after, before, atol=1e-3), "the step should have changed the output"
        torch.testing.assert_close(after.double(), mlp_reference(model, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("write", ["mul", "copy", "gate", "fill_one_value", "swap"])
def test_decoding_after_a_write_through_data_serves_the_current_weights(write):
    """``param.data`` is a new tensor with its own version counter: writes through it leave ``_version`` as is."""
    model = tt_mlp()
    tt = model[0].tt
    x = torch.randn(2, 48)
    with torch.no_grad():
        model(x)
    if write == "mul":
        for p in model.parameters():
            p.data.mul_(2)
    elif write == "copy":
        tt.cores[1].data.copy_(torch.randn_like(tt.cores[1]))
    elif write == "gate":
        tt.gates[0].data[0] = 0.0
    elif write == "swap":  # a new tensor in place of the old: the cache's views of the old storage must not serve
        tt.cores[0].data = tt.cores[0].data * 2
    else:  # the smallest change: one value of one core
        tt.cores[0].data.view(-1)[5] += 1.0
    with torch.no_grad():
        served = model(x)
    torch.testing.assert_close(served.double(), mlp_reference(model, x), rtol=1e-4, atol=1e-4)


def test_a_nan_in_a_core_does_not_rebuild_the_forms_on_every_call():
    """The comparison is bitwise: a NaN equals itself there (``torch.equal`` on floats would say it changed)."""
    model = tt_mlp()
    tt = model[0].tt
    tt.cores[0].data.view(-1)[0] = float("nan")
    with torch.no_grad():
        model(torch.randn(2, 48))
        first = tt.__dict__["_merged"]
        model(torch.randn(2, 48))
    assert tt.__dict__["_merged"] is first


def test_unchanged_cores_keep_their_forms_and_changed_ones_replace_them():
    model = tt_mlp()
    tt = model[0].tt
    x = torch.randn(2, 48)
    with torch.no_grad():
        model(x)
        first = tt.__dict__["_merged"]
        model(x)
        assert tt.__dict__["_merged"] is first
        tt.cores[0].data.view(-1)[0] += 1.0
        model(x)
        assert tt.__dict__["_merged"] is not first


def test_frozen_serves_without_reading_the_cores_and_sees_every_change_made_before_or_tracked(monkeypatch):
    """Inside ``frozen`` the forms are keyed on storage and versions (no content read); changes made before the
    block, autograd-tracked in-place writes and swapped tensors inside it are seen; after it, content again."""
    model, _ = tt_linear(seed=3)
    tt = matrix_of(model)
    x = torch.randn(2, 48, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # no _version bump
    with torch.no_grad():
        model(x)  # forms cached
    model(x).square().sum().backward()
    optimizer.step()
    want = x @ tt.dense().detach()  # the new weights, from the cores by the grad path
    want = want + model[0].bias.detach()

    def no_content_reads(*args):
        raise AssertionError("frozen must not read the cores")

    with comera_fx.frozen(model), monkeypatch.context() as patch:
        patch.setattr(merged, "cores_unchanged", no_content_reads)
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)  # the step before the block is seen
            tt.cores[0].mul_(2.0)  # tracked: bumps the version
            doubled = x @ tt.dense().detach() + model[0].bias
            torch.testing.assert_close(model(x), doubled, rtol=1e-10, atol=1e-10)
            with comera_fx.frozen(model):  # nests
                torch.testing.assert_close(model(x), doubled, rtol=1e-10, atol=1e-10)
            assert tt.__dict__.get(merged.FROZEN) == 1
            assert merged.FROZEN not in copy.deepcopy(model)[0].tt.__dict__, "a copy made inside is not frozen"
    assert merged.FROZEN not in tt.__dict__
    with torch.no_grad():
        tt.cores[0].data.mul_(0.5)  # untracked: outside the block the content check sees it
        torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
