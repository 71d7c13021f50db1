"""Keep the best weights a distillation run passed through, judged on batches it does not train on.

Distillation can make a student worse: at 4x fewer bytes ``compress_``'s int8 start is within 0.0005 of the
teacher's embeddings, and 600 s of AdamW at the recipe's learning rate moved it to 0.969 on other-source text (and
on held-out training-source text). ``match_teacher(validation=...)`` measures the loss on a few held-out batches at
the start and every ``1 / checks`` of the budget, snapshots the weights whenever that loss is the lowest so far,
and puts the best snapshot back at the end, so a run never returns a student worse on those batches than the one
it started from."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..quantize import on_grid, quantized_specs
from .calling import call_model
from .distill_config import DistillConfig, matched_loss
from .match_hooks import HiddenCapture


def split_validation(batches: Any, count: int) -> tuple[Any, list[Any], bool]:
    """(training batches, validation batches, held out?). A list or tuple longer than ``4 * count`` gives its last
    ``count`` batches to validation and trains on the rest; shorter ones validate on their last ``count`` and train
    on all of them (``held out?`` False). Other batches (iterators, callables) are split later from the stream."""
    if count and isinstance(batches, (list, tuple)) and batches:
        if len(batches) > 4 * count:
            return list(batches[:-count]), list(batches[-count:]), True
        return batches, list(batches[-count:]), False
    return batches, [], True


class BestWeights:
    """The validation loss at chosen points of a run, and a copy of the student's state at the lowest one.

    The loss is the training loss (``matched_loss`` of the resolved ``config``) at the weights the run would
    return: rounded onto their grids when the student has quantized weights (what ``requantize_`` makes of them).
    The teacher's side is computed once. ``reduce(value)``: the mean over ranks under ``torch.distributed`` (every
    rank then keeps the same step)."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        batches: Sequence[Any],
        *,
        config: DistillConfig,
        output_fn: Callable[[Any], Tensor],
        hidden: tuple[HiddenCapture, HiddenCapture] | None,
        checks: int = 20,
        reduce: Callable[[float], float] | None = None,
    ):
        if not batches:
            raise ValueError("validation needs at least one batch")
        self.student, self.batches = student, list(batches)
        self.config, self.output_fn, self.hidden = config, output_fn, hidden
        self.checks, self.reduce = checks, reduce
        self.rounded = bool(quantized_specs(student))
        self.targets: list[tuple[Tensor, dict[str, Tensor]]] = []
        with torch.no_grad():
            for batch in self.batches:
                out = output_fn(call_model(teacher, batch)).detach()
                states = {k: v.detach() for k, v in hidden[0].outputs.items()} if hidden else {}
                self.targets.append((out, states))
        self.curve: list[tuple[int, float]] = []
        self.best_step: int | None = None
        self.best_loss = float("inf")
        self._state: dict[str, Tensor] | None = None
        self._next = 0

    def loss(self) -> float:
        """The mean validation loss of the student as it stands (no gradient, weights rounded when quantized)."""
        total = 0.0
        grid = on_grid(self.student) if self.rounded else contextlib.nullcontext()
        with torch.no_grad(), grid:
            for batch, (target, states) in zip(self.batches, self.targets):
                out = self.output_fn(call_model(self.student, batch))
                student_states = self.hidden[1].outputs if self.hidden else {}
                total += float(matched_loss(self.config, out, target, student_states, states))
        mean = total / len(self.batches)
        return self.reduce(mean) if self.reduce is not None else mean

    def due(self, progress: float) -> bool:
        """Whether a check falls due at this share of the budget (one every ``1 / checks``)."""
        return progress * self.checks >= self._next

    def check(self, step: int, progress: float) -> None:
        """Measure at ``step``; snapshot the weights if the loss is the lowest so far."""
        self._next = int(progress * self.checks) + 1
        value = self.loss()
        self.curve.append((step, value))
        if value < self.best_loss:
            self.best_loss, self.best_step = value, step
            self._state = {k: v.detach().clone() for k, v in self.student.state_dict().items()}

    def restore(self, last_step: int) -> list[str]:
        """Put the best snapshot back if a later step was worse; returns a note saying what was kept."""
        if self._state is None or self.best_step == last_step:
            return []
        self.student.load_state_dict(self._state)
        end = self.curve[-1][1]
        return [
            f"kept the weights after step {self.best_step} of {last_step}: their validation loss "
            f"{self.best_loss:.4g} is below the last step's {end:.4g}"
        ]
