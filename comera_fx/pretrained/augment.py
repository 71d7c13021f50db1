"""Token-level augmentation of distillation batches, so that a student matches its teacher off the user's text.

A student distilled on one source of text learns that source: on all-MiniLM-L6-v2 at 8x fewer bytes, 600 s of
distillation on stdlib docstrings reached 0.918 cosine to the teacher on held-out stdlib text but 0.826 on other
packages' docstrings (benchmarks/RESULTS.md, issue 29). The teacher is a function of any token sequence, not only of
the user's sentences, so each augmented batch is new text the teacher labels for free: random spans, tokens
dropped, chunks shuffled, two sentences spliced together. ``augmented(batches, ...)`` wraps any source of
``{"input_ids", "attention_mask"}`` batches (right-padded, as Hugging Face tokenizers give them) and returns a
callable that ``distill_`` / ``match_teacher`` accept as ``batches``; ``DistillConfig(augment=Augmentation())``
edits its training batches only. Measured there: on a better start (0.915 before training) 600 s with edits ended
level with 600 s without (0.922 against 0.923 on other-source text), with a better worst sentence and retrieval on
held-out text; so it is not on by default.

The first and last real token of each row (``[CLS]`` and ``[SEP]`` for BERT) stay in place; the edits apply to the
tokens between them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .batches import BatchStream


@dataclass(frozen=True)
class Augmentation:
    """How often each edit applies to a row (independently), and how strong it is.

    ``batch_fraction``: the share of batches that are augmented at all (the rest pass unchanged, so the student
    still sees the user's text as it is). ``span``: keep a random contiguous run of at least ``min_span`` of the
    row's body. ``mix``: append a random span of another row of the batch. ``shuffle``: cut the body into up to
    four chunks and permute them. ``drop``: remove each body token with probability ``drop_rate``.
    ``max_growth``: an augmented batch is at most this many times the given batch's width (spliced rows lose body
    tokens from their end): 1 keeps within the tokenizer's truncation length and the model's position table.
    """

    batch_fraction: float = 0.5
    span: float = 0.5
    mix: float = 0.3
    shuffle: float = 0.2
    drop: float = 0.3
    drop_rate: float = 0.15
    min_span: float = 0.25
    max_growth: float = 1.0

    def __post_init__(self):
        for name in ("batch_fraction", "span", "mix", "shuffle", "drop", "drop_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"Augmentation.{name} must be a probability in [0, 1]; got {value}")
        if not 0.0 < self.min_span <= 1.0:
            raise ValueError(f"Augmentation.min_span must be in (0, 1]; got {self.min_span}")
        if not self.max_growth >= 1.0:
            raise ValueError(
                f"Augmentation.max_growth must be >= 1 (a multiple of the batch's width); got {self.max_growth}"
            )


def _random_span(body: list[int], rng: random.Random, min_fraction: float) -> list[int]:
    if len(body) < 2:
        return body
    length = rng.randint(max(1, round(min_fraction * len(body))), len(body))
    start = rng.randrange(len(body) - length + 1)
    return body[start : start + length]


def _shuffled_chunks(body: list[int], rng: random.Random) -> list[int]:
    pieces = min(4, len(body))
    if pieces < 2:
        return body
    cuts = sorted(rng.sample(range(1, len(body)), pieces - 1))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    rng.shuffle(chunks)
    return [token for chunk in chunks for token in chunk]


def _dropped(body: list[int], rng: random.Random, rate: float) -> list[int]:
    kept = [token for token in body if rng.random() >= rate]
    return kept or body[:1]


def augment_rows(
    rows: list[list[int]], spec: Augmentation, rng: random.Random, max_length: int | None = None
) -> list[list[int]]:
    """Each row (its real tokens, ends included) edited as ``spec`` says; rows of fewer than three tokens pass.
    ``max_length``: a spliced row longer than this loses body tokens from its end (the model's position table, or
    the tokenizer's truncation, is not exceeded)."""
    bodies = [row[1:-1] for row in rows]
    out = []
    for i, row in enumerate(rows):
        if len(row) < 3:
            out.append(list(row))
            continue
        body = bodies[i]
        if rng.random() < spec.span:
            body = _random_span(body, rng, spec.min_span)
        if rng.random() < spec.mix and len(rows) > 1:
            other = rng.choice([j for j in range(len(rows)) if j != i])
            body = body + _random_span(bodies[other], rng, spec.min_span)
        if rng.random() < spec.shuffle:
            body = _shuffled_chunks(body, rng)
        if rng.random() < spec.drop:
            body = _dropped(body, rng, spec.drop_rate)
        if max_length is not None:
            body = body[: max(max_length - 2, 0)]
        out.append([row[0], *body, row[-1]])
    return out


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(
            "augmentation needs batches that are dicts with 'input_ids' and 'attention_mask' "
            f"(a tokenizer's output); got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    mask = batch["attention_mask"]
    if mask.dim() != 2 or batch["input_ids"].shape != mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must be 2-D and of one shape; got "
            f"{tuple(batch['input_ids'].shape)} and {tuple(mask.shape)}"
        )
    lengths = mask.sum(1)
    if not bool((mask == (torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]).to(mask.dtype)).all()):
        raise ValueError(
            "augmentation needs right-padded rows (the attention mask a run of ones, then zeros); "
            "tokenize with padding_side='right'"
        )


def augment_batch(
    batch: Mapping[str, Tensor], spec: Augmentation, rng: random.Random, pad_id: int = 0
) -> dict[str, Tensor]:
    """One right-padded token batch, augmented: new ``input_ids`` / ``attention_mask`` (trimmed to the longest
    row, at most ``spec.max_growth`` times the batch's width); ``token_type_ids``, if present, become zeros of the
    new shape. Other keys are refused, since the edits would leave them out of step with the tokens."""
    _check_batch(batch)
    extra = set(batch) - {"input_ids", "attention_mask", "token_type_ids"}
    if extra:
        raise ValueError(f"augmentation cannot edit batch keys {sorted(extra)} along with the tokens")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = [ids[r, : int(n)].tolist() for r, n in enumerate(mask.sum(1))]
    rows = augment_rows(rows, spec, rng, max_length=int(spec.max_growth * ids.shape[1]))
    width = max(len(row) for row in rows)
    new_ids = torch.full((len(rows), width), pad_id, dtype=ids.dtype)
    new_mask = torch.zeros((len(rows), width), dtype=mask.dtype)
    for r, row in enumerate(rows):
        new_ids[r, : len(row)] = torch.tensor(row, dtype=ids.dtype)
        new_mask[r, : len(row)] = 1
    out = {"input_ids": new_ids.to(ids.device), "attention_mask": new_mask.to(mask.device)}
    if "token_type_ids" in batch:
        out["token_type_ids"] = torch.zeros_like(out["input_ids"])
    return out


class Augmenter:
    """Augments ``spec.batch_fraction`` of the batches it is given (the rest pass unchanged), with its own
    ``random.Random(seed)``: the global RNGs are not touched. ``pad_id``: the tokenizer's padding id (0 for BERT)."""

    def __init__(self, spec: Augmentation | None = None, *, seed: int = 0, pad_id: int = 0):
        if spec is not None and not isinstance(spec, Augmentation):
            raise ValueError(
                f"augment must be a comera_fx.pretrained.Augmentation (e.g. augment=Augmentation()) "
                f"or None; got {spec!r}"
            )
        self.spec = spec or Augmentation()
        self.rng = random.Random(seed)
        self.pad_id = pad_id

    def __call__(self, batch: Any) -> Any:
        if self.rng.random() >= self.spec.batch_fraction:
            _check_batch(batch)
            return batch
        return augment_batch(batch, self.spec, self.rng, self.pad_id)


def augmented(
    batches: Iterable[Any] | Callable[[], Any], spec: Augmentation | None = None, *, seed: int = 0, pad_id: int = 0
) -> Callable[[], dict[str, Tensor]]:
    """A batch source for ``distill_`` / ``match_teacher``: draws from ``batches`` (a callable, or an iterable
    cycled over) through an ``Augmenter(spec, seed=seed, pad_id=pad_id)``. (``DistillConfig(augment=spec)`` does
    the same to its training batches only, leaving the calibration batches as the user's text.)"""
    augmenter = Augmenter(spec, seed=seed, pad_id=pad_id)
    stream = BatchStream(batches)

    def next_batch() -> dict[str, Tensor]:
        batch = stream.next()
        if batch is None:
            raise ValueError(
                "augmented(...) was given an empty or used-up iterable of batches; pass a list or a "
                "callable that draws a batch"
            )
        return augmenter(batch)

    return next_batch
