"""TTMatrix / TTLinear / TTEmbedding against dense matrices and float64 einsum references over the cores."""

from __future__ import annotations

import math

import opt_einsum as oe
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from comera_fx.testing.strategies import feature_sizes, mode_factorizations
from comera_fx.tt import TTEmbedding, TTFormat, TTLinear, TTMatrix, make_tt_matrix

# ------------------------------------------------------------------------------------------- independent reference

BOND, ROW, COL = 0, 100, 200  # index labels for the interleaved einsum


def reference_dense(tt: TTMatrix) -> torch.Tensor:
    """M = G1 diag(g1) G2 ... Gn contracted in float64 with einsum, padding sliced away: (rows × cols)."""
    cores = [c.detach().to(torch.float64) for c in tt.cores]
    gates = [g.detach().to(torch.float64) for g in tt.gates]
    n = len(cores)
    operands = []
    for k, core in enumerate(cores):
        if tt.format is TTFormat.TT:
            operands += [core, [BOND + k, ROW + k, BOND + k + 1]]
        else:
            operands += [core, [BOND + k, ROW + k, COL + k, BOND + k + 1]]
        if k < n - 1:
            operands += [gates[k], [BOND + k + 1]]
    if tt.format is TTFormat.TT:
        out = [BOND] + [ROW + k for k in range(n)] + [BOND + n]
    else:
        out = [BOND] + [ROW + k for k in range(n)] + [COL + k for k in range(n)] + [BOND + n]
    full = oe.contract(*operands, out, optimize="greedy")  # a chain: greedy finds the obvious path
    full = full.reshape(math.prod(tt.row_modes), math.prod(tt.col_modes))
    return full[: tt.rows, : tt.cols]


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Normwise relative check in float64: ||actual - expected|| <= tol * ||expected||."""
    assert tuple(actual.shape) == tuple(expected.shape)
    err = torch.linalg.norm((actual.detach().to(torch.float64) - expected.to(torch.float64)).reshape(-1)).item()
    scale = torch.linalg.norm(expected.to(torch.float64).reshape(-1)).item()
    assert err <= tol * scale, f"relative error {err / max(scale, 1e-300):.3g} > {tol}"


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
formats = st.sampled_from([TTFormat.TT, TTFormat.TTM])
dtypes = st.sampled_from([torch.float64, torch.float32])
# Index / batch shapes: () (0-d), (k,), up to 3-d, and shapes with a 0 (empty).
shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def layer_problems(draw, fmt):
    """(rows, cols, row_modes, col_modes): explicit modes with padding and 1s, or automatic modes (primes pad)."""
    if draw(st.booleans()):
        d_rows = draw(st.integers(1, 3))
        d_cols = d_rows if fmt is TTFormat.TTM else draw(st.integers(1, 3))
        rows = draw(feature_sizes(1, 12))
        cols = draw(feature_sizes(1, 12))
        # the toolkit's strategy: any split of the size (padded up to 3x) into d modes, 1s included; product <= 36
        row_modes = draw(mode_factorizations(rows, d_rows, max_pad_fraction=2.0))
        col_modes = draw(mode_factorizations(cols, d_cols, max_pad_fraction=2.0))
        return rows, cols, row_modes, col_modes
    rows = draw(st.one_of(st.sampled_from([11, 13, 17, 19, 23, 29, 31, 37]), st.integers(1, 40)))
    cols = draw(st.one_of(st.sampled_from([11, 13, 17, 19, 23, 29, 31, 37]), st.integers(1, 40)))
    return rows, cols, None, None


def random_matrix(rows, cols, seed, dtype=torch.float64):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


seeds = st.integers(0, 2**31 - 1)


# ------------------------------------------------------------------------------------------ full-rank exactness


@given(fmt=formats, dtype=dtypes, problem=st.data(), seed=seeds, batch=shapes, index_shape=shapes)
def test_full_rank_ops_equal_dense(fmt, dtype, problem, seed, batch, index_shape):
    rows, cols, row_modes, col_modes = problem.draw(layer_problems(fmt))
    matrix = random_matrix(rows, cols, seed, dtype)
    tt = make_tt_matrix(matrix, kind="linear", format=fmt, max_rank=10**9, row_modes=row_modes, col_modes=col_modes)
    if row_modes is None:
        assert math.prod(tt.row_modes) >= rows and math.prod(tt.col_modes) >= cols
    dense64 = matrix.to(torch.float64)
    tol = TOL[dtype]
    g = torch.Generator().manual_seed(seed + 1)

    dense = tt.dense()
    assert dense.dtype == dtype
    assert_rel_close(dense, dense64, tol)

    x = torch.randn(*batch, rows, generator=g, dtype=torch.float64).to(dtype)
    y = tt.matmul(x)
    assert y.dtype == dtype
    assert_rel_close(y, x.to(torch.float64) @ dense64, tol)

    xt = torch.randn(*batch, cols, generator=g, dtype=torch.float64).to(dtype)
    assert_rel_close(tt.matmul_t(xt), xt.to(torch.float64) @ dense64.T, tol)

    index = torch.randint(0, rows, index_shape, generator=g)
    picked = tt.take_rows(index)
    assert picked.dtype == dtype
    assert_rel_close(picked, dense64[index], tol)


def test_full_rank_large_padded_vocab_like_sizes():
    # Automatic modes for primes need padding on both sides; a fixed, slightly bigger example than the random ones.
    matrix = random_matrix(97, 53, 0)
    for fmt in (TTFormat.TT, TTFormat.TTM):
        tt = make_tt_matrix(matrix, kind="embedding", format=fmt, max_rank=10**9)
        assert math.prod(tt.row_modes) > 97 and math.prod(tt.col_modes) > 53
        assert_rel_close(tt.dense(), matrix, 1e-10)
        index = torch.tensor([[0, 96], [50, 1]])
        assert_rel_close(tt.take_rows(index), matrix[index], 1e-10)


def test_explicit_modes_bypass_automatic_choice():
    # Explicit modes must be used as given, even when no automatic choice exists within the padding budget.
    matrix = random_matrix(13, 6, 0)
    tt = make_tt_matrix(
        matrix, kind="linear", row_modes=(13, 1), col_modes=(3, 2), max_rank=10**9, max_pad_fraction=0.0
    )
    assert tt.row_modes == (13, 1) and tt.col_modes == (3, 2)
    assert_rel_close(tt.dense(), matrix, 1e-10)


# ------------------------------------------------------------------------------------------------ gated chains


@given(
    fmt=formats,
    dtype=dtypes,
    problem=st.data(),
    seed=seeds,
    batch=shapes,
    index_shape=shapes,
    max_rank=st.one_of(st.none(), st.integers(1, 6)),
    zero_fraction=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_gated_ops_equal_einsum_reference(fmt, dtype, problem, seed, batch, index_shape, max_rank, zero_fraction):
    rows, cols, row_modes, col_modes = problem.draw(layer_problems(fmt))
    tt = make_tt_matrix(
        random_matrix(rows, cols, seed, dtype),
        kind="linear",
        format=fmt,
        max_rank=max_rank,
        row_modes=row_modes,
        col_modes=col_modes,
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for gate in tt.gates:
            values = torch.randn(gate.shape, generator=g, dtype=torch.float64) * 2
            keep = torch.rand(gate.shape, generator=g, dtype=torch.float64) >= zero_fraction
            gate.data = (values * keep).to(dtype)
    reference = reference_dense(tt)
    tol = TOL[dtype]

    assert_rel_close(tt.dense(), reference, tol)
    x = torch.randn(*batch, rows, generator=g, dtype=torch.float64).to(dtype)
    assert_rel_close(tt.matmul(x), x.to(torch.float64) @ reference, tol)
    xt = torch.randn(*batch, cols, generator=g, dtype=torch.float64).to(dtype)
    assert_rel_close(tt.matmul_t(xt), xt.to(torch.float64) @ reference.T, tol)
    index = torch.randint(0, rows, index_shape, generator=g)
    assert_rel_close(tt.take_rows(index), reference[index], tol)


# --------------------------------------------------------------------------------------------------- gradients


@given(
    fmt=formats,
    seed=seeds,
    batch=shapes,
    in_features=st.integers(1, 30),
    out_features=st.integers(1, 30),
    bias=st.booleans(),
)
def test_tt_linear_input_gradient_equals_dense(fmt, seed, batch, in_features, out_features, bias):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g, dtype=torch.float64))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g, dtype=torch.float64))
    layer = TTLinear.from_dense(linear, max_rank=10**9, format=fmt)
    assert layer.in_features == in_features and layer.out_features == out_features
    assert_rel_close(layer.weight, linear.weight, 1e-10)

    x = torch.randn(*batch, in_features, generator=g, dtype=torch.float64)
    upstream = torch.randn(*batch, out_features, generator=g, dtype=torch.float64)
    x_tt = x.clone().requires_grad_()
    x_dense = x.clone().requires_grad_()
    y_tt = layer(x_tt)
    y_dense = linear(x_dense)
    assert_rel_close(y_tt, y_dense, 1e-10)
    (y_tt * upstream).sum().backward()
    (y_dense * upstream).sum().backward()
    assert_rel_close(x_tt.grad, x_dense.grad, 1e-10)
    if bias:
        assert_rel_close(layer.bias.grad, linear.bias.grad, 1e-10)
    for p in list(layer.tt.cores) + list(layer.tt.gates):
        assert p.grad is not None and torch.isfinite(p.grad).all()


class _Call(nn.Module):
    def __init__(self, tt: TTMatrix, method: str):
        super().__init__()
        self.tt, self.method = tt, method

    def forward(self, arg):
        return getattr(self.tt, self.method)(arg)


@pytest.mark.parametrize(
    "fmt,row_modes,col_modes,rows,cols",
    [
        (TTFormat.TT, (3, 2), (2, 2), 5, 3),
        (TTFormat.TTM, (3, 2), (2, 2), 5, 3),
        (TTFormat.TTM, (2, 1, 3), (1, 2, 2), 6, 4),
    ],
)
@pytest.mark.parametrize("method", ["matmul", "matmul_t", "take_rows"])
def test_gradcheck_tiny_tt_matrix(fmt, row_modes, col_modes, rows, cols, method):
    g = torch.Generator().manual_seed(3)
    tt = make_tt_matrix(
        random_matrix(rows, cols, 3), kind="linear", format=fmt, row_modes=row_modes, col_modes=col_modes, max_rank=2
    )
    with torch.no_grad():
        for gate in tt.gates:
            gate.copy_(torch.randn(gate.shape, generator=g, dtype=torch.float64))
    module = _Call(tt, method)
    names = [name for name, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in module.named_parameters())
    if method == "take_rows":
        arg = torch.tensor([[0, rows - 1, 2], [1, 1, 0]])
        inputs = params
    else:
        width = rows if method == "matmul" else cols
        arg = torch.randn(2, width, generator=g, dtype=torch.float64, requires_grad=True)
        inputs = (arg,) + params

    def fn(*tensors):
        if method == "take_rows":
            x, ps = arg, tensors
        else:
            x, ps = tensors[0], tensors[1:]
        return torch.func.functional_call(module, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(fn, inputs)


# -------------------------------------------------------------------------------------------------- embeddings


@given(
    fmt=formats,
    seed=seeds,
    index_shape=shapes,
    num=st.integers(1, 40),
    dim=st.integers(1, 20),
    pad=st.one_of(st.none(), st.integers(-40, 39)),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    data=st.data(),
)
def test_tt_embedding_equals_nn_embedding(fmt, seed, index_shape, num, dim, pad, index_dtype, data):
    if pad is not None:
        pad = pad % num - (num if pad < 0 else 0)  # keep it in [-num, num)
    g = torch.Generator().manual_seed(seed)
    embedding = nn.Embedding(num, dim, padding_idx=pad, dtype=torch.float64)
    with torch.no_grad():
        # A nonzero padding row too: nn.Embedding returns whatever the row holds.
        embedding.weight.copy_(torch.randn(num, dim, generator=g, dtype=torch.float64))
    layer = TTEmbedding.from_dense(embedding, max_rank=10**9, format=fmt)
    assert layer.num_embeddings == num and layer.embedding_dim == dim
    index = torch.randint(0, num, index_shape, generator=g)
    if pad is not None and index.numel() and data.draw(st.booleans()):
        index.view(-1)[0] = embedding.padding_idx
    index = index.to(index_dtype)
    assert_rel_close(layer(index), embedding(index), 1e-10)
    assert_rel_close(layer.weight, embedding.weight, 1e-10)


@given(fmt=formats, seed=seeds, index_shape=shapes, num=st.integers(2, 30), dim=st.integers(1, 12), data=st.data())
def test_tt_embedding_padding_row_comes_from_buffer_without_gradient(fmt, seed, index_shape, num, dim, data):
    pad = data.draw(st.integers(0, num - 1))
    g = torch.Generator().manual_seed(seed)
    embedding = nn.Embedding(num, dim, padding_idx=pad, dtype=torch.float64)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(num, dim, generator=g, dtype=torch.float64))
    # Rank 1: the TT reconstruction of the padding row differs from the dense row, so only the buffer gives it.
    layer = TTEmbedding.from_dense(embedding, max_rank=1, format=fmt)
    approx = reference_dense(layer.tt)
    index = torch.randint(0, num, index_shape, generator=g)
    is_pad = index == pad
    expected = torch.where(is_pad[..., None], embedding.weight.detach()[pad], approx[index])
    out = layer(index)
    assert_rel_close(out, expected, 1e-10)
    assert torch.equal(out[is_pad], embedding.weight.detach()[pad].expand_as(out[is_pad]))

    # Padding positions send no gradient to the cores: the grads equal those of the non-padding positions alone.
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * upstream).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.tt.parameters()]
    layer.zero_grad(set_to_none=True)
    keep = ~is_pad
    (layer(index[keep]) * upstream[keep]).sum().backward()
    for p, grad in zip(layer.tt.parameters(), grads):
        expected_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
@pytest.mark.parametrize("index_shape", [(), (5,), (2, 3, 4)])
def test_tt_embedding_all_padding_gives_zero_core_gradients(fmt, index_shape):
    embedding = nn.Embedding(12, 6, padding_idx=4, dtype=torch.float64)
    layer = TTEmbedding.from_dense(embedding, max_rank=10**9, format=fmt)
    index = torch.full(index_shape, 4)
    out = layer(index)
    torch.testing.assert_close(out, embedding(index), rtol=0, atol=0)
    out.pow(2).add(out).sum().backward()
    for p in layer.tt.parameters():
        assert p.grad is None or torch.count_nonzero(p.grad) == 0
    assert not layer.padding_row.requires_grad


def test_tt_embedding_default_padding_row_follows_the_cores():
    # Without an explicit row the padding row is zeros, created where the cores live (meta stands in for a GPU).
    source = make_tt_matrix(
        torch.zeros(6, 4, dtype=torch.float64), kind="embedding", row_modes=(3, 2), col_modes=(2, 2), max_rank=2
    )
    tt = TTMatrix(source.layout, [c.detach().to("meta") for c in source.cores])
    layer = TTEmbedding(tt, padding_idx=-1)
    assert layer.padding_idx == 5
    assert layer.padding_row.device.type == "meta" and layer.padding_row.dtype == torch.float64


@pytest.mark.parametrize("bad", [12, 13, -1, -12])
@pytest.mark.parametrize("index_shape", [(), (3,), (2, 2)])
def test_tt_embedding_out_of_range_raises(bad, index_shape):
    layer = TTEmbedding.from_dense(nn.Embedding(12, 4), max_rank=10**9)
    index = torch.zeros(index_shape, dtype=torch.int64)
    index.view(-1)[-1] = bad
    with pytest.raises(IndexError):
        layer(index)


@pytest.mark.parametrize(
    "option,field",
    [
        ({"max_norm": 1.0}, "max_norm"),
        ({"sparse": True}, "sparse"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
    ],
)
def test_tt_embedding_refuses_unsupported_options(option, field):
    embedding = nn.Embedding(12, 4, **option)
    assert field in TTEmbedding.check_supported(embedding)
    with pytest.raises(ValueError, match=field):
        TTEmbedding.from_dense(embedding)


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_tied_head_uses_transpose(fmt):
    embedding = nn.Embedding(29, 10, dtype=torch.float64)
    emb = TTEmbedding.from_dense(embedding, max_rank=10**9, format=fmt)
    bias = torch.randn(29, dtype=torch.float64)
    head = TTLinear(emb.tt, bias, transposed=True)
    assert head.in_features == 10 and head.out_features == 29
    x = torch.randn(3, 2, 10, dtype=torch.float64)
    assert_rel_close(head(x), x @ embedding.weight.detach().T + bias, 1e-10)
    assert_rel_close(head.weight, embedding.weight, 1e-10)


# ------------------------------------------------------------------------------------------- random initialisation


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_init_linear_std_matches_nn_linear(fmt, seed):
    in_features, out_features = 256, 384
    linear = nn.Linear(in_features, out_features)
    layer = TTLinear.from_dense(
        linear, init="random", max_rank=16, format=fmt, generator=torch.Generator().manual_seed(seed)
    )
    target = 1.0 / math.sqrt(3 * in_features)
    assert abs(linear.weight.std().item() / target - 1) < 0.05  # the documented target is the real nn.Linear std
    weight = reference_dense(layer.tt)
    assert weight.shape == (in_features, out_features)
    assert abs(weight.std().item() / target - 1) < 0.15
    assert max(layer.tt.ranks) <= 16


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_init_embedding_std_is_one(fmt, seed):
    layer = TTEmbedding.from_dense(
        nn.Embedding(1000, 64), init="random", max_rank=16, format=fmt, generator=torch.Generator().manual_seed(seed)
    )
    weight = reference_dense(layer.tt)
    assert abs(weight.std().item() - 1) < 0.15


def test_random_init_rejects_unknown_init():
    with pytest.raises(ValueError, match="init"):
        TTLinear.from_dense(nn.Linear(8, 8), init="zeros")


# ------------------------------------------------------------------------------------------------------ bfloat16


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_bf16_linear_close_to_dense_bf16(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = TTLinear.from_dense(linear, max_rank=10**9, format=fmt).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    x = torch.randn(4, 7, 64).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = linear.to(torch.bfloat16)(x)
    assert_rel_close(y, expected.to(torch.float64), 5e-2)


# ---------------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("fmt", [TTFormat.TT, TTFormat.TTM])
def test_state_dict_round_trip_with_pruned_ranks(fmt):
    g = torch.Generator().manual_seed(0)
    rows, cols, row_modes, col_modes = 30, 24, (5, 3, 2), (2, 3, 4)
    pruned = make_tt_matrix(
        random_matrix(rows, cols, 1), kind="linear", format=fmt, max_rank=3, row_modes=row_modes, col_modes=col_modes
    )
    with torch.no_grad():
        for gate in pruned.gates:
            gate.copy_(torch.randn(gate.shape, generator=g, dtype=torch.float64))
    fresh = make_tt_matrix(
        random_matrix(rows, cols, 2), kind="linear", format=fmt, max_rank=8, row_modes=row_modes, col_modes=col_modes
    )
    assert pruned.ranks != fresh.ranks

    fresh.load_state_dict(pruned.state_dict())
    assert fresh.ranks == pruned.ranks
    for a, b in zip(fresh.parameters(), pruned.parameters()):
        assert a.shape == b.shape and a.requires_grad
    x = torch.randn(3, rows, generator=g, dtype=torch.float64)
    xt = torch.randn(3, cols, generator=g, dtype=torch.float64)
    index = torch.tensor([[0, 29], [7, 7]])
    assert torch.equal(fresh.matmul(x), pruned.matmul(x))
    assert torch.equal(fresh.matmul_t(xt), pruned.matmul_t(xt))
    assert torch.equal(fresh.take_rows(index), pruned.take_rows(index))
    assert torch.equal(fresh.dense(), pruned.dense())
    assert_rel_close(fresh.dense(), reference_dense(pruned), 1e-10)

    # Nested in a layer the prefixes change; the same adoption must happen.
    head = TTLinear(
        make_tt_matrix(
            random_matrix(rows, cols, 3),
            kind="linear",
            format=fmt,
            max_rank=8,
            row_modes=row_modes,
            col_modes=col_modes,
        )
    )
    head.load_state_dict(TTLinear(pruned).state_dict())
    assert torch.equal(head(x), pruned.matmul(x))


def test_extra_repr_mentions_modes_ranks_and_compression():
    tt = make_tt_matrix(random_matrix(13, 24, 0), kind="linear", row_modes=(7, 2), col_modes=(2, 3, 4), max_rank=3)
    text = tt.extra_repr()
    params = sum(p.numel() for p in tt.parameters())
    assert "13→14=7·2" in text and "24=2·3·4" in text
    assert f"ranks={tt.ranks}" in text and tt.ranks == (1, 3, 3, 3, 3, 1)
    assert f"compression={13 * 24 / params:.1f}x" in text
    assert "format=tt" in text
    assert "modes=" in repr(tt) and "ranks=" in repr(tt)


def test_tt_linear_under_bf16_autocast_returns_what_nn_linear_returns():
    """The bias was added in float32 after the bf16 contraction, promoting the output back to float32 (BERT's
    biased MLM decoder under autocast gave float32 logits where the dense model gives bf16)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96)
    layer = TTLinear.from_dense(dense, max_rank=10**9)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, expected = layer(x), dense(x)
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=0, atol=0.05)
