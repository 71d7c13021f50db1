"""Cheap per-layer error estimates for ``choose_formats(fast=True)``: every candidate from one factorisation per layer.

The exact scoring builds each TT candidate the way ``tensorize_`` does (activation-aware TT-SVD with its weighted
ALS refit: an eigendecomposition of the layer's input second moment and a refit per rank, 10-15 s for a
1536-input layer on 2 busy cores) and each int candidate's error as tr(Eᵀ C E) (a d_in² × d_out product). Here,
per layer and once for all candidates:

    S with S Sᵀ = C (one Cholesky factorisation, float32) and the whitened matrix Sᵀ M;
    int8 / int4: Σ_i C_ii ||E_i||² / tr(Mᵀ C M), the diagonal part of tr(Eᵀ C E) (rounding errors of different
                 weights are uncorrelated, so the off-diagonal part averages out), on the grid whose scales
                 minimize it (``quantize_groups`` with importance C_ii, what ``apply_formats_`` builds);
    TT at rank r: the whitened construction of ``comera_fx.tt.whiten`` without its ALS refit (output-side cores from
                 SVDs of Sᵀ M, input-side cores a plain TT-SVD of B = M Qᵀ), its error tr(Eᵀ C E) measured exactly
                 (float32).

No refit makes the TT estimates pessimistic (the refit only lowers the error); ``choose_formats`` corrects both
families per layer by measuring its short-list at the model's output.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..quantize import QuantSpec, fake_quant
from ..tt.decompose import pad_matrix, tt_svd
from ..tt.layers import choose_layout_modes
from ..tt.layout import TTFormat
from ..tt.shapes import capped_ranks
from ..tt.whiten import DEFAULT_EPS, regularized_gram
from .calibrate import InputStats


def _chain(cores: list[Tensor]) -> Tensor:
    """The (first mode ... last mode) tensor of 3-way cores, flattened to (first bond · modes, last bond)."""
    acc = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        acc = (acc @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    return acc


class LayerEstimator:
    """One linear layer's inputs and weight, factorised once; estimates and cheap dense stand-ins per candidate."""

    def __init__(self, module: nn.Linear, stats: InputStats, num_modes: int | None):
        weight = module.weight.detach()
        self.weight = weight
        self.rows, self.cols = module.in_features, module.out_features  # M = Wᵀ: in × out
        self.row_modes, self.col_modes = choose_layout_modes(self.rows, self.cols, TTFormat.TT, num_modes)
        padded_rows = 1
        for n in self.row_modes:
            padded_rows *= n
        padded_cols = 1
        for n in self.col_modes:
            padded_cols *= n
        self.m = pad_matrix(weight.t().float(), padded_rows, padded_cols)
        c = regularized_gram(stats.second_moment, padded_rows, DEFAULT_EPS).float()
        # Any S with S Sᵀ = C gives the same column-side SVDs (the input index never leaves the left of their
        # unfoldings), so the Cholesky factor, several times cheaper than the symmetric root, serves.
        root, info = torch.linalg.cholesky_ex(c)
        if int(info) != 0:
            values, vectors = torch.linalg.eigh(c)
            root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
        self.white = root.T @ self.m
        self.gram = stats.second_moment.float()
        self.diag = torch.diagonal(self.gram).clamp_min(0)
        m_true = weight.t().float()
        self.total = float((m_true * (self.gram @ m_true)).sum()) or 1.0
        self._gram64, self._m64 = stats.second_moment.double(), weight.t().double()
        self._cm64 = self._gram64 @ self._m64  # C M (in × out, float64), shared by every TT candidate's error
        self._total64 = float((self._m64 * self._cm64).sum())
        self._cores: dict[tuple[int, ...], list[Tensor]] = {}  # float cores per bond caps
        self._svds: dict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]] = {}  # by the ranks kept to the right

    def int_error(self, bits: int, group: int | None) -> float:
        """Σ_i C_ii ||(M - M̂)_i||² / tr(Mᵀ C M) for the int grid (rows i: input features)."""
        diff = (self.weight - fake_quant(self.weight, bits, group, self.diag)).float()  # out × in
        return float((diff.square().sum(0) * self.diag).sum()) / self.total

    def int_candidate(self, bits: int, group: int | None) -> tuple[int, float]:
        return QuantSpec(bits, group).nbytes(self.weight.numel()), self.int_error(bits, group)

    def _caps(self, rank: int) -> tuple[int, ...]:
        return capped_ranks(self.row_modes + self.col_modes, rank)

    def _quantized_cores(self, rank: int, bits: int | None, group: int | None) -> list[Tensor]:
        caps = self._caps(rank)
        if caps not in self._cores:
            self._cores[caps] = self._tt_cores(rank)
        cores = self._cores[caps]
        return cores if bits is None else [fake_quant(core, bits, group) for core in cores]

    def tt_estimate(self, rank: int, bits: int | None = None, group: int | None = 64) -> float:
        """``tt_error(tt_approx(rank, bits, group))`` without the dense stand-in: with M̂ = R Q (R: the input-side
        cores' chain, in × r; Q: the output-side cores', r × out), tr(Eᵀ C E) = tr(Mᵀ C M) - 2 ⟨(C M) Qᵀ, R⟩
        + ⟨Rᵀ C R, Q Qᵀ⟩, in float64: d_in² r + d_in r d_out products instead of d_in² d_out."""
        cores = self._quantized_cores(rank, bits, group)
        d = len(self.row_modes)
        r_mid = cores[d].shape[0]
        rows = _chain(cores[:d]).reshape(-1, r_mid)[: self.rows].double()
        cols = _chain(cores[d:]).reshape(r_mid, -1)[:, : self.cols].double()
        cross = float(((self._cm64 @ cols.T) * rows).sum())
        quad = float(((rows.T @ (self._gram64 @ rows)) * (cols @ cols.T)).sum())
        return max(self._total64 - 2 * cross + quad, 0.0) / self.total

    def tt_approx(self, rank: int, bits: int | None = None, group: int | None = 64) -> Tensor:
        """M̂ (in × out, float32) of the whitened construction at ``rank`` without the ALS refit, its cores on the
        ``bits``-bit grid with a scale per ``group`` weights (``None`` bits: float cores). The float cores of every
        rank asked are kept (the int8 and int4 candidates of one rank and the short-list's stand-ins share them)."""
        cores = self._quantized_cores(rank, bits, group)
        rows = 1
        for n in self.row_modes:
            rows *= n
        return _chain(cores).reshape(rows, -1)[: self.rows, : self.cols]

    def _tt_cores(self, rank: int) -> list[Tensor]:
        d, caps = len(self.row_modes), self._caps(rank)
        rest, right_rank, col_cores, kept = self.white, 1, [], ()
        for j in reversed(range(len(self.col_modes))):
            u, sv, vh = self._column_svd(kept, rest, right_rank)
            r = max(1, min(caps[d + j], sv.numel()))
            col_cores.insert(0, vh[:r].reshape(r, self.col_modes[j], right_rank))
            rest, right_rank, kept = u[:, :r] * sv[:r], r, (*kept, r)
        q = _chain(col_cores).reshape(right_rank, -1)  # orthonormal rows
        b = self.m @ q.T
        if d == 1:
            row_cores = [b.reshape(1, self.row_modes[0], right_rank)]
        else:
            shape = self.row_modes[:-1] + (self.row_modes[-1] * right_rank,)
            row_cores = [core.float() for core in tt_svd(b.reshape(shape).double(), tuple(caps[:d]) + (1,))]
            row_cores[-1] = row_cores[-1].reshape(row_cores[-1].shape[0], self.row_modes[-1], right_rank)
        return row_cores + col_cores

    def _column_svd(self, kept: tuple[int, ...], rest: Tensor, right_rank: int) -> tuple[Tensor, Tensor, Tensor]:
        """The SVD of the right-to-left sweep's next unfolding, which depends only on the ranks ``kept`` at the
        bonds to its right: every candidate rank that kept the same ones shares it (all share the first; ranks
        whose column-side caps are all reached share every one and differ only in where the middle bond is cut)."""
        if kept not in self._svds:
            j = len(self.col_modes) - 1 - len(kept)
            self._svds[kept] = torch.linalg.svd(rest.reshape(-1, self.col_modes[j] * right_rank), full_matrices=False)
        return self._svds[kept]

    def tt_error(self, approx: Tensor) -> float:
        """tr((M - M̂)ᵀ C (M - M̂)) / tr(Mᵀ C M) of a dense stand-in (in × out), in float32."""
        diff = self.weight.t().float() - approx
        return float((diff * (self.gram @ diff)).sum()) / self.total
