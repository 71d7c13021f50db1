"""Recomputation of chosen blocks (``torch.utils.checkpoint``), the other half of cutting activation memory.

RMM shrinks what linear layers keep for backward; attention probabilities, GELU and LayerNorm inputs and dropout
masks are the rest. A checkpointed block keeps only its inputs and recomputes its forward during backward, so
everything inside it — sketches included — exists for one block at a time. Randomized layers inside a
checkpointed block draw the same seeds when recomputed (checkpoint restores the RNG state), so the recomputed
sketch is the one the forward drew.

``checkpoint_modules(model, select)`` swaps the classes of the selected modules for ``Checkpointed<Base>``
(made once per class, picklable like the randomized ones); ``restore_checkpointed(model)`` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .swap import SwappedClass, mixed_class


class CheckpointedForward(SwappedClass):
    """Mixin before the module's class: in training mode with grad enabled, its forward runs under non-reentrant
    ``torch.utils.checkpoint``; otherwise it is the base class's forward."""

    _checkpoint_base: type
    prefix, base_attr = "Checkpointed", "_checkpoint_base"

    def forward(self, *args, **kwargs):
        base_forward = self._checkpoint_base.forward
        if not (self.training and torch.is_grad_enabled()):
            return base_forward(self, *args, **kwargs)
        return checkpoint(base_forward, self, *args, use_reentrant=False, **kwargs)


def checkpointed_class(base: type) -> type:
    return mixed_class(CheckpointedForward, base)


Selector = Callable[[nn.Module, str], bool] | type | tuple


def _selects(select: Selector) -> Callable[[nn.Module, str], bool]:
    if isinstance(select, type) or (isinstance(select, tuple) and all(isinstance(t, type) for t in select)):
        return lambda module, fqn: isinstance(module, select)
    if callable(select):
        return select
    raise ValueError(
        f"checkpoint must be a module class, a tuple of classes or a function (module, fqn) -> bool, got {select!r}"
    )


def checkpoint_modules(model: nn.Module, select: Selector) -> list[str]:
    """Checkpoint every module ``select`` picks (outermost wins: nothing inside a checkpointed module is wrapped
    again); returns their FQNs."""
    picks = _selects(select)
    chosen: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(done + ".") or done == "" for done in chosen):
            continue
        if not isinstance(module, CheckpointedForward) and picks(module, fqn):
            module.__class__ = checkpointed_class(type(module))
            chosen.append(fqn)
    return chosen


def restore_checkpointed(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if isinstance(module, CheckpointedForward):
            module.__class__ = module._checkpoint_base
            count += 1
    return count
