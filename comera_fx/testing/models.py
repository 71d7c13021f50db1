"""Small models assembled from a grammar of common blocks; the plain-torch half of ``strategies.models()``.

A model is described by a ``ModelSpec`` (plain data: stem, blocks, head) and built deterministically from it and a
seed, so Hypothesis can replay and shrink it. Every block is something real models do and rewrites get wrong:
linear layers with and without bias, MLPs, single-head attention, residual adds, LayerNorm, ``F.linear`` on raw
parameters, one module called twice (shared parameters) and one weight held by two modules (tied parameters).
No Hypothesis here: the module can be used (and debugged) without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


# ------------------------------------------------------------------------------------------------------- blocks


class MLP(nn.Module):
    """fc_in -> activation -> fc_out (a transformer's feed-forward block)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        self.fc_in = nn.Linear(d_in, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, d_out, bias=bias)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(ACTIVATIONS[self.activation](self.fc_in(x)))


class SelfAttention(nn.Module):
    """Single-head scaled dot-product self-attention over dim -2, with nn.Linear q, k, v and output projections."""

    def __init__(self, d: int, bias: bool = True):
        super().__init__()
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, d, bias=bias)
        self.v = nn.Linear(d, d, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, x: Tensor) -> Tensor:
        scores = (self.q(x) @ self.k(x).transpose(-2, -1)) * self.scale
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


class Residual(nn.Module):
    """x + inner(x); ``inner`` must keep the feature width."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return x + self.inner(x)


class FunctionalLinear(nn.Module):
    """``F.linear`` on raw ``nn.Parameter``s — the form a module-type scan misses and a graph pass must find."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1.0 / math.sqrt(d_in), 1.0 / math.sqrt(d_in))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


# --------------------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class BlockSpec:
    """One block of the body. ``kind`` is one of BLOCK_KINDS; the other fields are used as the kind needs."""

    kind: str
    d_in: int
    d_out: int
    hidden: int = 0
    bias: bool = True
    activation: str = "gelu"
    inner: "BlockSpec | None" = None  # residual
    source: int = -1  # shared: index of the block called again; tied_linear: index into the model's Linear list

    def describe(self) -> str:
        b = "" if self.bias else ", no bias"
        if self.kind == "linear":
            return f"linear({self.d_in}->{self.d_out}{b})"
        if self.kind == "functional_linear":
            return f"F.linear({self.d_in}->{self.d_out}{b})"
        if self.kind == "mlp":
            return f"mlp({self.d_in}->{self.hidden}->{self.d_out}, {self.activation}{b})"
        if self.kind == "attention":
            return f"attention({self.d_in}{b})"
        if self.kind == "layernorm":
            return f"layernorm({self.d_in})"
        if self.kind == "residual":
            return f"residual({self.inner.describe()})"
        if self.kind == "shared":
            return f"shared(block {self.source})"
        if self.kind == "tied_linear":
            return f"tied_linear({self.d_in}->{self.d_out}, weight of linear #{self.source}{b})"
        raise ValueError(f"unknown block kind {self.kind!r}")


def linear_shapes(block: BlockSpec) -> list[tuple[int, int]]:
    """(in, out) of each new ``nn.Linear`` a block creates, in ``module.modules()`` order (tied_linear sources)."""
    if block.kind in ("linear", "tied_linear"):
        return [(block.d_in, block.d_out)]
    if block.kind == "mlp":
        return [(block.d_in, block.hidden), (block.hidden, block.d_out)]
    if block.kind == "attention":
        return [(block.d_in, block.d_in)] * 4
    if block.kind == "residual":
        return linear_shapes(block.inner)
    return []


BLOCK_KINDS = ("linear", "mlp", "residual", "layernorm", "attention", "functional_linear", "shared", "tied_linear")


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: stem, body and head, plus the example input's shape.

    stem: "features" (float input of width ``d_model``) or "tokens" (an ``nn.Embedding(vocab, d_model)``).
    head: "none", "linear" (to ``d_head``) or "tied" (``nn.Linear`` sharing the embedding's weight: needs the body
    to end at width ``d_model``). ``seq_len`` None means 2-D inputs (batch, features); attention needs a sequence.
    """

    stem: str
    d_model: int
    vocab: int
    blocks: tuple[BlockSpec, ...]
    head: str
    d_head: int
    batch: int
    seq_len: int | None
    input_layout: str = "contiguous"
    seed: int = 0

    def describe(self) -> str:
        stem = f"tokens(vocab={self.vocab}, d={self.d_model})" if self.stem == "tokens" else f"features({self.d_model})"
        parts = [stem] + [f"#{i} {b.describe()}" for i, b in enumerate(self.blocks)]
        if self.head == "linear":
            parts.append(f"head linear(->{self.d_head})")
        elif self.head == "tied":
            parts.append("head tied to the embedding")
        shape = (self.batch,) if self.seq_len is None else (self.batch, self.seq_len)
        return f"{' | '.join(parts)}; input batch shape {shape}, {self.input_layout}, seed {self.seed}"


# ---------------------------------------------------------------------------------------------------- the model


class RandomModel(nn.Module):
    """stem -> blocks -> head, built from a ``ModelSpec`` (see ``build_model``). ``spec`` says what it is."""

    def __init__(self, spec: ModelSpec, embedding: nn.Module | None, blocks: list[nn.Module], head: nn.Module | None):
        super().__init__()
        self.spec = spec
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def extra_repr(self) -> str:
        return self.spec.describe()


def _randomize_affine(module: nn.Module, generator: torch.Generator) -> None:
    """LayerNorm starts at weight 1 / bias 0, which hides rewrites that drop or swap them: make them random."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm) and sub.elementwise_affine:
                sub.weight.copy_(1.0 + 0.5 * torch.randn(sub.weight.shape, generator=generator))
                if sub.bias is not None:
                    sub.bias.copy_(0.5 * torch.randn(sub.bias.shape, generator=generator))


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float64) -> RandomModel:
    """The model a spec describes, with weights drawn from ``spec.seed`` only (same spec, same model)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        embedding = nn.Embedding(spec.vocab, spec.d_model) if spec.stem == "tokens" else None
        blocks: list[nn.Module] = []
        linears: list[nn.Linear] = []  # every nn.Linear so far, for tied_linear

        def make(b: BlockSpec) -> nn.Module:
            if b.kind == "linear":
                module = nn.Linear(b.d_in, b.d_out, bias=b.bias)
            elif b.kind == "functional_linear":
                module = FunctionalLinear(b.d_in, b.d_out, bias=b.bias)
            elif b.kind == "mlp":
                module = MLP(b.d_in, b.hidden, b.d_out, b.activation, bias=b.bias)
            elif b.kind == "attention":
                module = SelfAttention(b.d_in, bias=b.bias)
            elif b.kind == "layernorm":
                module = nn.LayerNorm(b.d_in)
            elif b.kind == "residual":
                return Residual(make(b.inner))  # the inner block registered its own linears
            elif b.kind == "shared":
                return blocks[b.source]
            elif b.kind == "tied_linear":
                module = nn.Linear(b.d_in, b.d_out, bias=b.bias)
                module.weight = linears[b.source].weight
            else:
                raise ValueError(f"unknown block kind {b.kind!r}")
            linears.extend(m for m in module.modules() if isinstance(m, nn.Linear))
            return module

        for block_spec in spec.blocks:
            blocks.append(make(block_spec))
        head = None
        if spec.head == "linear":
            head = nn.Linear(spec.blocks[-1].d_out if spec.blocks else spec.d_model, spec.d_head)
        elif spec.head == "tied":
            head = nn.Linear(spec.d_model, spec.vocab)
            head.weight = embedding.weight
        model = RandomModel(spec, embedding, blocks, head)
        _randomize_affine(model, torch.Generator().manual_seed(spec.seed + 1))
    return model.to(dtype)


def make_example_input(spec: ModelSpec, dtype: torch.dtype = torch.float64) -> Tensor:
    """The input a spec describes: token ids or features, laid out in memory as ``spec.input_layout`` says.

    Layouts: "contiguous"; "transposed" (a permuted view: the feature or sequence axis is not innermost);
    "strided" (every other element of a wider tensor); "expanded" (one batch row broadcast, stride 0).
    """
    generator = torch.Generator().manual_seed(spec.seed + 2)
    batch_shape = (spec.batch,) if spec.seq_len is None else (spec.batch, spec.seq_len)
    if spec.stem == "tokens":
        shape = batch_shape
        make = lambda s: torch.randint(0, spec.vocab, s, generator=generator)  # noqa: E731
    else:
        shape = batch_shape + (spec.d_model,)
        make = lambda s: torch.randn(s, generator=generator, dtype=dtype)  # noqa: E731
    return lay_out(make, shape, spec.input_layout)


def lay_out(make, shape: tuple[int, ...], layout: str) -> Tensor:
    """A tensor of ``shape`` from ``make(shape)`` with the requested memory layout (same values semantics)."""
    if layout == "contiguous" or len(shape) < 2 and layout == "transposed":
        return make(shape)
    if layout == "transposed":
        return make(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "strided":
        return make(shape[:-1] + (2 * shape[-1],))[..., ::2]
    if layout == "expanded":
        return make((1,) + shape[1:]).expand(shape)
    raise ValueError(f"unknown memory layout {layout!r}")


MEMORY_LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
