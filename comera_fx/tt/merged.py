"""Merged forms of a TT matrix, cached for eager no-grad products of few tokens (decoding).

A decode step multiplies one token per sequence by every weight matrix. The planned chain of small contractions
then costs more in per-op overhead and in merging cores again on every call than in arithmetic. Under
``torch.no_grad()`` / inference mode, eagerly, a matrix instead keeps the cores merged into two operands per product
and runs two GEMMs:

* TT format: L (rows × r) and R (r × cols) at the middle bond, the matrix rank; ``x @ M`` is ``(x·L)·R``.
* TTM format (embeddings, a tied output head): the chain cut into two halves at its middle bond; a product contracts
  the token with one half, then with the other, in whichever order costs fewer FLOPs, and a row lookup gathers one
  row of each half's table (``ops.ttm_gather_rows``) instead of merging them on every call.

The operands are made on first use and cached on the matrix (``matrix.__dict__["_merged"]``) beside a copy of the
cores and gates they were made from; a call whose cores or gates are other tensors or differ from that copy bit for
bit (``cores_unchanged``) makes new ones. The key is the content, not the version counter: a fused optimizer step
(``AdamW(fused=True)``, the default of transformers' Trainer) and writes through ``param.data`` change the values
without bumping ``_version``, and a version-keyed cache served the old weights after them. Reading the cores costs
about a fifth of a GPT-2-small decode step at batch 1; ``serving.frozen(model)`` skips it for a block in which the
weights do not change (a serving loop). Never under autograd, a compiler or a tracer (a plain tensor only), never
copied or saved (``TTMatrix.__getstate__`` drops them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .layout import TTFormat, TTLayout

#: Use the cached forms at all (benchmarks switch it off to compare).
USE_MERGED_FORMS = True
#: Products of more tokens than this run the planned chain (prefill, training-sized batches).
MERGED_MAX_TOKENS = 64
#: A matrix's ``__dict__`` entry, set by ``serving.frozen``: while it is > 0 the forms are keyed on the cores'
#: storage and version counters only, without reading their content.
FROZEN = "_merged_frozen"


class Form(NamedTuple):
    """The two operands of one kind of product, with the sizes ``product`` reshapes by (TTM: (I_L, O_L, r, I_R,
    O_R) and which half a token meets first; TT: unused)."""

    first: Tensor
    second: Tensor
    sizes: tuple[int, ...] = ()
    left_first: bool = True


class Cached(NamedTuple):
    """What a matrix caches: where its cores and gates live (``storage_key``), views of them as 64-bit words and
    copies of those words from when the forms were made (``cores_unchanged``), its layout (None: the matrix cannot
    use merged forms, a TTM chain of one core or an empty stored core) and the forms made so far, by kind."""

    key: tuple
    words: tuple[Tensor, ...]
    snapshot: tuple[Tensor, ...]
    layout: TTLayout | None
    forms: dict[str, Form]


def may_serve(x: Tensor, features: int) -> bool:
    """Whether a product or lookup of ``x`` (``features`` values per token; 1 for an index) may come from cached
    forms: eager, no grad, a plain tensor, at most ``MERGED_MAX_TOKENS`` tokens. Cheap (a decode step asks it for
    every matrix), and the token count is read last: under a compiler it would be a size guard."""
    return (
        USE_MERGED_FORMS
        and not torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and type(x) is torch.Tensor
        and x.numel() <= MERGED_MAX_TOKENS * features
    )


def storage_key(params: Sequence[Tensor]) -> tuple:
    """Where each core and gate lives, how it is laid out and its version counter: a tensor swapped in
    (``p.data = ...``, ``load_state_dict`` of another size, a shrink, ``.to()``) or an in-place write that autograd
    tracks changes it; a fused optimizer kernel or a write through ``p.data`` does not (``cores_unchanged``)."""
    return tuple((p.data_ptr(), p.shape, p.dtype, p.device, p._version) for p in params)


def as_words(p: Tensor) -> Tensor:
    """``p`` seen as 64-bit integers when its bytes allow (a view: it follows every write to ``p``), else ``p``
    detached. Comparing words is exact bit for bit and reads half as many elements as float32 values."""
    p = p.detach()
    if p.is_contiguous() and p.numel() and (p.numel() * p.element_size()) % 8 == 0:
        return p.view(-1).view(torch.int64)
    return p


def cores_unchanged(cached: Cached, key: tuple) -> bool:
    """Whether the cores and gates are the tensors the forms were made from and hold the same bits.

    Why content and not ``_version``: fused optimizer kernels and ``param.data`` writes change values without
    bumping the version counter, so no cheaper key sees every in-place update. The cores are small (the point of
    TT), so reading them costs a fraction of the merge it saves: on 1 CPU thread of a loaded machine, a 768 × 3072
    layer took ~20 µs against a ~180 µs merge at max rank 16, ~60 µs against ~580 µs at max rank 64. It is still
    more than a cached one-token product's GEMMs (~30-45 µs there). On a GPU ``torch.equal`` waits for the device
    once per tensor. Bitwise: a NaN equals itself, -0.0 differs from 0.0 (a rebuild, never a stale form)."""
    if cached.key != key:
        return False
    return all(torch.equal(now, then) for now, then in zip(cached.words, cached.snapshot))


def cached_form(matrix, kind: str) -> tuple[TTLayout, Form] | None:
    """The layout and the form of ``kind`` ("matmul", "matmul_t" or "rows") for the matrix's current cores and
    gates, made if needed; None when the matrix cannot use merged forms."""
    # The parameter dicts are read directly: iterating a ParameterList costs ~4 µs per tensor, which a decode step
    # pays for every matrix.
    modules = matrix._modules
    params = (*modules["cores"]._parameters.values(), *modules["gates"]._parameters.values())
    key = storage_key(params)
    cached = matrix.__dict__.get("_merged")
    if matrix.__dict__.get(FROZEN):  # serving.frozen: the weights do not change inside the block
        fresh = cached is not None and cached.key == key
    else:
        fresh = cached is not None and cores_unchanged(cached, key)
    if not fresh:
        layout = matrix.layout
        usable = not matrix.stored_empty and (layout.format is TTFormat.TT or layout.n_cores >= 2)
        with torch.no_grad():
            words = tuple(as_words(p) for p in params)
            snapshot = tuple(w.clone() for w in words)
        cached = matrix.__dict__["_merged"] = Cached(key, words, snapshot, layout if usable else None, {})
    if cached.layout is None:
        return None
    form = cached.forms.get(kind)
    if form is None:
        with torch.no_grad():
            if cached.layout.format is TTFormat.TT:  # one (L, R) pair; each kind holds views of it
                factors = cached.forms.get("factors") or build_form(matrix.gated_cores(), cached.layout, "factors")
                cached.forms["factors"] = factors
                form = _tt_form(factors, kind)
            else:
                form = build_form(matrix.gated_cores(), cached.layout, kind)
        cached.forms[kind] = form
    return cached.layout, form


def cached_bytes(matrix) -> int:
    """Bytes the matrix holds in cached forms now, with the copy of the cores they are checked against (0 when
    nothing is cached)."""
    cached = matrix.__dict__.get("_merged")
    if cached is None or cached.layout is None:
        return 0
    tensors = [t for form in cached.forms.values() for t in (form.first, form.second)] + list(cached.snapshot)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _halves_roles(layout: TTLayout, kind: str) -> tuple[int, int, int, int, int]:
    """(I_L, O_L, r, I_R, O_R): each half's input and output mode products for a TTM product of ``kind``."""
    a_left, b_left, r, a_right, b_right = ops.ttm_half_sizes(layout)
    if kind == "matmul":  # x runs over the row modes
        return a_left, b_left, r, a_right, b_right
    return b_left, a_left, r, b_right, a_right


def _left_half_first(layout: TTLayout, kind: str) -> bool:
    """Which half a token meets first: the order with fewer FLOPs per token (both are linear in the tokens)."""
    in_left, out_left, r, in_right, out_right = _halves_roles(layout, kind)
    left_first = in_right * in_left * out_left * r + out_left * in_right * r * out_right
    right_first = in_left * in_right * r * out_right + out_left * in_left * r * out_right
    return left_first <= right_first


def _tt_form(factors: Form, kind: str) -> Form:
    """Views of a TT matrix's (L, R) laid out as ``product`` / ``rows`` read them: F.linear's weights for the
    products (made once: even ``.T`` costs microseconds per call), the pair itself for lookups."""
    left, right = factors.first, factors.second
    if kind == "matmul":  # x·L·R = linear(linear(x, Lᵀ), Rᵀ)
        return Form(left.T, right.T)
    if kind == "matmul_t":  # x·Rᵀ·Lᵀ = linear(linear(x, R), L)
        return Form(right, left)
    return factors


def build_form(cores: Sequence[Tensor], layout: TTLayout, kind: str) -> Form:
    """Contract the (gated) cores into the two operands ``product`` / ``rows`` read for ``kind`` (TT: the pair
    (L, R) for every kind, see ``_tt_form``)."""
    if layout.format is TTFormat.TT:
        left, right = ops.tt_factors(cores, layout)
        return Form(left.contiguous(), right.contiguous())
    left, right = ops.ttm_halves(cores, layout)
    if kind == "rows":
        left, right = ops.ttm_row_tables(left, right, layout)
        return Form(left.contiguous(), right.contiguous())
    if kind == "matmul_t":  # x runs over the column modes: swap the row and column axes of both halves
        left, right = left.permute(1, 0, 2), right.permute(0, 2, 1)
    # left (I_L, O_L, r), right (r, I_R, O_R). The first operand multiplies the tokens from the left (W @ xᵀ): a
    # skinny GEMM with a long output runs ~1.7× faster that way on CPU, and for one token no operand is copied.
    sizes = in_left, out_left, r, in_right, out_right = _halves_roles(layout, kind)
    left_first = _left_half_first(layout, kind)
    if left_first:
        first = left.permute(1, 2, 0).reshape(out_left * r, in_left)
        second = right.reshape(r * in_right, out_right)
    else:
        first = right.permute(2, 0, 1).reshape(out_right * r, in_right)
        second = left.permute(2, 0, 1).reshape(r * in_left, out_left)
    return Form(first.contiguous(), second.contiguous(), sizes, left_first)


def product(x: Tensor, layout: TTLayout, form: Form, kind: str, bias: Tensor | None = None) -> Tensor:
    """``x @ M`` (kind "matmul", x over the rows) or ``x @ Mᵀ`` ("matmul_t"), plus ``bias``, from a cached form."""
    # Runs once per matrix per generated token: kept to a few tensor calls (each Python step costs ~1 µs against
    # ~25 µs of GEMMs for a 768 × 3072 layer).
    first, second = form.first, form.second
    if first.dtype != x.dtype:
        first, second = first.to(x.dtype), second.to(x.dtype)
    if not form.sizes:  # TT: two F.linear calls (``_tt_form``), which fold the batch axes in C++
        return F.linear(F.linear(x, first), second, bias)
    n_in, n_out = (layout.rows, layout.cols) if kind == "matmul" else (layout.cols, layout.rows)
    x2 = x.reshape(-1, n_in)
    in_left, out_left, r, in_right, out_right = form.sizes
    if in_left * in_right != n_in:
        x2 = F.pad(x2, (0, in_left * in_right - n_in))
    tokens = x2.shape[0]
    x3 = x2.reshape(tokens, in_left, in_right)
    if form.left_first:
        mid = first @ x3.permute(1, 0, 2).reshape(in_left, tokens * in_right)  # (O_L·r, N·I_R)
        mid = mid.reshape(out_left, r, tokens, in_right).permute(2, 0, 1, 3).reshape(tokens * out_left, r * in_right)
        out = mid @ second  # (N·O_L, O_R)
    else:
        mid = first @ x3.permute(2, 0, 1).reshape(in_right, tokens * in_left)  # (O_R·r, N·I_L)
        mid = mid.reshape(out_right, r, tokens, in_left).permute(2, 0, 1, 3).reshape(tokens * out_right, r * in_left)
        out = (mid @ second).reshape(tokens, out_right, out_left).transpose(1, 2)  # (N, O_L, O_R)
    out = out.reshape(tokens, out_left * out_right)
    if out.shape[1] != n_out:
        out = out[:, :n_out]
    if bias is not None:  # as F.linear: under autocast the bias takes the product's dtype
        out = out + (bias.to(out.dtype) if torch.is_autocast_enabled(out.device.type) else bias)
    return out.reshape(x.shape[:-1] + (n_out,))


def rows(index: Tensor, layout: TTLayout, form: Form) -> Tensor:
    """``M[index]`` from a cached form (TT: a row of L times R; TTM: one row of each half's table)."""
    if layout.format is TTFormat.TT:
        return F.embedding(index, form.first) @ form.second
    return ops.ttm_gather_rows(index, form.first, form.second, layout)


__all__ = [
    "MERGED_MAX_TOKENS",
    "USE_MERGED_FORMS",
    "Cached",
    "Form",
    "as_words",
    "cached_bytes",
    "cached_form",
    "cores_unchanged",
    "may_serve",
    "product",
    "rows",
    "storage_key",
]
