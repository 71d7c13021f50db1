"""Hypothesis strategies for TT layouts, TT matrices, awkward input tensors, batch sizes and small random models.

Needs Hypothesis (``pip install comera_fx[test]``). Everything drawn here shrinks towards the simplest case
(small sizes, one mode, rank 1, gates at 1, contiguous inputs, few blocks), so a failing property reports a
minimal example. Tensor values come from a seeded ``torch.Generator`` (a drawn seed), never from Hypothesis
floats: examples stay fast and exactly replayable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

from ..tt.decompose import random_tt_cores
from ..tt.layers import TTMatrix
from ..tt.layout import TTFormat, TTLayout, chain_dims
from ..tt.shapes import feasible_ranks
from .models import (
    BLOCK_KINDS,
    MEMORY_LAYOUTS,
    BlockSpec,
    ModelSpec,
    build_model,
    lay_out,
    linear_shapes,
    make_example_input,
)

__all__ = [
    "BLOCK_KINDS",
    "MEMORY_LAYOUTS",
    "ModelCase",
    "TTSpec",
    "batch_shapes",
    "batch_size_values",
    "batch_sizes",
    "feature_sizes",
    "float_tensors",
    "index_tensors",
    "mode_factorizations",
    "models",
    "tt_inputs",
    "tt_layouts",
    "tt_matrices",
    "tt_specs",
]

# Sizes that factor badly or not at all: TT layers must pad them, and off-by-one padding bugs live here.
AWKWARD_FEATURE_SIZES = (1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)

_SEEDS = st.integers(0, 2**31 - 1)


def _as_strategy(value, default: st.SearchStrategy) -> st.SearchStrategy:
    """Accept a strategy, a fixed value or None (the default strategy)."""
    if value is None:
        return default
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(value)


# ------------------------------------------------------------------------------------------------ sizes, modes


def feature_sizes(min_value: int = 1, max_value: int = 48) -> st.SearchStrategy[int]:
    """Feature sizes in [min_value, max_value], with primes and 1 drawn often (they force padding)."""
    awkward = [n for n in AWKWARD_FEATURE_SIZES if min_value <= n <= max_value]
    sizes = st.integers(min_value, max_value)
    return st.one_of(sizes, st.sampled_from(awkward)) if awkward else sizes


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


@st.composite
def mode_factorizations(
    draw, n: int, num_modes: int | None = None, *, max_modes: int = 3, max_pad_fraction: float = 0.25
) -> tuple[int, ...]:
    """Modes (tuple of ints >= 1) whose product is ``n`` or a padded size up to ``n * (1 + max_pad_fraction)``.

    Any split of the prime factors into ``num_modes`` slots may come out, including 1s and lopsided modes that
    ``choose_modes`` would never pick: layers must work for explicit user modes too.
    """
    d = num_modes if num_modes is not None else draw(st.integers(1, max_modes))
    padded = draw(st.integers(n, max(n, math.floor(n * (1 + max_pad_fraction)))))
    modes = [1] * d
    for p in _prime_factors(padded):
        modes[draw(st.integers(0, d - 1))] *= p
    return tuple(modes)


@st.composite
def tt_layouts(
    draw,
    *,
    formats: Sequence[TTFormat | str] = (TTFormat.TT, TTFormat.TTM),
    rows=None,
    cols=None,
    max_modes: int = 3,
    max_rank: int | None = None,
) -> TTLayout:
    """A valid ``TTLayout``: format, sizes (ints or strategies), modes (maybe padded), ranks within feasible ranks.

    Each internal rank is drawn in [1, min(feasible rank, max_rank)] — the shapes a pruned or truncated TT has.
    """
    fmt = TTFormat(draw(st.sampled_from([TTFormat(f) for f in formats])))
    n_rows = draw(_as_strategy(rows, feature_sizes()))
    n_cols = draw(_as_strategy(cols, feature_sizes()))
    if fmt is TTFormat.TT:
        row_modes = draw(mode_factorizations(n_rows, max_modes=max_modes))
        col_modes = draw(mode_factorizations(n_cols, max_modes=max_modes))
    else:
        d = draw(st.integers(1, max_modes))
        row_modes = draw(mode_factorizations(n_rows, d))
        col_modes = draw(mode_factorizations(n_cols, d))
    full = feasible_ranks(chain_dims(fmt, row_modes, col_modes))
    internal = [draw(st.integers(1, min(r, max_rank) if max_rank else r)) for r in full[1:-1]]
    return TTLayout(fmt, n_rows, n_cols, row_modes, col_modes, (1, *internal, 1))


class TTSpec(NamedTuple):
    """A layout with the tensors a ``TTMatrix`` holds: cores (shapes ``layout.core_shapes``) and gates."""

    layout: TTLayout
    cores: list[Tensor]
    gates: list[Tensor]

    def matrix(self) -> TTMatrix:
        return TTMatrix(self.layout, self.cores, self.gates)

    def __repr__(self) -> str:
        gates = [[round(v, 3) for v in g.tolist()] for g in self.gates]
        return (
            f"TTSpec({self.layout.format.value}, {self.layout.describe_modes()}, ranks={self.layout.ranks}, "
            f"gates={gates}, dtype={self.cores[0].dtype})"
        )

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints falsifying examples with this
        printer.text(repr(self))


def _gate_values(dead_gates: bool) -> st.SearchStrategy[float]:
    live = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)
    options = [st.just(1.0)] + ([st.just(0.0)] if dead_gates else []) + [live]
    return st.one_of(*options)


@st.composite
def tt_specs(
    draw,
    *,
    dtype: torch.dtype = torch.float64,
    formats=(TTFormat.TT, TTFormat.TTM),
    rows=None,
    cols=None,
    max_modes: int = 3,
    max_rank: int | None = None,
    dead_gates: bool = True,
) -> TTSpec:
    """A layout from ``tt_layouts`` plus random cores (entries of M about N(0, 1) with gates at 1) and gates.

    Gate entries are 1, 0 (a dead rank, as after pruning) or any float in [-2, 2].
    """
    layout = draw(tt_layouts(formats=formats, rows=rows, cols=cols, max_modes=max_modes, max_rank=max_rank))
    generator = torch.Generator().manual_seed(draw(_SEEDS))
    cores = random_tt_cores(layout.core_shapes, 1.0, dtype=dtype, generator=generator)
    values = _gate_values(dead_gates)
    gates = [torch.tensor(draw(st.lists(values, min_size=r, max_size=r)), dtype=dtype) for r in layout.internal_ranks]
    return TTSpec(layout, cores, gates)


def tt_matrices(
    *, dtype: torch.dtype = torch.float64, formats=(TTFormat.TT, TTFormat.TTM), **spec_options
) -> st.SearchStrategy[TTMatrix]:
    """``TTMatrix`` modules built from ``tt_specs`` (same options)."""
    return tt_specs(dtype=dtype, formats=formats, **spec_options).map(TTSpec.matrix)


# ------------------------------------------------------------------------------------------------------ tensors


def batch_shapes(*, max_dims: int = 2, max_side: int = 4, allow_empty: bool = True) -> st.SearchStrategy[tuple]:
    """Leading (batch) shapes: () up to ``max_dims`` axes of size up to ``max_side``, 0-sized axes included."""
    return st.lists(st.integers(0 if allow_empty else 1, max_side), max_size=max_dims).map(tuple)


def _any_batch_shape() -> st.SearchStrategy[tuple]:
    return batch_shapes()


@st.composite
def float_tensors(
    draw,
    last_dim: int,
    *,
    dtype: torch.dtype = torch.float64,
    batch_shapes=None,
    memory_layouts: Sequence[str] = MEMORY_LAYOUTS,
) -> Tensor:
    """Float tensors of shape (*batch, last_dim) in any memory layout: contiguous, transposed, strided views or
    expanded (stride-0) batches — the inputs a kernel that assumes contiguity gets wrong."""
    shape = draw(_as_strategy(batch_shapes, _any_batch_shape())) + (last_dim,)
    layout = draw(st.sampled_from(list(memory_layouts)))
    generator = torch.Generator().manual_seed(draw(_SEEDS))
    return lay_out(lambda s: torch.randn(s, generator=generator, dtype=dtype), shape, layout)


@st.composite
def index_tensors(draw, num_rows: int, *, batch_shapes=None, memory_layouts: Sequence[str] = MEMORY_LAYOUTS) -> Tensor:
    """int64 indices in [0, num_rows) of a drawn batch shape (0-sized included), in any memory layout.

    With a 1-D or empty batch shape "strided" and "expanded" still apply; "transposed" needs 2 axes.
    """
    shape = draw(_as_strategy(batch_shapes, _any_batch_shape()))
    layout = draw(st.sampled_from(list(memory_layouts)))
    generator = torch.Generator().manual_seed(draw(_SEEDS))
    if not shape:
        return torch.randint(0, num_rows, (), generator=generator)
    return lay_out(lambda s: torch.randint(0, num_rows, s, generator=generator), shape, layout)


def tt_inputs(
    layout: TTLayout,
    *,
    side: str = "rows",
    dtype: torch.dtype = torch.float64,
    batch_shapes=None,
    memory_layouts: Sequence[str] = MEMORY_LAYOUTS,
) -> st.SearchStrategy[Tensor]:
    """Activations for a TT matrix: (*batch, rows) for ``matmul`` (side="rows") or (*batch, cols) for
    ``matmul_t`` (side="cols")."""
    if side not in ("rows", "cols"):
        raise ValueError(f"side must be 'rows' or 'cols', got {side!r}")
    n = layout.rows if side == "rows" else layout.cols
    return float_tensors(n, dtype=dtype, batch_shapes=batch_shapes, memory_layouts=memory_layouts)


def batch_size_values(breakpoints: Sequence[int] = (), *, include_zero: bool = False) -> tuple[int, ...]:
    """The sizes ``batch_sizes`` draws from, sorted: 1, each breakpoint and its two neighbours (0 on request)."""
    values = {1} | ({0} if include_zero else set())
    for b in breakpoints:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"breakpoints must be ints >= 0, got {b!r}")
        values |= {v for v in (b - 1, b, b + 1) if v >= 1 or (v == 0 and include_zero)}
    return tuple(sorted(values))


def batch_sizes(breakpoints: Sequence[int] = (), *, include_zero: bool = False) -> st.SearchStrategy[int]:
    """Batch sizes just below, at and just above each breakpoint, plus 1 (and 0 if ``include_zero``).

    Breakpoints are where code changes path (a kernel's tile size, a ``shape[0] == 1`` special case, a
    ``bmm``/``mm`` switch); testing only a typical batch misses them. Shrinks towards the smallest size.
    """
    return st.sampled_from(batch_size_values(breakpoints, include_zero=include_zero))


def _default_batch_sizes() -> st.SearchStrategy[int]:
    return batch_sizes((2,), include_zero=True)


# ------------------------------------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True, repr=False)
class ModelCase:
    """What ``models()`` draws: unpack as ``model, example_inputs = case``; prints as the model's grammar.

    ``more_inputs``: further example inputs for the same model (``models(num_inputs=...)``), each a 1-tuple like
    ``example_inputs``; ``check_pass`` checks the rewrite on all of them.
    """

    model: nn.Module
    example_inputs: tuple
    more_inputs: tuple = ()

    def __iter__(self):  # unpacks as (model, example_inputs), whatever more_inputs holds
        return iter((self.model, self.example_inputs))

    def __repr__(self) -> str:
        spec = getattr(self.model, "spec", None)
        what = spec.describe() if spec is not None else type(self.model).__name__
        shapes = "; ".join(
            ", ".join(_describe_tensor(x) for x in inputs) for inputs in (self.example_inputs, *self.more_inputs)
        )
        return f"ModelCase({what}; inputs: {shapes})"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints falsifying examples with this
        printer.text(repr(self))


def _describe_tensor(x) -> str:
    if not isinstance(x, Tensor):
        return repr(x)
    layout = "contiguous" if x.is_contiguous() else f"strides {tuple(x.stride())}"
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)} {layout}"


_WIDTH_KEEPING_INNER = ("linear", "mlp", "attention")


@st.composite
def _block(
    draw, kind: str, width: int, sizes, *, has_seq: bool, blocks: list[BlockSpec], linears: list[tuple[int, int]]
) -> BlockSpec:
    bias = draw(st.booleans())
    # Keeping the width is drawn often: it is what makes later blocks shareable and weights tieable.
    out_sizes = st.one_of(st.just(width), sizes)
    if kind in ("linear", "functional_linear"):
        return BlockSpec(kind, width, draw(out_sizes), bias=bias)
    if kind == "mlp":
        hidden, d_out = draw(sizes), draw(out_sizes)
        return BlockSpec(
            kind, width, d_out, hidden=hidden, bias=bias, activation=draw(st.sampled_from(["relu", "gelu", "tanh"]))
        )
    if kind == "attention":
        return BlockSpec(kind, width, width, bias=bias)
    if kind == "layernorm":
        return BlockSpec(kind, width, width)
    if kind == "residual":
        inner_kinds = [k for k in _WIDTH_KEEPING_INNER if k != "attention" or has_seq]
        inner_kind = draw(st.sampled_from(inner_kinds))
        if inner_kind == "linear":
            inner = BlockSpec("linear", width, width, bias=bias)
        elif inner_kind == "mlp":
            inner = BlockSpec(
                "mlp",
                width,
                width,
                hidden=draw(sizes),
                bias=bias,
                activation=draw(st.sampled_from(["relu", "gelu", "tanh"])),
            )
        else:
            inner = BlockSpec("attention", width, width, bias=bias)
        return BlockSpec(kind, width, width, inner=inner)
    if kind == "shared":
        source = draw(st.sampled_from(_reusable_blocks(blocks, width)))
        return BlockSpec(kind, width, width, source=source)
    if kind == "tied_linear":
        source = draw(st.sampled_from(_tie_sources(linears, width)))
        return BlockSpec(kind, width, linears[source][1], bias=bias, source=source)
    raise ValueError(f"unknown block kind {kind!r}")


def _reusable_blocks(blocks: list[BlockSpec], width: int) -> list[int]:
    """Blocks that may be called again here: width-keeping, of this width, with parameters, not themselves reuses."""
    return [i for i, b in enumerate(blocks) if b.d_in == b.d_out == width and b.kind not in ("shared", "layernorm")]


def _tie_sources(linears: list[tuple[int, int]], width: int) -> list[int]:
    return [i for i, (d_in, _) in enumerate(linears) if d_in == width]


def models(
    *,
    dtype: torch.dtype = torch.float64,
    batch_sizes=None,
    block_kinds: Sequence[str] = BLOCK_KINDS,
    min_blocks: int = 1,
    max_blocks: int = 4,
    min_features: int = 4,
    max_features: int = 48,
    ties: bool | None = None,
    seq_lens: Sequence[int | None] = (None, 1, 2, 3, 4),
    memory_layouts: Sequence[str] = MEMORY_LAYOUTS,
    num_inputs: int = 1,
) -> st.SearchStrategy[ModelCase]:
    """Small random models and an example input: ``model, example_inputs = draw(models())``.

    The model is a ``RandomModel``: an optional embedding stem, ``min_blocks`` to ``max_blocks`` blocks of
    ``block_kinds`` (linear, mlp, residual, layernorm, single-head attention, F.linear on raw parameters, a block
    called again = shared parameters, a linear tied to an earlier one's weight) and an optional head (linear, or
    tied to the embedding). Inputs are (batch, features) or (batch, seq, features) as ``seq_lens`` draws (None:
    no sequence axis; attention needs one). ``ties``: None draws tied weights sometimes, True always includes
    one, False never. ``batch_sizes`` is a strategy or an int (default: ``batch_sizes((2,), include_zero=True)``,
    i.e. 0..3). Weights and inputs come from a drawn seed; ``example_inputs`` is a 1-tuple (token ids or features).
    ``num_inputs`` > 1 adds ``num_inputs - 1`` further inputs in ``case.more_inputs``: same features, each with
    its own batch size, sequence length (when there is a sequence axis), memory layout and values.
    """
    if not isinstance(num_inputs, int) or num_inputs < 1:
        raise ValueError(f"num_inputs must be an int >= 1, got {num_inputs!r}")
    unknown = set(block_kinds) - set(BLOCK_KINDS)
    if unknown:
        raise ValueError(f"unknown block kinds {sorted(unknown)}; known: {BLOCK_KINDS}")
    return _models(
        dtype=dtype,
        batch_sizes=batch_sizes,
        block_kinds=tuple(block_kinds),
        min_blocks=min_blocks,
        max_blocks=max_blocks,
        min_features=min_features,
        max_features=max_features,
        ties=ties,
        seq_lens=tuple(seq_lens),
        memory_layouts=tuple(memory_layouts),
        num_inputs=num_inputs,
    )


@st.composite
def _models(
    draw,
    *,
    dtype,
    batch_sizes,
    block_kinds,
    min_blocks,
    max_blocks,
    min_features,
    max_features,
    ties,
    seq_lens,
    memory_layouts,
    num_inputs,
) -> ModelCase:
    sizes = feature_sizes(min_features, max_features)
    seed = draw(_SEEDS)
    stem = "tokens" if ties else draw(st.sampled_from(["features", "tokens"]))
    d_model = draw(sizes)
    vocab = draw(sizes) if stem == "tokens" else 0
    seq_len = draw(st.sampled_from(list(seq_lens)))
    batch = draw(_as_strategy(batch_sizes, _default_batch_sizes()))

    blocks: list[BlockSpec] = []
    linears: list[tuple[int, int]] = []
    width = d_model
    for _ in range(draw(st.integers(min_blocks, max_blocks))):
        allowed = [
            k
            for k in block_kinds
            if (k != "attention" or seq_len is not None)
            and (k != "shared" or _reusable_blocks(blocks, width))
            and (k != "tied_linear" or (ties is not False and _tie_sources(linears, width)))
        ]
        if not allowed:
            break
        kind = draw(st.sampled_from(allowed))
        block = draw(_block(kind, width, sizes, has_seq=seq_len is not None, blocks=blocks, linears=linears))
        blocks.append(block)
        if kind != "shared":
            linears.extend(linear_shapes(block))
        width = block.d_out

    if ties:
        if width != d_model:  # a tied head reads the embedding's (vocab × d_model) table
            blocks.append(BlockSpec("linear", width, d_model, bias=draw(st.booleans())))
            width = d_model
        head = "tied"
    else:
        heads = ["none", "linear"] + (["tied"] if stem == "tokens" and width == d_model and ties is None else [])
        head = draw(st.sampled_from(heads))
    d_head = draw(sizes) if head == "linear" else 0
    input_layout = draw(st.sampled_from(list(memory_layouts)))
    spec = ModelSpec(stem, d_model, vocab, tuple(blocks), head, d_head, batch, seq_len, input_layout, seed)
    more = []
    for _ in range(num_inputs - 1):
        other_seq = seq_len if seq_len is None else draw(st.sampled_from([s for s in seq_lens if s is not None]))
        other = dataclasses.replace(
            spec,
            batch=draw(_as_strategy(batch_sizes, _default_batch_sizes())),
            seq_len=other_seq,
            input_layout=draw(st.sampled_from(list(memory_layouts))),
            seed=draw(_SEEDS),
        )
        more.append((make_example_input(other, dtype),))
    return ModelCase(build_model(spec, dtype), (make_example_input(spec, dtype),), tuple(more))
