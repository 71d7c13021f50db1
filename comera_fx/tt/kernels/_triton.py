"""Triton kernels and their ``torch.library.triton_op`` registrations. Imported only through ``_load`` in
``__init__``: importing this module imports triton, and defines the ops ``comera_fx::ttm_lookup``,
``comera_fx::ttm_lookup_backward`` and ``comera_fx::gated_merge``.

Ops (all inputs contiguous, float16 / bfloat16 / float32, accumulation in float32):

* ``ttm_lookup(index (N,), left (A_L, B_L, r), right (A_R, r, B_R), gate (r,) or None, cols) -> (N, cols)``:
  row ``i`` of a TT-matrix whose chain was pre-contracted into a left and a right half is
  ``left[i // A_R] · diag(gate) · right[i % A_R]`` (a (B_L × r)(r × B_R) GEMM), flattened row-major and cut to
  ``cols``. One program per (token, output tile); the table is never built.
* ``ttm_lookup_backward``: per token, ``dL[i_L] += dOut_t · right[i_R]ᵀ`` and
  ``dR[i_R] += (left[i_L]·g)ᵀ · dOut_t`` with float32 atomics into table-sized buffers; the gate gradient is a
  reduction of ``dL`` (aten, table-sized).
* ``gated_merge(a (M, K), gate (K,) or None, b (K, N), inner, a_mode) -> (M·N)``: ``(a · diag(gate)) @ b`` with the
  gate applied to the loaded ``a`` tile (no gated copy of the core is ever written) and the result stored straight
  into the permuted layout of ``ops.ttm_merge``: ``(M/inner, inner, a_mode, N/a_mode) -> (M/inner, a_mode, inner,
  N/a_mode)``, so the reshape / permute / copy after each merge GEMM is gone too. Backward is aten: the merges are
  batch-independent and small (core-sized), Inductor fuses its elementwise parts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

try:  # TRITON_INTERPRET=1 makes @triton.jit return an InterpretedFunction that runs on CPU tensors with numpy
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - depends on the triton build
    _InterpretedFunction = ()

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Largest tiles per program (tl.dot needs every tile dimension >= 16).
_MAX_TILE = 64
_MIN_TILE = 16


def _tile(n: int, cap: int = _MAX_TILE) -> int:
    return max(_MIN_TILE, min(cap, triton.next_power_of_2(max(int(n), 1))))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for float32: IEEE unless torch itself allows TF32 matmuls (as aten would then use)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Upcast dot operands to float32: only for bfloat16 in interpret mode, whose tl.dot multiplies the raw bf16 bit
    patterns (the interpreter does not support bf16 dots, triton-lang/triton#11584). False on GPU."""
    return dtype == torch.bfloat16 and interpreted()


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# ------------------------------------------------------------------------------------------------ TTM lookup


@triton.jit
def _ttm_lookup_fwd_kernel(
    index_ptr,
    left_ptr,
    right_ptr,
    gate_ptr,
    out_ptr,
    A_R,
    BL,
    BR,
    R,
    COLS,
    HAS_GATE: tl.constexpr,
    BLOCK_BL: tl.constexpr,
    BLOCK_BR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    token = tl.program_id(0)
    offs_bl = tl.program_id(1) * BLOCK_BL + tl.arange(0, BLOCK_BL)
    offs_br = tl.program_id(2) * BLOCK_BR + tl.arange(0, BLOCK_BR)
    row = tl.load(index_ptr + token).to(tl.int64)
    i_left = row // A_R
    i_right = row % A_R
    left_base = left_ptr + i_left * BL * R
    right_base = right_ptr + i_right * R * BR
    acc = tl.zeros((BLOCK_BL, BLOCK_BR), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        left = tl.load(
            left_base + offs_bl[:, None] * R + offs_r[None, :],
            mask=(offs_bl[:, None] < BL) & (offs_r[None, :] < R),
            other=0.0,
        )
        if HAS_GATE:
            gate = tl.load(gate_ptr + offs_r, mask=offs_r < R, other=0.0)
            left = (left.to(tl.float32) * gate.to(tl.float32)[None, :]).to(left.dtype)
        right = tl.load(
            right_base + offs_r[:, None] * BR + offs_br[None, :],
            mask=(offs_r[:, None] < R) & (offs_br[None, :] < BR),
            other=0.0,
        )
        acc += _dot(left, right, PRECISION, UPCAST)
    col = offs_bl[:, None] * BR + offs_br[None, :]
    mask = (offs_bl[:, None] < BL) & (offs_br[None, :] < BR) & (col < COLS)
    tl.store(out_ptr + token.to(tl.int64) * COLS + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ttm_lookup_bwd_kernel(
    grad_ptr,
    index_ptr,
    left_ptr,
    right_ptr,
    gate_ptr,
    grad_left_ptr,
    grad_right_ptr,
    A_R,
    BL,
    BR,
    R,
    COLS,
    HAS_GATE: tl.constexpr,
    BLOCK_BL: tl.constexpr,
    BLOCK_BR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    token = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row = tl.load(index_ptr + token).to(tl.int64)
    i_left = row // A_R
    i_right = row % A_R
    left_base = left_ptr + i_left * BL * R
    right_base = right_ptr + i_right * R * BR
    grad_base = grad_ptr + token.to(tl.int64) * COLS
    if HAS_GATE:
        gate = tl.load(gate_ptr + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
    # dL[i_left][:, r-block] += dOut (BL × BR) · right[i_right][r-block, :]ᵀ   (ungated: the gate is applied after)
    for bl0 in range(0, BL, BLOCK_BL):
        offs_bl = bl0 + tl.arange(0, BLOCK_BL)
        acc_l = tl.zeros((BLOCK_BL, BLOCK_R), dtype=tl.float32)
        for br0 in range(0, BR, BLOCK_BR):
            offs_br = br0 + tl.arange(0, BLOCK_BR)
            col = offs_bl[:, None] * BR + offs_br[None, :]
            g = tl.load(
                grad_base + col, mask=(offs_bl[:, None] < BL) & (offs_br[None, :] < BR) & (col < COLS), other=0.0
            )
            right_t = tl.load(
                right_base + offs_r[None, :] * BR + offs_br[:, None],
                mask=(offs_r[None, :] < R) & (offs_br[:, None] < BR),
                other=0.0,
            )
            acc_l += _dot(g.to(right_t.dtype), right_t, PRECISION, UPCAST)
        tl.atomic_add(
            grad_left_ptr + i_left * BL * R + offs_bl[:, None] * R + offs_r[None, :],
            acc_l,
            mask=(offs_bl[:, None] < BL) & (offs_r[None, :] < R),
        )
    # dR[i_right][r-block, :] += (left[i_left] · diag(gate))[:, r-block]ᵀ · dOut
    for br0 in range(0, BR, BLOCK_BR):
        offs_br = br0 + tl.arange(0, BLOCK_BR)
        acc_r = tl.zeros((BLOCK_R, BLOCK_BR), dtype=tl.float32)
        for bl0 in range(0, BL, BLOCK_BL):
            offs_bl = bl0 + tl.arange(0, BLOCK_BL)
            left_t = tl.load(
                left_base + offs_bl[None, :] * R + offs_r[:, None],
                mask=(offs_bl[None, :] < BL) & (offs_r[:, None] < R),
                other=0.0,
            )
            if HAS_GATE:
                left_t = (left_t.to(tl.float32) * gate[:, None]).to(left_t.dtype)
            col = offs_bl[:, None] * BR + offs_br[None, :]
            g = tl.load(
                grad_base + col, mask=(offs_bl[:, None] < BL) & (offs_br[None, :] < BR) & (col < COLS), other=0.0
            )
            acc_r += _dot(left_t, g.to(left_t.dtype), PRECISION, UPCAST)
        tl.atomic_add(
            grad_right_ptr + i_right * R * BR + offs_r[:, None] * BR + offs_br[None, :],
            acc_r,
            mask=(offs_r[:, None] < R) & (offs_br[None, :] < BR),
        )


def _lookup_tiles(bl: int, br: int, r: int) -> tuple[int, int, int]:
    return _tile(bl), _tile(br, 128), _tile(r)


@triton_op("comera_fx::ttm_lookup", mutates_args={})
def ttm_lookup(index: Tensor, left: Tensor, right: Tensor, gate: Tensor | None, cols: int) -> Tensor:
    index, left, right = index.contiguous(), left.contiguous(), right.contiguous()
    n = index.shape[0]
    a_right, r, br = right.shape
    bl = left.shape[1]
    out = torch.empty((n, cols), dtype=left.dtype, device=left.device)
    if n == 0:
        return out
    block_bl, block_br, block_r = _lookup_tiles(bl, br, r)
    grid = (n, triton.cdiv(bl, block_bl), triton.cdiv(br, block_br))
    gate_arg = gate.contiguous() if gate is not None else left
    wrap_triton(_ttm_lookup_fwd_kernel)[grid](
        index,
        left,
        right,
        gate_arg,
        out,
        a_right,
        bl,
        br,
        r,
        cols,
        HAS_GATE=gate is not None,
        BLOCK_BL=block_bl,
        BLOCK_BR=block_br,
        BLOCK_R=block_r,
        PRECISION=_precision(left.dtype),
        UPCAST=_upcast(left.dtype),
    )
    return out


@ttm_lookup.register_fake
def _ttm_lookup_fake(index, left, right, gate, cols):
    return left.new_empty((index.shape[0], cols))


@triton_op("comera_fx::ttm_lookup_backward", mutates_args={})
def ttm_lookup_backward(
    grad: Tensor, index: Tensor, left: Tensor, right: Tensor, gate: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Float32 gradients of the *gated* left table and of the right table (callers cast and apply the gate)."""
    grad, index, left, right = grad.contiguous(), index.contiguous(), left.contiguous(), right.contiguous()
    n, cols = grad.shape
    a_right, r, br = right.shape
    bl = left.shape[1]
    grad_left = torch.zeros(left.shape, dtype=torch.float32, device=left.device)
    grad_right = torch.zeros(right.shape, dtype=torch.float32, device=right.device)
    if n == 0:
        return grad_left, grad_right
    block_bl, block_br, block_r = _lookup_tiles(bl, br, r)
    gate_arg = gate.contiguous() if gate is not None else left
    wrap_triton(_ttm_lookup_bwd_kernel)[(n, triton.cdiv(r, block_r))](
        grad,
        index,
        left,
        right,
        gate_arg,
        grad_left,
        grad_right,
        a_right,
        bl,
        br,
        r,
        cols,
        HAS_GATE=gate is not None,
        BLOCK_BL=block_bl,
        BLOCK_BR=block_br,
        BLOCK_R=block_r,
        PRECISION=_precision(left.dtype),
        UPCAST=_upcast(left.dtype),
    )
    return grad_left, grad_right


@ttm_lookup_backward.register_fake
def _ttm_lookup_backward_fake(grad, index, left, right, gate):
    return left.new_empty(left.shape, dtype=torch.float32), right.new_empty(right.shape, dtype=torch.float32)


def _lookup_setup_context(ctx, inputs, output):
    index, left, right, gate, cols = inputs
    ctx.save_for_backward(index, left, right, gate)
    ctx.has_gate = gate is not None


def _lookup_backward(ctx, grad_out):
    index, left, right, gate = ctx.saved_tensors
    grad_gated_left, grad_right = ttm_lookup_backward(grad_out, index, left, right, gate if ctx.has_gate else None)
    grad_gate = None
    if ctx.has_gate:  # out = (left·diag g)·right: d left = dG·diag g, d g = Σ dG ⊙ left over (A_L, B_L)
        grad_gate = (grad_gated_left * left.float()).sum(dim=(0, 1)).to(gate.dtype)
        grad_left = (grad_gated_left * gate.float()).to(left.dtype)
    else:
        grad_left = grad_gated_left.to(left.dtype)
    return None, grad_left, grad_right.to(right.dtype), grad_gate, None


ttm_lookup.register_autograd(_lookup_backward, setup_context=_lookup_setup_context)


# --------------------------------------------------------------------------------------- gated core merge


@triton.jit
def _gated_merge_kernel(
    a_ptr,
    gate_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    INNER,
    A_MODE,
    TAIL,
    HAS_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        if HAS_GATE:
            gate = tl.load(gate_ptr + offs_k, mask=offs_k < K, other=0.0)
            a = (a.to(tl.float32) * gate.to(tl.float32)[None, :]).to(a.dtype)
        b = tl.load(
            b_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        acc += _dot(a, b, PRECISION, UPCAST)
    # Row m = (outer, inner), column n = (a_mode, tail): store at ((outer·A_MODE + a)·INNER + inner)·TAIL + tail.
    outer = offs_m // INNER
    inner = offs_m % INNER
    mode = offs_n // TAIL
    tail = offs_n % TAIL
    dest = ((outer[:, None].to(tl.int64) * A_MODE + mode[None, :]) * INNER + inner[:, None]) * TAIL + tail[None, :]
    tl.store(out_ptr + dest, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton_op("comera_fx::gated_merge", mutates_args={})
def gated_merge(a: Tensor, gate: Tensor | None, b: Tensor, inner: int, a_mode: int) -> Tensor:
    a, b = a.contiguous(), b.contiguous()
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m * n,), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = _tile(m), _tile(n), _tile(k)
    gate_arg = gate.contiguous() if gate is not None else a
    wrap_triton(_gated_merge_kernel)[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a,
        gate_arg,
        b,
        out,
        m,
        n,
        k,
        inner,
        a_mode,
        n // a_mode,
        HAS_GATE=gate is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=_precision(a.dtype),
        UPCAST=_upcast(a.dtype),
    )
    return out


@gated_merge.register_fake
def _gated_merge_fake(a, gate, b, inner, a_mode):
    return a.new_empty((a.shape[0] * b.shape[1],))


def _merge_setup_context(ctx, inputs, output):
    a, gate, b, inner, a_mode = inputs
    ctx.save_for_backward(a, gate, b)
    ctx.has_gate = gate is not None
    ctx.inner, ctx.a_mode = inner, a_mode


def _merge_backward(ctx, grad_out):
    a, gate, b = ctx.saved_tensors
    m, n = a.shape[0], b.shape[1]
    inner, a_mode = ctx.inner, ctx.a_mode
    # Undo the permuted store: (outer, a_mode, inner, tail) -> (outer, inner, a_mode, tail) = (M, N).
    grad = grad_out.reshape(m // inner, a_mode, inner, n // a_mode).permute(0, 2, 1, 3).reshape(m, n)
    gated_a = a * gate if ctx.has_gate else a
    grad_b = gated_a.t() @ grad
    through = grad @ b.t()  # d(gated a)
    if ctx.has_gate:
        return through * gate, (through * a).sum(0), grad_b, None, None
    return through, None, grad_b, None, None


gated_merge.register_autograd(_merge_backward, setup_context=_merge_setup_context)


def interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1: the kernels then run on CPU tensors (slowly)."""
    return isinstance(_ttm_lookup_fwd_kernel, _InterpretedFunction) if _InterpretedFunction else False
