"""Activation-aware (whitened) TT-SVD: approximate M so that ||X (M - M̂)||_F is small on real inputs X.

Pure tensor math (float64), no modules. A linear layer's TT matrix is M = Wᵀ (rows = input features, cols =
output features) in CoMERA's TT layout: the row-side cores (input modes) come first, then the column-side cores
(output modes); the bond between the halves is the matrix rank. With C = XᵀX / n (``comera_fx.calibrate``)

    ||X (M - M̂)||_F² / n = tr((M - M̂)ᵀ C (M - M̂)) = ||Sᵀ (M - M̂)||_F²   for any S with S Sᵀ = C,

so the error that matters is the Frobenius error of the *whitened* matrix SᵀM. The whitening acts on the input
index as a whole, which TT spreads over several cores: multiplying a TT by S⁻ᵀ on that side is not core-local.
The construction here avoids that inverse altogether:

1. **Column side and middle bond, exactly in the weighted norm.** A right-to-left TT-SVD sweep of A = SᵀM over
   the output modes. At every output-side bond the input index sits entirely on the left of the unfolding, so the
   truncated SVD of the whitened unfolding is the best truncation in the weighted norm (the middle bond's SVD is
   SVD-LLM's whitened SVD). The right singular vectors (the output-side cores, right-orthonormal, merged into
   Q: r × cols) do not involve S, so they are valid for M itself, and the remaining factor un-whitens without
   inverting S: S⁻ᵀ (A Qᵀ) = M Qᵀ =: B (rows × r).
2. **Input side by weighted least squares.** B must become a TT over the input modes (open index r). Started
   from the plain TT-SVD of B, an ALS sweep re-fits each input-side core to minimise tr((B - P)ᵀ C (B - P)),
   the other cores kept orthonormal; each core's normal equations (Φᵀ (C ⊗ I) Φ) g = Φᵀ vec(C B) are solved by
   conjugate gradients, warm-started, so every step lowers the objective. Since Q has orthonormal rows,
   ||Sᵀ(M - P Q)||² = ||Sᵀ(M - B Q)||² + ||Sᵀ(B - P)||², so this is the weighted error of the whole TT.
3. **Never worse than plain TT-SVD.** The plain TT-SVD of M at the same caps is computed too and returned when
   its weighted error is lower (it can be only when the input-side truncation dominates).

``C`` is regularised as C + eps·mean(diag C)·I (SVD-LLM), which keeps directions no calibration token excited
from being free. Any factor S gives the same weighted norm; the symmetric root C^{1/2} is used because its
unfoldings over the input modes are the best available proxy for the input-side bonds' energies (``allocate``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .decompose import pad_matrix, tt_svd
from .shapes import feasible_ranks

#: Relative ridge added to the calibration second moment (times the mean of its diagonal).
DEFAULT_EPS = 1e-4
#: ALS sweeps and CG iterations per core solve of the input-side refit.
ALS_SWEEPS = 2
CG_ITERS = 30


def regularized_gram(gram: Tensor, size: int, eps: float = DEFAULT_EPS) -> Tensor:
    """C (d × d, float64) zero-padded to ``size`` (padded input features never carry signal) plus eps·mean(diag)·I."""
    d = gram.shape[0]
    if gram.shape != (d, d):
        raise ValueError(f"the input second moment must be square, got {tuple(gram.shape)}")
    if size < d:
        raise ValueError(f"cannot pad a {d} x {d} second moment down to {size}")
    c = torch.zeros(size, size, dtype=torch.float64, device=gram.device)
    c[:d, :d] = gram.to(torch.float64)
    c = (c + c.T) / 2
    mean_diag = float(torch.diagonal(c)[:d].mean()) if d else 0.0
    scale = mean_diag if mean_diag > 0 else 1.0
    return c + (eps * scale) * torch.eye(size, dtype=torch.float64, device=gram.device)


def sqrt_factor(c: Tensor) -> Tensor:
    """The symmetric root S = C^{1/2} of a positive definite C (S Sᵀ = C)."""
    values, vectors = torch.linalg.eigh(c)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T


def weighted_error(matrix: Tensor, approx: Tensor, gram: Tensor) -> float:
    """sqrt(tr((M - M̂)ᵀ C (M - M̂))) = ||X(M - M̂)||_F / sqrt(n) for C = XᵀX / n (float64)."""
    e = matrix.to(torch.float64) - approx.to(torch.float64)
    c = gram.to(torch.float64)
    return float(torch.einsum("ij,ik,kj->", e, c, e).clamp_min(0).sqrt())


def tt_chain_to_matrix(
    cores: Sequence[Tensor], row_modes: Sequence[int], col_modes: Sequence[int], rows: int, cols: int
) -> Tensor:
    """Dense M (rows × cols, float64) of 3-way TT cores over row_modes + col_modes, padding sliced away."""
    acc = cores[0].to(torch.float64).reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        acc = (acc @ core.to(torch.float64).reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    return acc.reshape(math.prod(row_modes), math.prod(col_modes))[:rows, :cols]


def whitened_matrix_to_tt(
    matrix: Tensor,
    gram: Tensor,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    max_ranks: Sequence[int] | None = None,
    *,
    eps: float = DEFAULT_EPS,
    sweeps: int = ALS_SWEEPS,
) -> list[Tensor]:
    """TT cores (CoMERA layout, as ``matrix_to_tt``) of M (rows × cols) minimising ||Sᵀ(M - M̂)||_F, C = S Sᵀ.

    ``gram`` is C (rows × rows) of the inputs that multiply M from the left (x @ M); ``max_ranks`` caps each bond
    (len(row_modes) + len(col_modes) + 1 entries, ends 1). Returned in the matrix's dtype. See the module
    docstring for the construction; the result's weighted error is never above plain TT-SVD's at the same caps.
    """
    if not matrix.is_floating_point():
        raise TypeError(f"matrix must be floating point, got {matrix.dtype}")
    rows, cols = matrix.shape
    if gram.shape != (rows, rows):
        raise ValueError(f"the input second moment is {tuple(gram.shape)} but M has {rows} input rows")
    row_modes, col_modes = tuple(row_modes), tuple(col_modes)
    d, e = len(row_modes), len(col_modes)
    dims = row_modes + col_modes
    caps = tuple(max_ranks) if max_ranks is not None else feasible_ranks(dims)
    if len(caps) != d + e + 1:
        raise ValueError(f"max_ranks needs {d + e + 1} entries, got {len(caps)}")
    padded_rows, padded_cols = math.prod(row_modes), math.prod(col_modes)
    m = pad_matrix(matrix.detach().to(torch.float64), padded_rows, padded_cols)
    c = regularized_gram(gram.detach(), padded_rows, eps)
    s = sqrt_factor(c)

    # 1. Output-side cores and the middle bond: right-to-left SVDs of the whitened matrix.
    rest = s.T @ m
    right_rank = 1
    col_cores: list[Tensor] = []
    for j in reversed(range(e)):
        unfolding = rest.reshape(-1, col_modes[j] * right_rank)
        u, sv, vh = torch.linalg.svd(unfolding, full_matrices=False)
        rank = max(1, min(caps[d + j], sv.numel()))
        col_cores.insert(0, vh[:rank].reshape(rank, col_modes[j], right_rank))
        rest = u[:, :rank] * sv[:rank]
        right_rank = rank
    q = col_cores[0].reshape(right_rank, -1)
    for core in col_cores[1:]:
        q = (q.reshape(-1, core.shape[0]) @ core.reshape(core.shape[0], -1)).reshape(right_rank, -1)
    b = m @ q.T  # = S⁻ᵀ (whitened remainder): no inverse needed

    # 2. Input-side cores: plain TT-SVD of B as the start, then the weighted ALS refit.
    row_cores = _row_side_tt(b, row_modes, caps[: d + 1])
    row_cores = refit_row_cores(row_cores, b, c, sweeps=sweeps)
    cores = row_cores + col_cores

    # 3. The plain TT-SVD at the same caps, when it is better in the weighted norm.
    plain = tt_svd(m.reshape(dims), caps)
    mine = tt_chain_to_matrix(cores, row_modes, col_modes, padded_rows, padded_cols)
    theirs = tt_chain_to_matrix(plain, row_modes, col_modes, padded_rows, padded_cols)
    if weighted_error(m, theirs, c) < weighted_error(m, mine, c):
        cores = plain
    return [core.to(matrix.dtype).contiguous() for core in cores]


def _row_side_tt(b: Tensor, row_modes: tuple[int, ...], caps: Sequence[int]) -> list[Tensor]:
    """Plain TT-SVD of B (prod(row_modes) × r) over the row modes, the last core keeping B's column index open."""
    r = b.shape[1]
    d = len(row_modes)
    if d == 1:
        return [b.reshape(1, row_modes[0], r)]
    shape = row_modes[:-1] + (row_modes[-1] * r,)
    cores = tt_svd(b.reshape(shape), tuple(caps[:d]) + (1,))
    last = cores[-1]
    return cores[:-1] + [last.reshape(last.shape[0], row_modes[-1], r)]


# ------------------------------------------------------------------------------------------ weighted ALS refit


def refit_row_cores(
    cores: list[Tensor], b: Tensor, c: Tensor, *, sweeps: int = ALS_SWEEPS, cg_iters: int = CG_ITERS
) -> list[Tensor]:
    """ALS on f(P) = tr((B - P)ᵀ C (B - P)) over the cores of P (a TT over the row modes with open last index).

    Each core is solved with the others orthonormal (left of it left-orthogonal, right of it right-orthogonal),
    so its normal matrix is Φᵀ(C ⊗ I)Φ with orthonormal Φ; CG starts from the current core, hence f never rises.
    """
    cores = [core.to(torch.float64).clone() for core in cores]
    n = len(cores)
    if n == 1:
        return cores  # P = B exactly
    for k in range(n - 1, 0, -1):  # right-orthogonalise cores 1..n-1, the norm moving to core 0
        cores[k - 1], cores[k] = _push_left(cores[k - 1], cores[k])
    order = list(range(n)) + list(range(n - 2, -1, -1))
    for _ in range(sweeps):
        for step, k in enumerate(order):
            cores[k] = _solve_core(cores, k, b, c, cg_iters)
            going_right = step < n - 1
            if going_right and k < n - 1:
                cores[k], cores[k + 1] = _push_right(cores[k], cores[k + 1])
            elif not going_right and k > 0:
                cores[k - 1], cores[k] = _push_left(cores[k - 1], cores[k])
    return cores


def _push_right(core: Tensor, nxt: Tensor) -> tuple[Tensor, Tensor]:
    """core = Q R (Q left-orthogonal); R moves into the next core."""
    r0, m, r1 = core.shape
    q, r = torch.linalg.qr(core.reshape(r0 * m, r1))
    return q.reshape(r0, m, q.shape[1]), torch.einsum("ab,bjc->ajc", r, nxt)


def _push_left(prev: Tensor, core: Tensor) -> tuple[Tensor, Tensor]:
    """core = L Q (Q right-orthogonal); L moves into the previous core."""
    r0, m, r1 = core.shape
    q, r = torch.linalg.qr(core.reshape(r0, m * r1).T)
    return torch.einsum("ajb,cb->ajc", prev, r), q.T.reshape(q.shape[1], m, r1)


def _solve_core(cores: list[Tensor], k: int, b: Tensor, c: Tensor, iters: int) -> Tensor:
    left = torch.ones(1, 1, dtype=torch.float64, device=b.device)
    for core in cores[:k]:
        left = (left @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    # (r_k, N_>k, open index): the identity on the open index, then the cores right of k merged in.
    right = torch.eye(b.shape[1], dtype=torch.float64, device=b.device)[:, None, :]
    for core in reversed(cores[k + 1 :]):
        right = torch.einsum("ajb,bnz->ajnz", core, right).reshape(core.shape[0], -1, right.shape[-1])
    shape = cores[k].shape
    n_left, n_right, r_open = left.shape[0], right.shape[1], b.shape[1]

    n_mode, r_left, r_right = shape[1], shape[0], shape[2]
    right_mat = right.reshape(r_right, n_right * r_open)

    def expand(v: Tensor) -> Tensor:  # Φ v: (rows × r_open)
        t = (left @ v.reshape(r_left, n_mode * r_right)).reshape(n_left * n_mode, r_right)
        return (t @ right_mat).reshape(-1, r_open)

    def adjoint(x: Tensor) -> Tensor:  # Φᵀ x: core-shaped
        t = x.reshape(n_left * n_mode, n_right * r_open) @ right_mat.T
        return (left.T @ t.reshape(n_left, n_mode * r_right)).reshape(shape)

    def hess(v: Tensor) -> Tensor:
        return adjoint(c @ expand(v))

    rhs = adjoint(c @ b)
    x = cores[k]
    res = rhs - hess(x)
    p = res.clone()
    rs = float((res * res).sum())
    stop = 1e-24 * max(float((rhs * rhs).sum()), 1e-300)
    for _ in range(iters):
        if rs <= stop:
            break
        hp = hess(p)
        curvature = float((p * hp).sum())
        if curvature <= 0:
            break
        alpha = rs / curvature
        x = x + alpha * p
        res = res - alpha * hp
        rs_new = float((res * res).sum())
        p = res + (rs_new / rs) * p
        rs = rs_new
    return x
