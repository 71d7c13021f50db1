"""Checks that run before a student changes: a budget is given, the student is a fresh copy of the teacher, the
batches run on both. Shared by ``distill_`` and ``compress_``; each raises a ValueError naming the fix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..tt.inventory import tt_matrices
from ..tt.layers import TTLinear
from .calling import call_model, default_output, eval_modes, preserved_rng


def check_budget(call: str, budget_seconds: float | None, steps: int | None) -> None:
    """At least one of ``budget_seconds`` (> 0) and ``steps`` (an int >= 1)."""
    if budget_seconds is None and steps is None:
        raise ValueError(
            f"{call} needs a budget: pass steps= (optimizer steps) and/or budget_seconds= "
            f"(wall clock of the training loop)"
        )
    if budget_seconds is not None and (
        isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)) or not budget_seconds > 0
    ):
        raise ValueError(f"budget_seconds must be a number > 0 or None; got {budget_seconds!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an int >= 1 or None; got {steps!r}")


def check_student_copy(student: nn.Module, teacher: nn.Module, hidden_modules: Sequence[str]) -> None:
    """``student`` is a dense copy of ``teacher`` (same parameter names and shapes, no shared storage, no TT layer
    yet, not a DDP wrapper) and every ``hidden_modules`` name is a module of the teacher."""
    if isinstance(student, DistributedDataParallel):
        raise ValueError(
            "pass the bare student, not a DistributedDataParallel wrapper: distill_ tensorizes it first "
            "and wraps it itself when torch.distributed is initialized (docs/distributed.md)"
        )
    if student is teacher:
        raise ValueError("student is the teacher itself; pass a copy: distill_(copy.deepcopy(teacher), teacher, ...)")
    if any(isinstance(m, TTLinear) for m in student.modules()) or tt_matrices(student):
        raise ValueError(
            "student already holds TT layers; distill_ tensorizes a dense copy of the teacher: "
            "pass copy.deepcopy(teacher)"
        )
    modules = dict(teacher.named_modules())
    unknown = [n for n in hidden_modules if n not in modules]
    if unknown:
        raise ValueError(
            f"hidden_modules {unknown} are not modules of the teacher; names are those of "
            f"teacher.named_modules(), e.g. {list(modules)[1:4]}"
        )
    s_params, t_params = dict(student.named_parameters()), dict(teacher.named_parameters())
    if s_params.keys() != t_params.keys():
        missing, extra = sorted(t_params.keys() - s_params.keys()), sorted(s_params.keys() - t_params.keys())
        raise ValueError(
            f"student is not a copy of teacher: parameters missing {missing[:3]}, extra {extra[:3]}; "
            f"pass copy.deepcopy(teacher)"
        )
    for name, p in s_params.items():
        t = t_params[name]
        if p.shape != t.shape:
            raise ValueError(
                f"student is not a copy of teacher: {name} has shape {tuple(p.shape)}, the teacher's "
                f"{tuple(t.shape)}; pass copy.deepcopy(teacher)"
            )
        if p.data_ptr() == t.data_ptr() and p.numel():
            raise ValueError(
                f"student shares parameter {name} with teacher (training would change the teacher); "
                f"pass copy.deepcopy(teacher)"
            )


def check_same_weights(student: nn.Module, teacher: nn.Module) -> None:
    """Refuse a student whose weights differ from the teacher's: the formats are chosen on the student's weights
    and the distillation starts from them, so a student trained apart (or another checkpoint) would be compressed
    towards a model it is not."""
    teacher_params = dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if not torch.equal(p.detach(), teacher_params[name].detach()):
            raise ValueError(
                f"student is not a copy of teacher: its {name} differs from the teacher's; pass copy.deepcopy(teacher)"
            )


def check_batches_run(
    student: nn.Module, teacher: nn.Module, batch: Any, output_fn: Callable[[Any], Tensor] | None
) -> None:
    """Run one batch through both models (no gradients, eval) so that batches of another model fail here, with a
    message, and not halfway through."""
    output_fn = output_fn or default_output
    try:
        with torch.no_grad(), eval_modes(teacher), eval_modes(student), preserved_rng():
            out_t = output_fn(call_model(teacher, batch))
            out_s = output_fn(call_model(student, batch))
    except (IndexError, RuntimeError, TypeError, ValueError, KeyError) as exc:
        raise ValueError(
            f"the batches do not run on this model ({type(exc).__name__}: {str(exc)[:200]}); pass "
            f"inputs of the teacher (e.g. its own tokenizer's output: a dict of input_ids / "
            f"attention_mask)"
        ) from exc
    if out_t.shape != out_s.shape:
        raise ValueError(
            f"student and teacher give outputs of shapes {tuple(out_s.shape)} and "
            f"{tuple(out_t.shape)} on the same batch: the student is not a copy of the teacher"
        )
