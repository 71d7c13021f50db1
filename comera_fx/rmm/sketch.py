"""Random sketches along the token dimension: S (rows × tokens) with E[SᵀS] = I, applied without building S.

RMM's weight gradient dW = dYᵀX is estimated as (S·dY)ᵀ(S·X): unbiased whenever E[SᵀS] = I, so every sketch here
carries its scale inside S (a Gaussian S has entries N(0, 1/rows), not N(0, 1)). S is regenerated from a seed:
the forward pass applies it to X and keeps only S·X and the seed; the backward applies the same S to dY.

Sketches:

* ``gaussian``: iid N(0, 1/rows) entries, generated block by block over the tokens (at most ~1 M entries alive).
* ``rademacher``: iid ±1/√rows entries, blocked the same way.
* ``srht``: subsampled randomized Hadamard transform, S = √(1/rows)·P·H·D with D random signs, H the ±1 Sylvester
  Hadamard matrix of the next power of two ≥ tokens (X zero-padded), and P ``rows`` rows chosen uniformly without
  replacement: E[PᵀP] = rows/n·I and HᵀH = n·I give E[SᵀS] = I. H is applied as a Kronecker product of small
  Hadamard factors, one batched GEMM per factor, so its cost is O(n·log n·features) instead of O(rows·n·features).

The sketch is a ``torch.library`` custom op (``comera_fx::sketch_rows``) with a fake implementation: Dynamo and
AOTAutograd see one opaque node, and the generator it uses internally never enters a traced graph.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

SKETCHES = ("gaussian", "rademacher", "srht")

# Entries of S generated at once by the blocked Gaussian / Rademacher sketches (4 MiB in float32).
_BLOCK_ENTRIES = 1 << 20
# Largest Hadamard factor applied as one GEMM (2**6 = 64: a factor's GEMM then has K = 64, cheap next to the copy).
_HADAMARD_FACTOR_BITS = 6


def check_rho(rho) -> Fraction:
    """ρ as an exact fraction in (0, 1] (0.1 is 1/10); ValueError naming the fix otherwise."""
    if isinstance(rho, bool) or not isinstance(rho, (int, float, Fraction)) or not math.isfinite(float(rho)):
        raise ValueError(f"rho must be a number in (0, 1] (the fraction of tokens the sketch keeps), got {rho!r}")
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1] (the fraction of tokens the sketch keeps, e.g. rho=0.25), got {rho!r}")
    return Fraction(rho).limit_denominator(1 << 20)


def check_sketch(kind) -> str:
    if kind not in SKETCHES:
        raise ValueError(f"sketch must be one of {', '.join(map(repr, SKETCHES))}, got {kind!r}")
    return kind


@torch.compiler.assume_constant_result
def rho_ratio(rho) -> tuple[int, int]:
    """(numerator, denominator) of ``check_rho(rho)``; a constant to ``torch.compile`` (validated at trace time)."""
    if isinstance(rho, tuple):
        return rho
    fraction = check_rho(rho)
    return fraction.numerator, fraction.denominator


def projected_rows(tokens, ratio: tuple[int, int]):
    """B_proj = max(1, ⌊ρ·B⌋) for ρ = ratio[0] / ratio[1], in integer arithmetic: a symbolic token count stays
    symbolic (no guard)."""
    rows = (tokens * ratio[0]) // ratio[1]
    if isinstance(rows, int):
        return max(1, rows)
    return torch.sym_max(1, rows)


@torch.library.custom_op("comera_fx::draw_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _draw_seed(like: Tensor) -> Tensor:
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=like.device)


@_draw_seed.register_fake
def _(like: Tensor) -> Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


def draw_seed(like: Tensor) -> Tensor:
    """A fresh seed from the global generator of ``like``'s device (never a new default-seeded generator): each
    call gets its own S, and ``torch.manual_seed`` makes a run reproducible.

    An opaque op rather than ``torch.randint`` in the graph: AOTAutograd's partitioner may recompute an aten
    random op in the backward graph (Inductor then draws a different value there), and a backward that draws
    another seed applies another S to dY — a silently wrong gradient. A custom op is saved, never recomputed.
    """
    return _draw_seed(like)


def _generator(seed: Tensor, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed.item()))
    return generator


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocked_dense_sketch(x: Tensor, generator: torch.Generator, rows: int, kind: str) -> Tensor:
    dtype = _compute_dtype(x.dtype)
    tokens = x.shape[0]
    out = torch.zeros(rows, x.shape[1], dtype=dtype, device=x.device)
    block = max(1, _BLOCK_ENTRIES // rows)
    for start in range(0, tokens, block):
        width = min(block, tokens - start)
        if kind == "gaussian":
            s = torch.randn(rows, width, generator=generator, dtype=dtype, device=x.device)
        else:
            s = torch.randint(0, 2, (rows, width), generator=generator, device=x.device).to(dtype).mul_(2).sub_(1)
        out.addmm_(s, x[start : start + width].to(dtype))
    return out.mul_(rows**-0.5)


def _sylvester(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_rows(x: Tensor) -> Tensor:
    """H·x for the unnormalised ±1 Sylvester Hadamard matrix H (x has a power-of-two number of rows)."""
    n, features = x.shape
    bits = n.bit_length() - 1
    if 1 << bits != n:
        raise ValueError(f"hadamard_rows needs a power-of-two number of rows, got {n}")
    factors = []
    while bits > 0:
        take = min(bits, _HADAMARD_FACTOR_BITS)
        factors.append(1 << take)
        bits -= take
    y = x
    before = 1
    for f in factors:
        after = n // (before * f)
        # H = H_f1 ⊗ H_f2 ⊗ ...: factor f acts on its own axis of the (before, f, after·features) view.
        y = torch.matmul(_sylvester(f, x.dtype, x.device), y.reshape(before, f, after * features))
        before *= f
    return y.reshape(n, features)


def _hadamard_selected(y: Tensor, chosen: Tensor, signs: Tensor) -> Tensor:
    """(H·D·y)[chosen] for the ±1 Sylvester matrix H of y's (power-of-two) row count and D = diag(signs).

    Up to 2**14 rows, H = H_a ⊗ H_b with a, b ≤ 128: the inner factor, with D folded into it, is one batched GEMM
    over y viewed as (a, b, features); the outer one a batched GEMM over the b axis of that result read transposed
    (no copy); only the chosen rows are gathered — two passes over y. (One (a × b·features) GEMM for the outer
    factor ran 2-3x slower: MKL with a very wide right operand.)
    """
    n, features = y.shape
    if n <= 128 or n > 1 << 14:
        return hadamard_rows(y * signs[:, None])[chosen]
    bits = n.bit_length() - 1
    a = 1 << ((bits + 1) // 2)
    b = n // a
    signed_inner = _sylvester(b, y.dtype, y.device)[None] * signs.reshape(a, 1, b)  # H_b·D per block
    inner = torch.matmul(signed_inner, y.reshape(a, b, features))  # [i1, i2', :]
    outer = torch.matmul(_sylvester(a, y.dtype, y.device), inner.transpose(0, 1))  # [i2', i1', :]
    return outer[chosen % b, chosen // b]


def _srht_sketch(x: Tensor, generator: torch.Generator, rows: int) -> Tensor:
    dtype = _compute_dtype(x.dtype)
    tokens = x.shape[0]
    n = 1 << max(0, (tokens - 1).bit_length())
    signs = torch.randint(0, 2, (n,), generator=generator, device=x.device).to(dtype).mul_(2).sub_(1)
    chosen = torch.randperm(n, generator=generator, device=x.device)[:rows]
    y = x.to(dtype)
    if n != tokens:  # zero rows up to the power of two: they add nothing to S·x
        y = torch.cat([y, y.new_zeros(n - tokens, x.shape[1])])
    return _hadamard_selected(y, chosen, signs).mul_(rows**-0.5)


@torch.library.custom_op("comera_fx::sketch_rows", mutates_args=())
def sketch_rows(x: Tensor, seed: Tensor, rows: int, kind: str) -> Tensor:
    """S·x for x (tokens × features) and the (rows × tokens) sketch S of kind ``kind`` drawn from ``seed``.

    The same (seed, tokens, rows, kind) always gives the same S, whatever x's width: that is how backward applies
    the forward's S to dY. E[SᵀS] = I for every kind.
    """
    if x.dim() != 2:
        raise ValueError(f"sketch_rows takes a (tokens × features) matrix, got shape {tuple(x.shape)}")
    generator = _generator(seed, x.device)
    if kind == "srht":
        out = _srht_sketch(x, generator, rows)
    elif kind in ("gaussian", "rademacher"):
        out = _blocked_dense_sketch(x, generator, rows, kind)
    else:
        check_sketch(kind)
    return out.to(x.dtype)


@sketch_rows.register_fake
def _(x: Tensor, seed: Tensor, rows: int, kind: str) -> Tensor:
    return x.new_empty((rows, x.shape[1]))


def sketch_matrix(seed: Tensor, tokens: int, rows: int, kind: str, dtype=torch.float64) -> Tensor:
    """S itself (rows × tokens), by sketching the identity — for tests and inspection, never the hot path."""
    return sketch_rows(torch.eye(tokens, dtype=dtype), seed, rows, kind)
