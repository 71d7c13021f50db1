"""How comera_fx calls a user's model: the tensor in a module's output, where a block's hidden state sits, and
the state a call must leave as it found it (training flags, RNG).

Shared by calibration, distillation (matching outputs and hidden states, feeding blocks the teacher's inputs) and
the sequential refit (calling a transformer's blocks one at a time on cached inputs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn


def default_output(outputs: Any) -> Tensor:
    """The tensor to match: the output itself, ``last_hidden_state``, or the first tensor of a tuple / dict."""
    if isinstance(outputs, Tensor):
        return outputs
    hidden = getattr(outputs, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    values = outputs.values() if isinstance(outputs, Mapping) else outputs if isinstance(outputs, (tuple, list)) else ()
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise ValueError(
        f"cannot find a tensor to match in the model's output of type {type(outputs).__name__}; "
        f"pass output_fn=lambda outputs: <the tensor to match>"
    )


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, ``model(batch)`` for a tensor."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, Tensor):
        return model(batch)
    raise ValueError(
        f"a batch must be a dict of keyword inputs, a tuple of positional inputs or a tensor; "
        f"got {type(batch).__name__}"
    )


def input_slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where a block's input hidden states sit in its call: the first tensor argument, else ``hidden_states=``."""
    for i, value in enumerate(args):
        if isinstance(value, Tensor):
            return i
    return "hidden_states" if isinstance(kwargs.get("hidden_states"), Tensor) else None


@contextlib.contextmanager
def eval_modes(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode inside; afterwards each module's own training flag, not ``model.train()``'s
    (a user may keep a frozen part in eval mode inside a training model)."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """The global CPU (and initialised CUDA) RNG state restored afterwards: reading a model's statistics must not
    shift the random numbers of the user's training run."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def first_input(args: tuple, kwargs: dict) -> Tensor:
    """A layer's input in a forward hook: its first positional argument, else its first keyword argument."""
    return args[0] if args else next(iter(kwargs.values()))


def real_rows(x: Tensor, mask: Tensor | None, width: int) -> Tensor:
    """``x`` as rows of ``width`` features, without the rows ``mask`` marks as padding (zero) when the mask has
    ``x``'s leading dims (batch, seq); other inputs keep every row. Calibration and refit must drop the same rows."""
    flat = x.reshape(-1, width)
    if mask is not None and tuple(mask.shape) == tuple(x.shape[:-1]):
        flat = flat[mask.reshape(-1).to(device=flat.device, dtype=torch.bool)]
    return flat
