"""One call from a trained model to a small one under a byte budget: ``compress_``.

The expert path is five calls (``calibrate`` → ``choose_formats(batches=)`` → ``apply_formats_`` →
``match_teacher(config=DistillConfig(quant_aware=1.0))`` → ``requantize_``), then ``pack_linears_`` for int kernels.
``compress_`` runs them in that order with the defaults that measured best on all-MiniLM-L6-v2 (formats scored at
the output, hidden states of the repeated blocks matched, the whole budget trained at the rounded weights,
padding left out of the statistics) and checks everything it can before the first weight changes: the
student is a copy of the teacher, the batches run on both, the budget fits the smallest formats.

Distillation settings are data (``DistillConfig``); the budget and the byte target are the call's own arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch import nn

from ..config import TensorizeConfig
from ..packed import bf16_native, pack_linears_, packed_modules
from ..quantize import requantize_
from .batches import Batches, BatchStream
from .calibrate import Calibration, calibrate
from .distill_config import DistillConfig, check_distill_config, resolved
from .format_select import CORE_BITS
from .formats import FormatPlan, apply_formats_, choose_formats
from .keep_best import split_validation
from .match import match_teacher
from .student_checks import check_batches_run, check_budget, check_same_weights, check_student_copy


@dataclass
class CompressSummary:
    """What ``compress_`` did: the plan (format per layer), bytes of those weights as stored and as held in memory,
    the loss of every training step, and where the time went (seconds, wall clock)."""

    plan: FormatPlan
    stored_bytes: int
    dense_bytes: int
    resident_bytes: int
    formats: dict[str, str]
    losses: list[float]
    seconds: dict[str, float]
    hidden_modules: tuple[str, ...]
    notes: list[str] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.losses)

    def __str__(self) -> str:
        first = f"{self.losses[0]:.4g}" if self.losses else "-"
        tail = self.losses[-10:]
        last = f"{sum(tail) / len(tail):.4g}" if tail else "-"
        counts = ", ".join(f"{n} x {label}" for label, n in sorted(self.plan.counts().items()))
        time_line = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        lines = [
            f"comera_fx.compress_: {len(self.formats)} layers, {self.dense_bytes:,} fp32 bytes -> "
            f"{self.stored_bytes:,} stored ({self.stored_bytes / self.dense_bytes:.4f}, "
            f"{self.dense_bytes / self.stored_bytes:.1f}x smaller), {self.resident_bytes:,} in memory",
            f"  formats: {counts}",
            f"  time: {time_line}",
            f"  {self.steps} steps; loss {first} -> {last} (mean of the last 10)",
        ]
        if self.validation:
            best = min(self.validation, key=lambda point: point[1])
            lines.append(
                f"  validation loss {self.validation[0][1]:.4g} at the start, {self.validation[-1][1]:.4g} at the "
                f"end, lowest {best[1]:.4g} after step {best[0]} (the weights returned)"
            )
        lines += [f"  {fqn}: {label}" for fqn, label in self.formats.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def compress_(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    byte_budget: int | float = 0.125,
    budget_seconds: float | None = 600.0,
    *,
    steps: int | None = None,
    config: DistillConfig | None = None,
    tensorize_config: TensorizeConfig | None = None,
    calibration: Calibration | None = None,
    plan: FormatPlan | None = None,
) -> CompressSummary:
    """Compress ``student`` (``copy.deepcopy(teacher)``) in place so that its large linear weights fit
    ``byte_budget`` (bytes, or a float fraction of their fp32 bytes), trained to reproduce ``teacher``.

    Calibrates on the first ``config.calibration_batches`` batches (padding left out), chooses a format per layer
    (int8 / int4 / int3 / TT with int8 or int4 cores, ``choose_formats`` scored at the output), builds it, distills for
    ``budget_seconds`` and/or ``steps`` (``config.quant_aware``: by default all at the rounded weights), keeps the
    weights at the lowest loss on ``config.validation_batches`` held-out batches (checked every 5 % of the run: a
    near-lossless start that training would only blur comes back unchanged), rounds the weights onto their grids
    and, with ``config.pack``, holds the layers packed (``PackedLinear``, ``PackedTTLinear``).
    The student is ready for ``save_tensorized``. ``tensorize_config``: which layers count (``min_numel`` / ``skip``);
    ``calibration`` / ``plan``: reuse ones made on this model. Nothing changes in the student before every check
    has passed (a copy of the teacher, batches that run on it, a budget the smallest formats fit). Returns a
    ``CompressSummary``."""
    config = check_distill_config("compress_", config)
    if not config.calibration_batches:
        raise ValueError(
            "compress_ chooses the formats from calibration statistics: DistillConfig(calibration_batches >= 1)"
        )
    check_budget("compress_", budget_seconds, steps)
    hidden = resolved(config, student, teacher).hidden_modules
    check_student_copy(student, teacher, hidden)
    check_same_weights(student, teacher)
    tensorize_config = tensorize_config or TensorizeConfig()
    training, validation, held_out = split_validation(batches, config.validation_batches)
    stream = BatchStream(training)
    start = time.perf_counter()
    drawn = stream.take(config.calibration_batches)
    check_batches_run(student, teacher, drawn[0], config.output_fn)
    notes: list[str] = []
    if config.validation_batches and not validation:
        # an iterator's or callable's next batches: never trained on (a re-iterable that builds new batches every
        # pass, a DataLoader, hands their data out again in later passes)
        validation = [b for b in (stream.next() for _ in range(config.validation_batches)) if b is not None]
        if not validation:
            notes.append("no batch was left for validation after the calibration batches: the last step's weights")
    if not held_out:
        notes.append(
            f"the {len(validation)} validation batches are trained on too: give more than "
            f"{4 * config.validation_batches} batches to hold them out"
        )
    seconds: dict[str, float] = {}
    if calibration is None:
        calibration = calibrate(student, drawn, config=tensorize_config, token_mask=config.token_mask)
    seconds["calibrate"] = time.perf_counter() - start
    if plan is None:
        start = time.perf_counter()
        plan = choose_formats(
            student,
            calibration,
            byte_budget,
            config=tensorize_config,
            batches=drawn[: config.output_batches] or None,
            output_fn=config.output_fn,
            fast=True,
        )
        seconds["choose_formats"] = time.perf_counter() - start
    start = time.perf_counter()
    built = apply_formats_(student, plan, calibration)  # the first change to the student
    seconds["build"] = time.perf_counter() - start
    stream.push_back(drawn)
    curve: list[tuple[int, float]] = []
    losses, seconds["distill"], run_notes = match_teacher(
        student,
        teacher,
        stream,
        budget_seconds,
        steps=steps,
        config=config,
        validation=validation or None,
        validation_curve=curve,
    )
    notes += run_notes
    requantize_(student)
    if config.pack:
        left = pack_linears_(student)
        notes += [f"{path} stays fake-quantized fp32: {why}" for path, why in left.items()]
        if bf16_native() and packed_modules(student):
            notes.append(
                "this CPU multiplies bf16 natively: comera_fx.packed.set_compute_dtype_(student, 'auto') runs the "
                "packed layers' GEMMs in bf16 for calls of 64 tokens or more (about 3e-3 relative error), and "
                "DistillConfig(autocast=torch.bfloat16) trains 1.4-1.6x the steps in the same budget (on MiniLM: "
                "+0.010 to +0.015 at 16x, no gain at 8x; docs/pretrained.md)"
            )
    if not config.pack and any(c.format in CORE_BITS for c in plan.choices.values()):
        notes.append("TT cores are held in fp32 in memory (on their int grid); only the saved file stores codes")
    return CompressSummary(
        plan,
        built.stored_bytes,
        plan.dense_bytes,
        resident_bytes(student, plan),
        {fqn: c.label() for fqn, c in plan.choices.items()},
        losses,
        seconds,
        hidden,
        notes,
        curve,
    )


def resident_bytes(model: nn.Module, plan: FormatPlan) -> int:
    """Bytes the planned layers' weights take in memory now: packed codes and scales, else their tensors."""
    packed = packed_modules(model)
    total = 0
    for path in plan.module_paths.values():
        module = model.get_submodule(path)
        if path in packed:
            total += packed[path].nbytes()
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() >= 2)
    return total
