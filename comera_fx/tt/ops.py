"""Contractions of TT matrices with activations, written once for eager tensors and FX proxies.

Each function takes the cores (gates already folded in, see ``gate_cores``) and a static ``TTLayout``. They read no
shape from the cores, branch on no tensor value and only call reshape / mm / bmm / permute / embedding / pad, so the
graph pass can trace them with ``torch.fx.Proxy`` objects and emit explicit pairwise contractions into a graph.

Plans used here (the planner issue generalises them):
* TT ``x @ M``: merge row-side cores into L (rows × r), column-side cores into R (r × cols), then (x·L)·R —
  CoMERA's merged plan; batch-dependent cost 2·b·r·(rows + cols) instead of 2·b·rows·cols.
* TTM ``x @ M``: contract the activation with one core at a time, unless that costs a token more FLOPs than a
  dense matmul or an intermediate far larger than its input + output (high ranks, a TTM output head); then M is
  built once per call.
* Row lookups (embeddings): TT gathers rows of L then multiplies by R; TTM pre-contracts the two halves of the chain
  into small tables (CoMERA's trick), gathers one slice of each per token and does one batched GEMM over the rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import TTFormat, TTLayout


def gate_cores(cores: Sequence[Tensor], gates: Sequence[Tensor], layout: TTLayout) -> list[Tensor]:
    """Fold the gate of each internal bond into the core on its left (never a separate full-size pass)."""
    shape = (1,) * (layout.core_ndim - 1) + (-1,)
    return [core * gate.reshape(shape) for core, gate in zip(cores[:-1], gates)] + [cores[-1]]


# ---------------------------------------------------------------------------------------------- TT (3-way cores)


def tt_row_factor(cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """L = G_1 ··· G_d merged over the row modes: (padded_rows × r_d)."""
    ranks, modes = layout.ranks, layout.row_modes
    acc = cores[0].reshape(modes[0], ranks[1])
    for k in range(1, len(modes)):
        acc = (acc @ cores[k].reshape(ranks[k], modes[k] * ranks[k + 1])).reshape(-1, ranks[k + 1])
    return acc


def tt_col_factor(cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """R = G_{d+1} ··· G_{d+e} merged over the column modes: (r_d × padded_cols)."""
    ranks, modes = layout.ranks, layout.col_modes
    first = len(layout.row_modes)
    last = layout.n_cores - 1
    acc = cores[last].reshape(ranks[last], modes[-1])
    for k in range(last - 1, first - 1, -1):
        acc = (cores[k].reshape(ranks[k] * modes[k - first], ranks[k + 1]) @ acc).reshape(ranks[k], -1)
    return acc


def _trim_rows(t: Tensor, n: int, padded: int) -> Tensor:
    return t[:n] if n != padded else t


def _trim_cols(t: Tensor, n: int, padded: int) -> Tensor:
    return t[..., :n] if n != padded else t


def tt_factors(cores: Sequence[Tensor], layout: TTLayout) -> tuple[Tensor, Tensor]:
    """(L, R) with padding sliced away: M = L @ R, L (rows × r), R (r × cols)."""
    left = _trim_rows(tt_row_factor(cores, layout), layout.rows, layout.padded_rows)
    right = _trim_cols(tt_col_factor(cores, layout), layout.cols, layout.padded_cols)
    return left, right


# --------------------------------------------------------------------------------------------- TTM (4-way cores)


def ttm_merge(
    cores: Sequence[Tensor], row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]
) -> Tensor:
    """Contract consecutive TTM cores into one (r_first, A, B, r_last) block, A/B row-major over the modes."""
    acc = cores[0]
    big_a, big_b = row_modes[0], col_modes[0]
    for k in range(1, len(cores)):
        a, b, r_next = row_modes[k], col_modes[k], ranks[k + 1]
        acc = acc.reshape(-1, ranks[k]) @ cores[k].reshape(ranks[k], -1)
        acc = acc.reshape(ranks[0], big_a, big_b, a, b, r_next).permute(0, 1, 3, 2, 4, 5)
        big_a, big_b = big_a * a, big_b * b
        acc = acc.reshape(ranks[0], big_a, big_b, r_next)
    return acc


def _ttm_apply(
    x2: Tensor,
    cores: Sequence[Tensor],
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    transpose: bool,
) -> Tensor:
    """Contract x2 (N × prod in_modes) with the chain one core at a time -> (N × prod out_modes)."""
    rest = math.prod(in_modes)
    state = x2.reshape(-1, rest, 1, 1)  # (N, remaining input modes, output modes so far, bond)
    done = 1
    for k, core in enumerate(cores):
        a, b, r, r_next = in_modes[k], out_modes[k], ranks[k], ranks[k + 1]
        rest //= a
        # (N, a, rest, done, r) -> (N, rest, done, a, r): the contracted pair (a, r) last.
        state = state.reshape(-1, a, rest, done, r).permute(0, 2, 3, 1, 4).reshape(-1, a * r)
        if transpose:  # core is (r, out, in, r'): contract its "in" axis, i.e. the matrix's column modes
            mat = core.permute(2, 0, 1, 3).reshape(a * r, b * r_next)
        else:
            mat = core.permute(1, 0, 2, 3).reshape(a * r, b * r_next)
        done *= b
        state = (state @ mat).reshape(-1, rest, done, r_next)
    return state.reshape(-1, done)


# ----------------------------------------------------------------------------------------------- public entries


def ttm_chain_cost_per_token(
    in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int]
) -> tuple[int, int]:
    """(FLOPs, largest intermediate in elements) per token of the core-by-core TTM contraction."""
    rest, done, flops, peak = math.prod(in_modes), 1, 0, 0
    for a, b, r, r_next in zip(in_modes, out_modes, ranks[:-1], ranks[1:]):
        rest //= a
        flops += 2 * rest * done * (a * r) * (b * r_next)
        done *= b
        peak = max(peak, rest * done * r_next)
    return flops, peak


# A core-by-core intermediate larger than this many times a token's input + output counts as too big.
_TTM_PEAK_FACTOR = 4


def _ttm_prefers_dense(layout: TTLayout, transpose: bool) -> bool:
    """Core by core, each token's work and intermediates grow with the ranks; where they exceed a dense matmul's
    (high ranks, or a TTM output head), building M once per call is cheaper. The planner replaces this rule."""
    modes = (layout.col_modes, layout.row_modes) if transpose else (layout.row_modes, layout.col_modes)
    flops, peak = ttm_chain_cost_per_token(*modes, layout.ranks)
    dense_flops = 2 * layout.padded_rows * layout.padded_cols
    return flops >= dense_flops or peak > _TTM_PEAK_FACTOR * (layout.padded_rows + layout.padded_cols)


def matmul(x: Tensor, cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """x @ M for x of shape (..., rows) -> (..., cols)."""
    x2 = x.reshape(-1, layout.rows)
    if layout.format is TTFormat.TT:
        left, right = tt_factors(cores, layout)
        out = (x2 @ left) @ right
    elif _ttm_prefers_dense(layout, transpose=False):
        out = x2 @ to_dense(cores, layout)
    else:
        if layout.padded_rows != layout.rows:
            x2 = F.pad(x2, (0, layout.padded_rows - layout.rows))
        out = _ttm_apply(x2, cores, layout.row_modes, layout.col_modes, layout.ranks, transpose=False)
        out = _trim_cols(out, layout.cols, layout.padded_cols)
    return out.reshape(x.shape[:-1] + (layout.cols,))


def matmul_t(x: Tensor, cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """x @ M^T for x of shape (..., cols) -> (..., rows); a tied output head uses this."""
    x2 = x.reshape(-1, layout.cols)
    if layout.format is TTFormat.TT:
        left, right = tt_factors(cores, layout)
        out = (x2 @ right.t()) @ left.t()
    elif _ttm_prefers_dense(layout, transpose=True):
        out = x2 @ to_dense(cores, layout).t()
    else:
        if layout.padded_cols != layout.cols:
            x2 = F.pad(x2, (0, layout.padded_cols - layout.cols))
        out = _ttm_apply(x2, cores, layout.col_modes, layout.row_modes, layout.ranks, transpose=True)
        out = _trim_cols(out, layout.rows, layout.padded_rows)
    return out.reshape(x.shape[:-1] + (layout.rows,))


def take_rows(index: Tensor, cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """M[index] for an integer index tensor of any shape -> (*index.shape, cols), never building M.

    Indices are not range-checked here (that needs a device sync); callers check eagerly.
    """
    if layout.format is TTFormat.TT:
        left, right = tt_factors(cores, layout)
        return F.embedding(index, left) @ right
    if len(layout.row_modes) == 1:
        table = cores[0].reshape(layout.padded_rows, layout.padded_cols)
        return _trim_cols(F.embedding(index, table), layout.cols, layout.padded_cols)
    return ttm_gather_rows(index, *ttm_row_tables(*ttm_halves(cores, layout), layout), layout)


def ttm_split(layout: TTLayout) -> int:
    """The bond at which a TTM chain is cut into two halves (the middle one, the left half the longer)."""
    return (len(layout.row_modes) + 1) // 2


def ttm_half_sizes(layout: TTLayout) -> tuple[int, int, int, int, int]:
    """(A_L, B_L, r, A_R, B_R): row- and column-mode products of each half and the rank of the cut bond."""
    h = ttm_split(layout)
    rows_m, cols_m = layout.row_modes, layout.col_modes
    return (math.prod(rows_m[:h]), math.prod(cols_m[:h]), layout.ranks[h], math.prod(rows_m[h:]), math.prod(cols_m[h:]))


def ttm_halves(cores: Sequence[Tensor], layout: TTLayout) -> tuple[Tensor, Tensor]:
    """The chain contracted into two halves at ``ttm_split``: left (A_L, B_L, r) and right (r, A_R, B_R), with A the
    row modes and B the column modes of each half, so that (padded sizes)
    M[(a_L, a_R), (b_L, b_R)] = Σ_r left[a_L, b_L, r]·right[r, a_R, b_R]. Needs at least two cores."""
    h = ttm_split(layout)
    a_left, b_left, r, a_right, b_right = ttm_half_sizes(layout)
    ranks, rows_m, cols_m = layout.ranks, layout.row_modes, layout.col_modes
    left = ttm_merge(cores[:h], rows_m[:h], cols_m[:h], ranks[: h + 1]).reshape(a_left, b_left, r)
    right = ttm_merge(cores[h:], rows_m[h:], cols_m[h:], ranks[h:]).reshape(r, a_right, b_right)
    return left, right


def ttm_row_tables(left: Tensor, right: Tensor, layout: TTLayout) -> tuple[Tensor, Tensor]:
    """The halves as lookup tables (CoMERA's trick): (A_L, B_L·r) and (A_R, r·B_R), one row per row-mode index."""
    a_left, b_left, r, a_right, b_right = ttm_half_sizes(layout)
    return left.reshape(a_left, b_left * r), right.permute(1, 0, 2).reshape(a_right, r * b_right)


def ttm_gather_rows(index: Tensor, left_table: Tensor, right_table: Tensor, layout: TTLayout) -> Tensor:
    """M[index] from the two row tables: one slice of each per token and one batched GEMM over the rank."""
    _, b_left, r, a_right, b_right = ttm_half_sizes(layout)
    flat = index.reshape(-1)
    picked_left = F.embedding(torch.div(flat, a_right, rounding_mode="floor"), left_table).reshape(-1, b_left, r)
    picked_right = F.embedding(torch.remainder(flat, a_right), right_table).reshape(-1, r, b_right)
    out = torch.bmm(picked_left, picked_right).reshape(index.shape + (b_left * b_right,))
    return _trim_cols(out, layout.cols, layout.padded_cols)


def to_dense(cores: Sequence[Tensor], layout: TTLayout) -> Tensor:
    """The (rows × cols) matrix; for checks and for code that insists on a dense weight."""
    if layout.format is TTFormat.TT:
        left, right = tt_factors(cores, layout)
        return left @ right
    full = ttm_merge(cores, layout.row_modes, layout.col_modes, layout.ranks)
    full = full.reshape(layout.padded_rows, layout.padded_cols)
    return _trim_cols(_trim_rows(full, layout.rows, layout.padded_rows), layout.cols, layout.padded_cols)
