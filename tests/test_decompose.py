"""TT-SVD / TTM-SVD, random initialisation and parameter counts, checked against float64 einsum references."""

from __future__ import annotations

import math

import opt_einsum as oe
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_fx.testing.strategies import feature_sizes, mode_factorizations
from comera_fx.tt import decompose
from comera_fx.tt.layers import TTMatrix
from comera_fx.tt.layout import TTFormat, TTLayout
from comera_fx.tt.shapes import chain_params

# ------------------------------------------------------------------------------------------- independent reference

BOND, DIM, COL = 0, 100, 200  # index labels for the interleaved einsum: bonds, (row) modes, column modes


def tt_tensor(cores, gates=None):
    """Full tensor of a chain of 3-way cores (r, n_k, r'), optionally with diag(gate) on each internal bond."""
    n = len(cores)
    operands = []
    for k, core in enumerate(cores):
        operands += [core.detach().to(torch.float64), [BOND + k, DIM + k, BOND + k + 1]]
        if gates is not None and k < n - 1:
            operands += [gates[k].detach().to(torch.float64), [BOND + k + 1]]
    out = oe.contract(*operands, [BOND] + [DIM + k for k in range(n)] + [BOND + n], optimize="greedy")
    return out.reshape(out.shape[1:-1])


def ttm_matrix(cores, gates=None):
    """Padded matrix of a chain of 4-way TTM cores (r, row_k, col_k, r'): rows = (i_1..i_d), cols = (j_1..j_d)."""
    n = len(cores)
    operands = []
    for k, core in enumerate(cores):
        operands += [core.detach().to(torch.float64), [BOND + k, DIM + k, COL + k, BOND + k + 1]]
        if gates is not None and k < n - 1:
            operands += [gates[k].detach().to(torch.float64), [BOND + k + 1]]
    labels = [BOND] + [DIM + k for k in range(n)] + [COL + k for k in range(n)] + [BOND + n]
    out = oe.contract(*operands, labels, optimize="greedy")
    rows = math.prod(c.shape[1] for c in cores)
    return out.reshape(rows, -1)


def tt_matrix(cores, row_modes, col_modes, gates=None):
    return tt_tensor(cores, gates).reshape(math.prod(row_modes), math.prod(col_modes))


def padded64(matrix, row_modes, col_modes):
    out = torch.zeros(math.prod(row_modes), math.prod(col_modes), dtype=torch.float64)
    out[: matrix.shape[0], : matrix.shape[1]] = matrix.to(torch.float64)
    return out


def expected_full_ranks(dims):
    return (1,) + tuple(min(math.prod(dims[:k]), math.prod(dims[k:])) for k in range(1, len(dims))) + (1,)


# ---------------------------------------------------------------------------------------------------- strategies

# Modes come from the toolkit's mode_factorizations: any split of a size's prime factors (1s and lopsided modes
# included), padded by up to PAD × the size (products <= 48, as before), so padding of every amount is exercised;
# small sizes keep the SVDs fast.
PAD = 2.0


@st.composite
def matrix_problems(draw, fmt):
    d_rows = draw(st.integers(2, 4))
    d_cols = d_rows if fmt is TTFormat.TTM else draw(st.integers(2, 4))
    rows = draw(feature_sizes(1, 16))
    cols = draw(feature_sizes(1, 16))
    row_modes = draw(mode_factorizations(rows, d_rows, max_pad_fraction=PAD))
    col_modes = draw(mode_factorizations(cols, d_cols, max_pad_fraction=PAD))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return matrix, row_modes, col_modes


formats = st.sampled_from([TTFormat.TT, TTFormat.TTM])
DTYPE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def split(fmt):
    return decompose.matrix_to_tt if fmt is TTFormat.TT else decompose.matrix_to_ttm


def reconstruct(fmt, cores, row_modes, col_modes, gates=None):
    if fmt is TTFormat.TT:
        return tt_matrix(cores, row_modes, col_modes, gates)
    return ttm_matrix(cores, gates)


def paired_tensor(padded, row_modes, col_modes):
    """The tensor TTM-SVD factorises: index k is the pair (i_k, j_k), flattened row-major."""
    d = len(row_modes)
    t = padded.reshape(*row_modes, *col_modes)
    t = t.permute([axis for k in range(d) for axis in (k, d + k)])
    return t.reshape([row_modes[k] * col_modes[k] for k in range(d)])


def tt_svd_bound(tensor, ranks):
    """Oseledets' bound: sqrt(sum_k sum_{i > r_k} sigma_i(A_k)^2), A_k the k-th unfolding of the original tensor."""
    dims = tensor.shape
    total = 0.0
    for k in range(1, len(dims)):
        s = torch.linalg.svdvals(tensor.reshape(math.prod(dims[:k]), -1).to(torch.float64))
        total += (s[ranks[k] :] ** 2).sum().item()
    return math.sqrt(total)


# -------------------------------------------------------------------------------------------- full-rank exactness


@given(fmt=formats, dtype=st.sampled_from([torch.float64, torch.float32]), data=st.data())
def test_full_rank_decomposition_reproduces_the_matrix(fmt, dtype, data):
    matrix, row_modes, col_modes = data.draw(matrix_problems(fmt))
    matrix = matrix.to(dtype)
    cores = split(fmt)(matrix, row_modes, col_modes)

    dims = row_modes + col_modes if fmt is TTFormat.TT else tuple(a * b for a, b in zip(row_modes, col_modes))
    ranks = (1,) + tuple(c.shape[-1] for c in cores)
    assert ranks == expected_full_ranks(dims)
    for k, core in enumerate(cores):
        assert core.dtype == dtype
        assert core.shape[0] == ranks[k]
        if fmt is TTFormat.TT:
            assert tuple(core.shape) == (ranks[k], dims[k], ranks[k + 1])
        else:
            assert tuple(core.shape) == (ranks[k], row_modes[k], col_modes[k], ranks[k + 1])

    target = padded64(matrix, row_modes, col_modes)  # padding reconstructs to exact zeros too
    full = reconstruct(fmt, cores, row_modes, col_modes)
    err = torch.linalg.norm(full - target).item()
    assert err <= DTYPE_TOL[dtype] * torch.linalg.norm(target).item()


def test_full_rank_with_prime_and_unit_modes():
    # A fixed example on top of the random ones: primes, 1-sized modes at both ends and in the middle, padding.
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(33, 26, generator=g, dtype=torch.float64)
    for fmt, row_modes, col_modes in [
        (TTFormat.TT, (1, 7, 1, 5), (1, 3, 3, 3)),
        (TTFormat.TT, (5, 7), (2, 1, 13)),
        (TTFormat.TTM, (7, 1, 5), (3, 9, 1)),
        (TTFormat.TTM, (1, 5, 7, 1), (1, 2, 13, 1)),
    ]:
        cores = split(fmt)(matrix, row_modes, col_modes)
        full = reconstruct(fmt, cores, row_modes, col_modes)
        torch.testing.assert_close(full, padded64(matrix, row_modes, col_modes), rtol=0, atol=1e-12)


# -------------------------------------------------------------------------------------------- truncation bounds


@st.composite
def structured_tensors(draw):
    """A low-rank TT tensor plus noise of random size, so truncation removes a decaying spectrum."""
    n = draw(st.integers(2, 5))
    dims = draw(mode_factorizations(draw(st.integers(1, 256)), n, max_pad_fraction=0))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    low_rank = draw(st.integers(1, 3))
    ranks = [1] + [low_rank] * (n - 1) + [1]
    cores = [torch.randn(ranks[k], dims[k], ranks[k + 1], generator=g, dtype=torch.float64) for k in range(n)]
    noise = draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0, 10.0]))
    tensor = tt_tensor(cores) + noise * torch.randn(dims, generator=g, dtype=torch.float64)
    return tensor


@given(tensor=structured_tensors(), data=st.data(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_truncated_tt_svd_obeys_oseledets_bound(tensor, data, dtype):
    dims = tuple(tensor.shape)
    full = expected_full_ranks(dims)
    use_caps = data.draw(st.booleans())
    caps = None
    if use_caps:
        caps = (1,) + tuple(data.draw(st.integers(1, full[k] + 2)) for k in range(1, len(dims))) + (1,)
    rel_tol = data.draw(st.one_of(st.none(), st.floats(0.0, 0.9)))
    tensor = tensor.to(dtype)
    original = tensor.to(torch.float64)

    cores = decompose.tt_svd(tensor, caps, rel_tol)
    ranks = (1,) + tuple(c.shape[-1] for c in cores)
    assert all(c.dtype == dtype for c in cores)
    for k in range(1, len(dims)):
        assert 1 <= ranks[k] <= full[k]
        if caps is not None:
            assert ranks[k] <= caps[k]

    err = torch.linalg.norm(tt_tensor(cores) - original).item()
    norm = torch.linalg.norm(original).item()
    # float32 cores add a rounding error on top of the exact-arithmetic bound.
    slack = 1e-12 if dtype is torch.float64 else 1e-5 * norm
    assert err <= tt_svd_bound(original, ranks) * (1 + 1e-9) + slack
    if rel_tol is not None and caps is None:
        assert err <= rel_tol * norm * (1 + 1e-9) + slack


@given(fmt=formats, data=st.data())
def test_truncated_matrix_decomposition_obeys_bound(fmt, data):
    matrix, row_modes, col_modes = data.draw(matrix_problems(fmt))
    # Give the matrix a decaying spectrum so that small ranks are meaningful.
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    decay = data.draw(st.sampled_from([1.0, 0.7, 0.3]))
    matrix = (u * (s * decay ** torch.arange(s.numel(), dtype=torch.float64))) @ vh
    n_cores = len(row_modes) + len(col_modes) if fmt is TTFormat.TT else len(row_modes)
    max_rank = data.draw(st.integers(1, 6))
    caps = (1,) + (max_rank,) * (n_cores - 1) + (1,)
    rel_tol = data.draw(st.one_of(st.none(), st.floats(0.0, 0.5)))

    cores = split(fmt)(matrix, row_modes, col_modes, caps, rel_tol)
    ranks = (1,) + tuple(c.shape[-1] for c in cores)
    assert max(ranks) <= max_rank
    target = padded64(matrix, row_modes, col_modes)
    tensor = (
        target.reshape(*row_modes, *col_modes) if fmt is TTFormat.TT else paired_tensor(target, row_modes, col_modes)
    )
    err = torch.linalg.norm(reconstruct(fmt, cores, row_modes, col_modes) - target).item()
    assert err <= tt_svd_bound(tensor, ranks) * (1 + 1e-9) + 1e-12

    # Without rank caps the tolerance alone decides, and it is honoured.
    if rel_tol is not None:
        cores = split(fmt)(matrix, row_modes, col_modes, None, rel_tol)
        err = torch.linalg.norm(reconstruct(fmt, cores, row_modes, col_modes) - target).item()
        assert err <= rel_tol * torch.linalg.norm(target).item() * (1 + 1e-9) + 1e-12


def test_rel_tol_zero_is_exact_and_large_rel_tol_gives_rank_one():
    # The tolerance is split over the ndim - 1 truncations, so rel_tol = sqrt(ndim - 1) allows discarding
    # everything but rank 1 at every step.
    g = torch.Generator().manual_seed(1)
    tensor = torch.randn(3, 4, 5, 2, generator=g, dtype=torch.float64)
    cores = decompose.tt_svd(tensor, rel_tol=0.0)
    assert torch.linalg.norm(tt_tensor(cores) - tensor) <= 1e-12 * torch.linalg.norm(tensor)
    cores = decompose.tt_svd(tensor, rel_tol=math.sqrt(3))
    assert [c.shape[-1] for c in cores[:-1]] == [1, 1, 1]


def test_decompose_rejects_integers_and_bad_caps():
    with pytest.raises(TypeError):
        decompose.matrix_to_tt(torch.ones(4, 4, dtype=torch.int64), (2, 2), (2, 2))
    with pytest.raises(ValueError):
        decompose.tt_svd(torch.ones(2, 2, 2), max_ranks=(1, 2, 1))
    with pytest.raises(ValueError):
        decompose.matrix_to_ttm(torch.ones(4, 4), (2, 2), (4,))
    with pytest.raises(ValueError):
        decompose.pad_matrix(torch.ones(5, 4), 4, 4)


# ------------------------------------------------------------------------------------------- random initialisation


@pytest.mark.parametrize("target_std", [0.02, 1.0, 3.0])
@pytest.mark.parametrize(
    "fmt,row_modes,col_modes,ranks",
    [
        (TTFormat.TT, (8, 8), (8, 8), (1, 8, 16, 8, 1)),
        (TTFormat.TT, (4, 4, 4), (4, 4, 4), (1, 4, 12, 12, 12, 4, 1)),
        (TTFormat.TTM, (8, 8, 8), (4, 4, 4), (1, 16, 16, 1)),
    ],
)
def test_random_tt_cores_reconstructed_std(target_std, fmt, row_modes, col_modes, ranks):
    shapes = (decompose.tt_core_shapes if fmt is TTFormat.TT else decompose.ttm_core_shapes)(
        row_modes, col_modes, ranks
    )
    g = torch.Generator().manual_seed(1234)
    entries = []
    for _ in range(6):
        cores = decompose.random_tt_cores(shapes, target_std, dtype=torch.float64, generator=g)
        assert [tuple(c.shape) for c in cores] == [tuple(s) for s in shapes]
        entries.append(reconstruct(fmt, cores, row_modes, col_modes).reshape(-1))
    entries = torch.cat(entries)
    std = entries.std().item()
    assert abs(std / target_std - 1) < 0.10
    assert abs(entries.mean().item()) < 0.1 * target_std


def test_random_tt_cores_dtype_and_generator():
    shapes = decompose.tt_core_shapes((2, 3), (4,), (1, 2, 4, 1))
    a = decompose.random_tt_cores(shapes, 1.0, dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    b = decompose.random_tt_cores(shapes, 1.0, dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    assert all(x.dtype == torch.float32 for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- parameter counts


@given(fmt=formats, data=st.data())
def test_count_params_matches_tensors(fmt, data):
    d_rows = data.draw(st.integers(1, 4))
    d_cols = d_rows if fmt is TTFormat.TTM else data.draw(st.integers(1, 4))
    row_modes = data.draw(mode_factorizations(data.draw(feature_sizes(1, 48)), d_rows, max_pad_fraction=PAD))
    col_modes = data.draw(mode_factorizations(data.draw(feature_sizes(1, 48)), d_cols, max_pad_fraction=PAD))
    n_cores = d_rows + d_cols if fmt is TTFormat.TT else d_rows
    ranks = (1,) + tuple(data.draw(st.integers(1, 9)) for _ in range(n_cores - 1)) + (1,)

    if fmt is TTFormat.TT:
        dims = row_modes + col_modes
        shapes = decompose.tt_core_shapes(row_modes, col_modes, ranks)
        assert [tuple(s) for s in shapes] == [(ranks[k], dims[k], ranks[k + 1]) for k in range(n_cores)]
    else:
        dims = tuple(a * b for a, b in zip(row_modes, col_modes))
        shapes = decompose.ttm_core_shapes(row_modes, col_modes, ranks)
        assert [tuple(s) for s in shapes] == [
            (ranks[k], row_modes[k], col_modes[k], ranks[k + 1]) for k in range(n_cores)
        ]
    cores = [torch.zeros(s) for s in shapes]
    gate_total = sum(ranks[1:-1])
    core_total = sum(c.numel() for c in cores)
    assert chain_params(dims, ranks) == core_total + gate_total

    # The module really owns exactly that many parameters.
    layout = TTLayout(fmt, math.prod(row_modes), math.prod(col_modes), row_modes, col_modes, ranks)
    module = TTMatrix(layout, cores)
    assert sum(p.numel() for p in module.parameters()) == core_total + gate_total == layout.num_params
    assert [g.numel() for g in module.gates] == list(ranks[1:-1])
