"""One call from a trained model to a small one under a byte budget: ``compress_``.

The expert path is five calls across three modules (``calibrate`` → ``choose_formats(batches=)`` →
``apply_formats_`` → ``match_teacher(quant_aware=)`` → ``requantize_``), then ``pack_linears_`` for int kernels.
``compress_`` runs them in that order with the defaults that measured best on all-MiniLM-L6-v2 (formats scored at
the output, hidden states of the repeated blocks matched, the last 30 % of the budget trained at the rounded
weights, padding left out of the statistics) and checks everything it can before the first weight changes: the
student is a copy of the teacher, the batches run on both, the budget fits the smallest formats.

Distillation settings are data (``DistillConfig``); the budget and the byte target are the call's own arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..config import TensorizeConfig
from ..packed import pack_linears_, packed_modules
from ..quantize import requantize_
from .augment import Augmentation
from .calibrate import Calibration, calibrate
from .calling import default_output
from .distill import Batches, LossFn, _BatchStream, _call, _check_args, match_teacher, relative_mse
from .formats import FormatPlan, apply_formats_, choose_formats


@dataclass(frozen=True)
class DistillConfig:
    """How the student is trained against the teacher (everything but the budget).

    ``hidden_modules``: modules whose outputs are matched too (None: the blocks of the model's longest
    ``nn.ModuleList`` of repeated layers, e.g. BERT's encoder layers; ``()``: none); ``hidden_weight``: their loss
    weight (None: 1 / their number); ``quant_aware``: the last share of the budget trained at the rounded weights;
    ``calibration_batches``: batches drawn first for the statistics (and trained on too); ``output_batches``: how many
    of them score the format candidates at the output; ``token_mask``: ``token_mask(batch) -> Tensor`` of real tokens
    (None: ``batch["attention_mask"]`` when the batch is a dict holding one); ``pack``: swap the int8 / int4 layers
    for ``PackedLinear`` (int kernels, codes in memory) at the end."""

    lr: float = 5e-4
    weight_decay: float = 0.0
    hidden_modules: tuple[str, ...] | None = None
    hidden_weight: float | None = None
    blockwise_fraction: float = 0.0
    quant_aware: float = 0.3
    calibration_batches: int = 32
    output_batches: int = 2
    loss_fn: LossFn = relative_mse
    output_fn: Callable[[Any], Tensor] | None = None
    token_mask: Callable[[Any], Tensor] | None = None
    augment: Augmentation | None = None
    pack: bool = True
    progress: bool = True
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.calibration_batches, bool)
            or not isinstance(self.calibration_batches, int)
            or self.calibration_batches < 1
        ):
            raise ValueError(
                f"calibration_batches must be an int >= 1 (the format choice needs statistics), got "
                f"{self.calibration_batches!r}"
            )
        if (
            isinstance(self.output_batches, bool)
            or not isinstance(self.output_batches, int)
            or not 0 <= self.output_batches <= self.calibration_batches
        ):
            raise ValueError(f"output_batches must be an int in [0, calibration_batches], got {self.output_batches!r}")
        if (
            isinstance(self.quant_aware, bool)
            or not isinstance(self.quant_aware, (int, float))
            or not 0 <= self.quant_aware <= 1
        ):
            raise ValueError(f"quant_aware must be a fraction of the budget in [0, 1], got {self.quant_aware!r}")
        if self.hidden_weight is not None and not (
            isinstance(self.hidden_weight, (int, float)) and self.hidden_weight >= 0
        ):
            raise ValueError(f"hidden_weight must be a number >= 0 or None, got {self.hidden_weight!r}")
        if self.hidden_modules is not None and isinstance(self.hidden_modules, str):
            raise ValueError("hidden_modules must be a tuple of module names, not one string")

    def match_kwargs(self, hidden_modules: tuple[str, ...]) -> dict:
        """The keyword arguments of ``match_teacher`` these settings stand for (``hidden_modules`` resolved)."""
        weight = self.hidden_weight if self.hidden_weight is not None else 1 / max(1, len(hidden_modules))
        return dict(
            output_fn=self.output_fn,
            loss_fn=self.loss_fn,
            hidden_modules=hidden_modules,
            hidden_weight=weight,
            blockwise_fraction=self.blockwise_fraction,
            lr=self.lr,
            weight_decay=self.weight_decay,
            progress=self.progress,
            clock=self.clock,
            augment=self.augment,
            quant_aware=self.quant_aware,
        )


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
        lines += [f"  {fqn}: {label}" for fqn, label in self.formats.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The children of the model's longest ``nn.ModuleList`` whose entries are all of one type (a transformer's
    layers); () if there is none of two or more."""
    best: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) >= 2
            and len(module) > len(best)
            and len({type(m) for m in module}) == 1
        ):
            best = tuple(f"{path}.{i}" if path else str(i) for i in range(len(module)))
    return best


def attention_mask_of(batch: Any) -> Tensor | None:
    """``batch["attention_mask"]`` of a dict batch, else None: the default token mask."""
    return batch.get("attention_mask") if isinstance(batch, Mapping) else None


def _check_copy(student: nn.Module, teacher: nn.Module) -> None:
    """Refuse a student whose weights differ from the teacher's: the formats are chosen on the student's weights
    and the distillation starts from them, so a student trained apart (or another checkpoint) would be compressed
    towards a model it is not."""
    teacher_params = dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if not torch.equal(p.detach(), teacher_params[name].detach()):
            raise ValueError(
                f"student is not a copy of teacher: its {name} differs from the teacher's; pass copy.deepcopy(teacher)"
            )


def _check_batches_run(student: nn.Module, teacher: nn.Module, batch: Any, output_fn) -> None:
    """Run one batch through both models (no gradients, eval) so that batches of another model fail here, with a
    message, and not halfway through."""
    from .calling import eval_modes, preserved_rng

    try:
        with torch.no_grad(), eval_modes(teacher), eval_modes(student), preserved_rng():
            out_t = (output_fn or default_output)(_call(teacher, batch))
            out_s = (output_fn or default_output)(_call(student, batch))
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
    (int8 / int4 / TT with int8 or int4 cores, ``choose_formats`` scored at the output), builds it, distills for
    ``budget_seconds`` and/or ``steps`` (the last ``config.quant_aware`` share at the rounded weights), rounds the
    weights onto their grids and, with ``config.pack``, holds the int layers packed (``PackedLinear``). The student
    is ready for ``save_tensorized``. ``tensorize_config``: which layers count (``min_numel`` / ``skip``);
    ``calibration`` / ``plan``: reuse ones made on this model. Nothing changes in the student before every check
    has passed (a copy of the teacher, batches that run on it, a budget the smallest formats fit). Returns a
    ``CompressSummary``."""
    config = config or DistillConfig()
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a comera_fx.DistillConfig, got {type(config).__name__}")
    hidden = repeated_blocks(teacher) if config.hidden_modules is None else tuple(config.hidden_modules)
    _check_args(
        student,
        teacher,
        0.5,
        None,
        budget_seconds,
        steps,
        config.lr,
        config.hidden_weight or 0.0,
        config.calibration_batches,
        hidden,
    )
    _check_copy(student, teacher)
    tensorize_config = tensorize_config or TensorizeConfig()
    stream = _BatchStream(batches)
    start = time.perf_counter()
    drawn = [b for b in (stream.next() for _ in range(config.calibration_batches)) if b is not None]
    if not drawn:
        raise ValueError("batches yielded no batch; pass an iterable of model inputs or a callable returning one")
    _check_batches_run(student, teacher, drawn[0], config.output_fn)
    token_mask = config.token_mask or (attention_mask_of if attention_mask_of(drawn[0]) is not None else None)
    seconds: dict[str, float] = {}
    if calibration is None:
        calibration = calibrate(student, drawn, config=tensorize_config, token_mask=token_mask)
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
    losses, seconds["distill"], notes = match_teacher(
        student, teacher, stream, steps=steps, budget_seconds=budget_seconds, **config.match_kwargs(hidden)
    )
    requantize_(student)
    if config.pack:
        left = pack_linears_(student)
        notes += [f"{path} stays fake-quantized fp32: {why}" for path, why in left.items()]
    if any(c.format.startswith("tt") for c in plan.choices.values()):
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
