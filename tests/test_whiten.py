"""Activation-aware TT-SVD (comera_fx/tt/whiten.py), checked against dense float64 computations on the inputs."""

from __future__ import annotations

import math

import pytest
import torch

from comera_fx.tt.decompose import matrix_to_tt
from comera_fx.tt.shapes import capped_ranks, feasible_ranks
from comera_fx.tt.whiten import refit_row_cores, tt_chain_to_matrix, whitened_matrix_to_tt

ROWS, COLS = 96, 120
ROW_MODES, COL_MODES = (6, 4, 4), (4, 5, 6)


def anisotropic_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Inputs whose covariance spans three decades, in a random basis (so no input feature is special)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))[0]
    scales = torch.logspace(0, -3, d, dtype=torch.float64)
    return (torch.randn(n, d, dtype=torch.float64, generator=g) * scales) @ basis.T


def output_error(x, m, cores, row_modes=ROW_MODES, col_modes=COL_MODES):
    """||X M - X M̂||_F / ||X M||_F, straight from the inputs (no second moment involved)."""
    approx = tt_chain_to_matrix(cores, row_modes, col_modes, *m.shape)
    return float((x @ m - x @ approx).norm() / (x @ m).norm())


@pytest.fixture(scope="module")
def problem():
    x = anisotropic_inputs(1500, ROWS, seed=0)
    m = torch.randn(ROWS, COLS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return x, m, x.T @ x / x.shape[0]


@pytest.mark.parametrize("max_rank", [4, 12, 24])
def test_whitened_beats_plain_at_equal_ranks(problem, max_rank):
    x, m, c = problem
    caps = capped_ranks(ROW_MODES + COL_MODES, max_rank)
    white = whitened_matrix_to_tt(m, c, ROW_MODES, COL_MODES, caps)
    plain = matrix_to_tt(m, ROW_MODES, COL_MODES, caps)
    assert [t.shape for t in white] == [t.shape for t in plain]  # the same parameters
    e_white, e_plain = output_error(x, m, white), output_error(x, m, plain)
    assert e_white < 0.95 * e_plain, (e_white, e_plain)


def test_middle_bond_is_the_whitened_svd_optimum(problem):
    """Only the middle bond truncated: the result is SVD-LLM's optimum, computed here with a Cholesky factor."""
    x, m, c = problem
    r = 10
    caps = list(feasible_ranks(ROW_MODES + COL_MODES))
    caps[len(ROW_MODES)] = r
    cores = whitened_matrix_to_tt(m, c, ROW_MODES, COL_MODES, caps, eps=0.0)
    chol = torch.linalg.cholesky(c)  # C = L Lᵀ, the weighted norm is ||Lᵀ E||
    u, s, vh = torch.linalg.svd(chol.T @ m)
    best = torch.linalg.solve_triangular(chol.T, (u[:, :r] * s[:r]) @ vh[:r], upper=True)
    ref = float((x @ m - x @ best).norm() / (x @ m).norm())
    assert output_error(x, m, cores) == pytest.approx(ref, rel=1e-6)


def test_isotropic_inputs_match_plain_tt_svd():
    """With C = I the weighted norm is Frobenius: no better than TT-SVD's quasi-optimum by much, never worse."""
    m = torch.randn(ROWS, COLS, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    caps = capped_ranks(ROW_MODES + COL_MODES, 8)
    white = whitened_matrix_to_tt(m, torch.eye(ROWS, dtype=torch.float64), ROW_MODES, COL_MODES, caps)
    plain = matrix_to_tt(m, ROW_MODES, COL_MODES, caps)
    eye = torch.eye(ROWS, dtype=torch.float64)
    assert output_error(eye, m, white) <= output_error(eye, m, plain) + 1e-12


def test_row_refit_never_raises_the_weighted_objective(problem):
    x, m, c = problem
    g = torch.Generator().manual_seed(4)
    b = torch.randn(ROWS, 7, dtype=torch.float64, generator=g)
    start = [
        torch.randn(1, 6, 5, dtype=torch.float64, generator=g),
        torch.randn(5, 4, 9, dtype=torch.float64, generator=g),
        torch.randn(9, 4, 7, dtype=torch.float64, generator=g),
    ]

    def objective(cores):
        p = cores[0].reshape(6, -1)
        for core in cores[1:]:
            p = p.reshape(-1, core.shape[0]) @ core.reshape(core.shape[0], -1)
        e = b - p.reshape(ROWS, 7)
        return float((x @ e).norm() ** 2)

    values = [objective(start)]
    for sweeps in (1, 2, 4):
        values.append(objective(refit_row_cores(start, b, c, sweeps=sweeps)))
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(values, values[1:])), values
    assert values[-1] < 0.5 * values[0]


def test_padded_sizes_and_dtype():
    rows, cols = 90, 100  # 90 -> 96 = 6·4·4 padded
    x = anisotropic_inputs(800, rows, seed=5).float()
    m = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6))
    c = (x.double().T @ x.double()) / x.shape[0]
    caps = capped_ranks(ROW_MODES + (4, 5, 5), 8)
    cores = whitened_matrix_to_tt(m, c, ROW_MODES, (4, 5, 5), caps)
    assert all(t.dtype == torch.float32 for t in cores)
    approx = tt_chain_to_matrix(cores, ROW_MODES, (4, 5, 5), rows, cols)
    plain = tt_chain_to_matrix(matrix_to_tt(m, ROW_MODES, (4, 5, 5), caps), ROW_MODES, (4, 5, 5), rows, cols)
    xd, md = x.double(), m.double()
    assert (xd @ (md - approx)).norm() < (xd @ (md - plain)).norm()


def test_shape_errors():
    m = torch.randn(ROWS, COLS)
    with pytest.raises(ValueError, match="input rows"):
        whitened_matrix_to_tt(m, torch.eye(COLS), ROW_MODES, COL_MODES)
    with pytest.raises(ValueError, match="max_ranks"):
        whitened_matrix_to_tt(m, torch.eye(ROWS), ROW_MODES, COL_MODES, (1, 2, 1))
    assert math.isfinite(
        output_error(
            torch.eye(ROWS, dtype=torch.float64),
            m.double(),
            whitened_matrix_to_tt(m.double(), torch.eye(ROWS), ROW_MODES, COL_MODES),
        )
    )
