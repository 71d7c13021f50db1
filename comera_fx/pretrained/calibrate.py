"""Calibration: the input second moments C = XᵀX / n of a model's linear-like layers, for activation-aware TT-SVD.

``calibrate(model, batches)`` runs the model without gradients in eval mode and, through forward hooks on the
modules holding the weights ``tensorize_`` would convert (``nn.Linear``, transformers' ``Conv1D``), accumulates
each layer's XᵀX in float64. The result is keyed by the parameter FQN that ``tensorize_`` reports, and
``tensorize_(model, config, calibration=...)`` then decomposes those weights so that ||X(M - M̂)|| is small on
such inputs (``comera_fx.tt.whiten``), and weighs the rank allocation by it (``comera_fx.tt.allocate``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import TensorizeConfig
from ..runtime.distributed import agreed_sum, world_size
from .calling import eval_modes, first_input, preserved_rng, real_rows
from ..passes.find import find_in_model, split_example_inputs

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class InputStats:
    """One layer's inputs: C = XᵀX / n (d_in × d_in, float64) over ``tokens`` = n input rows."""

    second_moment: Tensor
    tokens: int

    @property
    def in_features(self) -> int:
        return self.second_moment.shape[0]


class Calibration(Mapping):
    """Parameter FQN -> ``InputStats``. ``torch.save(calibration, path)`` pickles it (load with
    ``weights_only=False``); ``save`` / ``load`` use a plain dict of tensors, which ``weights_only`` loading accepts."""

    def __init__(self, stats: Mapping[str, InputStats], batches: int = 0):
        self._stats = dict(stats)
        self.batches = batches

    def __getitem__(self, fqn: str) -> InputStats:
        return self._stats[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        tokens = sorted({s.tokens for s in self._stats.values()})
        return f"Calibration({len(self)} layers, {self.batches} batches, tokens per layer {tokens})"

    def to_dict(self) -> dict:
        return {
            "batches": self.batches,
            "stats": {k: {"second_moment": s.second_moment, "tokens": s.tokens} for k, s in self._stats.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Calibration":
        return cls(
            {k: InputStats(v["second_moment"], int(v["tokens"])) for k, v in data["stats"].items()},
            int(data.get("batches", 0)),
        )

    def all_reduce_(self, group=None) -> "Calibration":
        """Make this calibration the one of all ranks' batches together (a collective: call it on every rank).

        Under ``torch.distributed`` with ranks that calibrated on different data, each layer's C becomes
        Σ_r n_r C_r / Σ_r n_r (the token-weighted sums are reduced in float64, then rank 0's result is broadcast, so
        every rank holds bitwise the same statistics and decomposes to the same TT shapes); ``tokens`` and
        ``batches`` become the totals. Nothing happens without an initialized process group of more than one rank.
        Every rank must hold the same layers (the same model and filter). Returns ``self``."""
        import torch.distributed as dist

        world = world_size(group)
        if world == 1:
            return self
        keys = sorted(self._stats)
        shapes = [(k, tuple(self._stats[k].second_moment.shape)) for k in keys]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, shapes, group=group)
        if any(g != shapes for g in gathered):
            differ = next(r for r, g in enumerate(gathered) if g != shapes)
            raise ValueError(
                f"Calibration.all_reduce_: rank {differ} calibrated other layers than this rank "
                f"({len(gathered[differ])} vs {len(shapes)}); calibrate the same model with the same "
                f"filter_fn / config on every rank"
            )
        counts = agreed_sum(
            torch.tensor([self._stats[k].tokens for k in keys] + [self.batches], dtype=torch.int64), group
        ).tolist()
        for key, total in zip(keys, counts):
            s = self._stats[key]
            summed = agreed_sum((s.second_moment.to(torch.float64) * s.tokens).contiguous(), group)
            self._stats[key] = InputStats(summed / total, int(total))
        self.batches = int(counts[-1])
        return self

    def save(self, path: str | Path) -> None:
        torch.save(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        return cls.from_dict(torch.load(path, weights_only=True))


def _linear_holders(model: nn.Module, config: TensorizeConfig, filter_fn: FilterFn | None):
    """(module path, module, parameter FQN, d_in) of every linear-like module a conversion would read."""
    result = find_in_model(model, None)  # module scan: the modules whose inputs hooks can see
    out = []
    for cand in result.candidates:
        if cand.kind != "linear" or not config.is_large(cand.shape) or any(config.is_skipped(a) for a in cand.aliases):
            continue
        for use in cand.uses:
            module = model.get_submodule("" if use.node == "<root>" else use.node)
            if filter_fn is not None and not filter_fn(module, use.node):
                continue
            d_in = module.weight.shape[1] if isinstance(module, nn.Linear) else module.weight.shape[0]
            out.append((use.node, module, cand.fqn, d_in))
    return out


def calibrate(
    model: nn.Module,
    batches,
    *,
    max_batches: int | None = None,
    filter_fn: FilterFn | None = None,
    config: TensorizeConfig | None = None,
    token_mask: Callable[[object], Tensor] | None = None,
) -> Calibration:
    """Record C = XᵀX / n (float64) of the inputs of every large linear-like weight of ``model``.

    Args:
        model: the dense model, before ``tensorize_``.
        batches: an iterable of batches, or a callable returning one batch (called ``max_batches`` times, once if
            that is None). A batch is a dict of keyword inputs, a tuple/list of positional inputs, or a tensor.
        max_batches: stop after this many batches.
        filter_fn: ``filter_fn(module, module_fqn) -> bool``; only accepted modules are recorded.
        config: which weights are "large" and not skipped (``TensorizeConfig.min_numel`` / ``min_dim`` / ``skip``;
            default thresholds if None). Weights read by functional ops only (``F.linear`` on a raw parameter) are
            not seen by hooks; ``tensorize_`` decomposes them by plain TT-SVD and says so.
        token_mask: ``token_mask(batch) -> Tensor`` of shape (batch, seq), nonzero at real tokens, e.g.
            ``lambda b: b["attention_mask"]``: the rows of padding tokens are left out of every layer whose input has
            those leading dims. Without it every input row counts, padding included (a hook cannot see an attention
            mask), and on short texts padded to a batch's longest those rows can be most of the statistics.

    The model runs under ``torch.no_grad()`` in eval mode; each module's training flag and the global RNG state are
    restored afterwards, and the hooks are removed even if a batch fails.
    """
    _check_max_batches(max_batches)
    config = config or TensorizeConfig()
    holders = _linear_holders(model, config, filter_fn)
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    # Layers reading the same input tensor (Q, K, V) share one XᵀX per batch; cleared after every batch.
    # Held through weak references (a batch's activations are not kept alive); the identity check below also
    # guards against a freed tensor's address being reused.
    seen_inputs: dict[tuple, tuple[weakref.ref, Tensor, int]] = {}

    mask: list[Tensor | None] = [None]  # the current batch's token mask

    def make_hook(fqn: str, d_in: int):
        def hook(module, args, kwargs, output):
            x = first_input(args, kwargs)
            ident = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, d_in)
            cached = seen_inputs.get(ident)
            if cached is not None and cached[0]() is x:
                gram, rows = cached[1], cached[2]
            else:
                flat = real_rows(x.detach(), mask[0], d_in).to(torch.float64)
                gram, rows = flat.T @ flat, flat.shape[0]
                seen_inputs[ident] = (weakref.ref(x), gram, rows)
            sums[fqn] = sums[fqn] + gram if fqn in sums else gram.clone()
            counts[fqn] = counts.get(fqn, 0) + rows

        return hook

    handles = [module.register_forward_hook(make_hook(fqn, d_in), with_kwargs=True) for _, module, fqn, d_in in holders]
    n_batches = 0
    try:
        with eval_modes(model), preserved_rng(), torch.no_grad():
            for batch in _iterate(batches, max_batches):
                args, kwargs = split_example_inputs(batch)
                mask[0] = token_mask(batch) if token_mask is not None else None
                model(*args, **kwargs)
                seen_inputs.clear()
                n_batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if n_batches == 0:
        raise ValueError("calibrate got no batches; pass an iterable of batches or a callable returning one")
    stats = {fqn: InputStats((sums[fqn] / counts[fqn]).cpu(), counts[fqn]) for fqn in sums if counts[fqn] > 0}
    return Calibration(stats, n_batches)


def _check_max_batches(max_batches) -> None:
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ValueError(f"max_batches must be an int >= 1 or None; got {max_batches!r}")


def _iterate(batches, max_batches: int | None):
    if callable(batches):
        for _ in range(max_batches or 1):
            yield batches()
        return
    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            return
        yield batch
