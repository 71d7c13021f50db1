"""The fused low-rank chain ``x @ L @ R (+ bias)`` as one Triton kernel, and its op ``comera_fx::lowrank_chain``.

A TT linear (CoMERA's layout: row cores, then column cores) is ``x @ L @ R`` once each half of its chain is merged
(``ops.tt_factors``): L is (in × r), R is (r × out) with r the middle bond, small. Two GEMMs would write the
(tokens × r) intermediate and read it back, and cost two launches; here one program holds a tile of rows of
``x @ L`` in registers and streams the output columns through it. On a GPU where a small model's step is bound by
launches (benchmarks/RESULTS.md, the H200 look) that is one kernel instead of two forward and three instead of four
backward. Imported only through ``kernels._load`` (it imports triton).

Op (inputs contiguous, float16 / bfloat16 / float32, accumulation in float32, the intermediate rounded to the
input dtype as aten's two GEMMs would store it):

* ``lowrank_chain(x (M, K), left (K, r), right (r, N), bias (N,) or None, programs) -> (y (M, N), t (M, r))``:
  ``t = x @ left`` and ``y = t @ right + bias``. ``programs`` (0: as many as the device has multiprocessors, twice)
  is the least number of programs: when the row tiles are fewer, the output columns are split too, each split
  recomputing its tile of ``t`` (r·K work per row, small against r·N when N is split in few parts).
* Backward: ``u = g @ rightᵀ`` and ``dx = u @ leftᵀ`` are the same kernel on ``(g, rightᵀ, leftᵀ)``;
  ``d left = xᵀ @ u`` and ``d right = tᵀ @ g`` are aten GEMMs (reductions over the tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ._triton import _dot, _precision, _tile, _upcast

#: Largest middle rank the kernel holds in registers (a BLOCK_M × r tile); beyond it aten's two GEMMs run.
MAX_RANK = 128


@triton.jit
def _lowrank_chain_kernel(
    x_ptr,
    left_ptr,
    right_ptr,
    bias_ptr,
    y_ptr,
    t_ptr,
    M,
    K,
    R,
    N,
    COLS_PER_SPLIT,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    split = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    row_ok = offs_m < M
    rank_ok = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            left_ptr + offs_k[:, None].to(tl.int64) * R + offs_r[None, :],
            mask=(offs_k[:, None] < K) & rank_ok[None, :],
            other=0.0,
        )
        acc += _dot(a, b, PRECISION, UPCAST)
    t = acc.to(y_ptr.dtype.element_ty)  # stored at the input dtype, as aten's first GEMM would
    # Every split computes the same tile of t; the first one writes it (the backward's d right = tᵀ @ g).
    if split == 0:
        t_dest = t_ptr + offs_m[:, None].to(tl.int64) * R + offs_r[None, :]
        tl.store(t_dest, t, mask=row_ok[:, None] & rank_ok[None, :])
    first = split * COLS_PER_SPLIT
    for n0 in range(0, COLS_PER_SPLIT, BLOCK_N):
        offs_n = first + n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        b = tl.load(
            right_ptr + offs_r[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=rank_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        out = _dot(t, b, PRECISION, UPCAST)
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def chain_grid(m: int, n: int, block_m: int, block_n: int, programs: int) -> tuple[int, int, int]:
    """(row tiles, column splits, columns per split): at least ``programs`` programs where the columns allow it,
    each split a whole number of column tiles."""
    row_tiles = triton.cdiv(m, block_m)
    col_tiles = triton.cdiv(n, block_n)
    splits = min(col_tiles, max(1, triton.cdiv(programs, row_tiles)))
    per_split = triton.cdiv(col_tiles, splits) * block_n
    return row_tiles, triton.cdiv(n, per_split), per_split


def _default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: fewest is fastest


@triton_op("comera_fx::lowrank_chain", mutates_args={})
def lowrank_chain(x: Tensor, left: Tensor, right: Tensor, bias: Tensor | None, programs: int) -> tuple[Tensor, Tensor]:
    x, left, right = x.contiguous(), left.contiguous(), right.contiguous()
    m, k = x.shape
    r, n = right.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    t = torch.empty((m, r), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y, t
    if k == 0 or r == 0:  # an empty contraction: t = 0, y = bias
        t.zero_()
        y.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(y))
        return y, t
    block_m, block_k, block_r, block_n = 64, _tile(k), _tile(r, MAX_RANK), _tile(n)
    rows, splits, per_split = chain_grid(m, n, block_m, block_n, programs or _default_programs(x.device))
    wrap_triton(_lowrank_chain_kernel)[(rows, splits)](
        x,
        left,
        right,
        bias.contiguous() if bias is not None else x,
        y,
        t,
        m,
        k,
        r,
        n,
        per_split,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        PRECISION=_precision(x.dtype),
        UPCAST=_upcast(x.dtype),
    )
    return y, t


@lowrank_chain.register_fake
def _lowrank_chain_fake(x, left, right, bias, programs):
    return x.new_empty((x.shape[0], right.shape[1])), x.new_empty((x.shape[0], right.shape[0]))


def _chain_setup_context(ctx, inputs, output):
    x, left, right, bias, programs = inputs
    _, t = output
    ctx.save_for_backward(x, left, right, t)
    ctx.has_bias, ctx.programs = bias is not None, programs
    ctx.mark_non_differentiable(t)


def _chain_backward(ctx, grad_y, grad_t):
    x, left, right, t = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    # u = g·Rᵀ (the gradient of t) and dx = u·Lᵀ: the forward kernel on the transposed factors, no bias.
    grad_x, grad_t_total = lowrank_chain(grad_y, right.t(), left.t(), None, ctx.programs)
    grad_left = x.t() @ grad_t_total
    grad_right = t.t() @ grad_y
    grad_bias = grad_y.sum(0) if ctx.has_bias else None
    return grad_x, grad_left, grad_right, grad_bias, None


lowrank_chain.register_autograd(_chain_backward, setup_context=_chain_setup_context)
