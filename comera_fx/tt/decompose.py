"""TT-SVD and TTM-SVD of dense matrices, reconstruction, random initialisation and parameter counts.

Pure tensor math: no modules, no compiler. Conventions (CoMERA layout):

* A matrix ``M`` (rows × cols) is padded to (prod(row_modes) × prod(col_modes)) and viewed as a tensor with
  indices (i_1..i_d, j_1..j_e), each flattened row-major.
* **TT** format: a chain of 3-way cores ``(r_{k-1}, dim_k, r_k)`` over dims = row_modes + col_modes, so the
  row-side cores come first and the bond between the halves is the matrix rank of ``M``.
* **TTM** format: 4-way cores ``(r_{k-1}, row_k, col_k, r_k)``, one row mode and one column mode per core.
* Gates: one vector per internal bond; the tensor is G_1 diag(g_1) G_2 diag(g_2) ... G_n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .shapes import feasible_ranks


def _check_floating(tensor: Tensor, what: str) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor to be tensorized, got dtype {tensor.dtype}")


def _truncation_rank(singular_values: Tensor, max_rank: int, budget_sq: float) -> int:
    """Smallest rank <= max_rank whose discarded tail has squared norm <= budget_sq (at least 1)."""
    tail_sq = torch.flip(torch.cumsum(torch.flip(singular_values**2, [0]), 0), [0])  # tail_sq[k] = sum s[k:]^2
    rank = min(max_rank, singular_values.numel())
    if budget_sq > 0:
        for k in range(1, rank):
            if tail_sq[k].item() <= budget_sq:
                return k
    return max(1, rank)


def tt_svd(
    tensor: Tensor,
    max_ranks: Sequence[int] | None = None,
    rel_tol: float | None = None,
) -> list[Tensor]:
    """Decompose ``tensor`` into a TT chain with the sequential SVD algorithm (Oseledets 2011).

    ``max_ranks`` caps each bond (length ndim + 1, boundary entries 1); ``rel_tol`` bounds the relative Frobenius
    error: each of the ndim - 1 truncations discards at most (rel_tol * ||A||)^2 / (ndim - 1) squared norm, so
    ||A - TT||_F <= rel_tol * ||A||_F. Whatever the caps, the error obeys the TT-SVD bound
    ||A - TT||_F^2 <= sum_k (discarded squared singular values of the k-th unfolding of A).
    Computed in float64 and returned in the input's dtype.
    """
    _check_floating(tensor, "tensor")
    dims = tuple(tensor.shape)
    n = len(dims)
    caps = tuple(max_ranks) if max_ranks is not None else feasible_ranks(dims)
    if len(caps) != n + 1:
        raise ValueError(f"max_ranks needs {n + 1} entries for a {n}-way tensor, got {len(caps)}")
    work = tensor.detach().to(torch.float64)
    budget_sq = 0.0
    if rel_tol is not None and n > 1:
        budget_sq = (rel_tol * work.norm().item()) ** 2 / (n - 1)
    cores: list[Tensor] = []
    rank = 1
    rest = work.reshape(1, -1)
    for k in range(n - 1):
        rest = rest.reshape(rank * dims[k], -1)
        u, s, vh = torch.linalg.svd(rest, full_matrices=False)
        new_rank = _truncation_rank(s, caps[k + 1], budget_sq)
        cores.append(u[:, :new_rank].reshape(rank, dims[k], new_rank))
        rest = s[:new_rank, None] * vh[:new_rank]
        rank = new_rank
    cores.append(rest.reshape(rank, dims[-1], 1))
    return [c.to(tensor.dtype).contiguous() for c in cores]


def pad_matrix(matrix: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a matrix to (rows × cols); padding never changes the layers' results because it is sliced away."""
    pad_rows, pad_cols = rows - matrix.shape[0], cols - matrix.shape[1]
    if pad_rows < 0 or pad_cols < 0:
        raise ValueError(f"cannot pad a {tuple(matrix.shape)} matrix down to ({rows}, {cols})")
    return torch.nn.functional.pad(matrix, (0, pad_cols, 0, pad_rows))


def matrix_to_tt(
    matrix: Tensor,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    max_ranks: Sequence[int] | None = None,
    rel_tol: float | None = None,
) -> list[Tensor]:
    """TT-SVD of a matrix in CoMERA layout: 3-way cores over row_modes then col_modes."""
    _check_floating(matrix, "matrix")
    padded = pad_matrix(matrix, math.prod(row_modes), math.prod(col_modes))
    return tt_svd(padded.reshape(*row_modes, *col_modes), max_ranks, rel_tol)


def matrix_to_ttm(
    matrix: Tensor,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    max_ranks: Sequence[int] | None = None,
    rel_tol: float | None = None,
) -> list[Tensor]:
    """TTM-SVD of a matrix: 4-way cores (r, row_k, col_k, r'), found by TT-SVD over the paired modes."""
    _check_floating(matrix, "matrix")
    d = len(row_modes)
    if len(col_modes) != d:
        raise ValueError(f"TTM needs as many row modes as column modes, got {tuple(row_modes)} and {tuple(col_modes)}")
    padded = pad_matrix(matrix, math.prod(row_modes), math.prod(col_modes))
    paired = padded.reshape(*row_modes, *col_modes)
    order = [axis for k in range(d) for axis in (k, d + k)]
    paired = paired.permute(order).reshape([row_modes[k] * col_modes[k] for k in range(d)])
    cores = tt_svd(paired, max_ranks, rel_tol)
    return [c.reshape(c.shape[0], row_modes[k], col_modes[k], c.shape[-1]) for k, c in enumerate(cores)]


def random_tt_cores(
    core_shapes: Sequence[tuple[int, ...]],
    target_std: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Gaussian cores whose reconstructed entries have standard deviation ``target_std`` (gates at 1).

    An entry of the full tensor is a sum over prod(internal ranks) products of one entry per core, so with iid
    N(0, s^2) core entries its variance is prod(ranks) * s^(2 * n_cores); solve for s.
    """
    n_cores = len(core_shapes)
    bond_product = math.prod(shape[-1] for shape in core_shapes[:-1])
    core_std = (target_std**2 / bond_product) ** (1.0 / (2 * n_cores))
    return [torch.randn(shape, dtype=dtype, device=device, generator=generator) * core_std for shape in core_shapes]


def tt_core_shapes(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, ...]]:
    dims = tuple(row_modes) + tuple(col_modes)
    return [(ranks[k], dims[k], ranks[k + 1]) for k in range(len(dims))]


def ttm_core_shapes(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, ...]]:
    return [(ranks[k], row_modes[k], col_modes[k], ranks[k + 1]) for k in range(len(row_modes))]
