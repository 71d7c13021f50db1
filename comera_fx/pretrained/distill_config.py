"""How a student is trained against its teacher: ``DistillConfig``, the one set of distillation settings that
``distill_``, ``match_teacher`` and ``compress_`` take as ``config=``, and the model-derived defaults it resolves to.

The budget (``budget_seconds`` / ``steps``) and what the student is compressed to (``size_target``, ``byte_budget``)
are the calls' own arguments; everything about *how* it is trained is here, one spelling each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import check_config_type
from ..config import TensorizeConfig
from ..quantize import quantized_specs
from .augment import Augmentation

LossFn = Callable[[Tensor, Tensor], Tensor]

# The whole run at the rounded weights: on all-MiniLM-L6-v2 at 8x fewer bytes, 400 steps from the same start, it
# lifted other-source cosine from 0.943 (last 30 %) to 0.953 (benchmarks/history/2026-12-05-issue-46-quality.md);
# the weights never drift to float values that rounding then undoes.
QUANT_AWARE_SHARE = 1.0

#: The dtypes ``DistillConfig(autocast=)`` takes.
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def relative_mse(student: Tensor, teacher: Tensor) -> Tensor:
    """‖s − t‖² / ‖t‖² (mean over elements): scale-free, 1.0 for a student that outputs zeros."""
    return (student - teacher).pow(2).mean() / teacher.pow(2).mean().clamp_min(1e-12)


def matched_loss(
    config: DistillConfig,
    student_out: Tensor,
    teacher_out: Tensor,
    student_hidden: Mapping[str, Tensor],
    teacher_hidden: Mapping[str, Tensor],
) -> Tensor:
    """The distillation loss of a resolved ``config``: ``loss_fn`` on the outputs plus ``hidden_weight`` × the
    relative MSE of each matched hidden state (training steps and validation checks score the same thing)."""
    loss = config.loss_fn(student_out, teacher_out)
    for name, target in teacher_hidden.items():
        loss = loss + config.hidden_weight * relative_mse(student_hidden[name], target)
    return loss


def attention_mask_of(batch: Any) -> Tensor | None:
    """``batch["attention_mask"]`` of a dict batch, else None (every token counts): the default token mask."""
    return batch.get("attention_mask") if isinstance(batch, Mapping) else None


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DistillConfig:
    """How the student is trained against the teacher (everything but the budget and the size asked).

    ``lr`` / ``weight_decay``: AdamW on every trainable parameter of the student; the learning rate warms up over 5 %
    of the budget, then follows a cosine to 10 %. ``loss_fn(student_out, teacher_out)``: default ``relative_mse``;
    ``output_fn(outputs) -> Tensor``: what to match (None: the output if it is a tensor, else
    ``last_hidden_state``, else the first tensor of a tuple / dict).

    ``hidden_modules``: names (``named_modules()``) of modules whose first tensor output is matched too (relative
    MSE, weight ``hidden_weight``); None (default): the blocks of the model's longest ``nn.ModuleList`` of repeated
    layers (BERT's encoder layers; none in a model without one); ``()``: the output only. ``hidden_weight``: None:
    1 / their number. ``blockwise_fraction``: for this first share of the budget every ``hidden_modules`` block of
    the student runs on the teacher's input to it (block-wise distillation; its first tensor argument or
    ``hidden_states=`` is replaced).

    ``quant_aware``: the last share of the budget trained at the weights rounded onto their quantization grids
    (``comera_fx.quantize.on_grid``); None (default): 1.0 (the whole run) when the student holds quantized weights,
    else 0 (a 30 % tail measured 0.010 below the whole run on other-source text at 8x). A share > 0 for a student
    without quantized weights is refused.

    ``calibration_batches``: batches drawn first for the activation statistics (and trained on too; 0: plain
    TT-SVD in ``distill_``; ``compress_`` needs >= 1). ``token_mask(batch) -> Tensor`` (batch × seq, nonzero at real
    tokens; None from it: every token): padding left out of the statistics; default ``attention_mask_of``
    (``batch["attention_mask"]`` of a dict batch); None: every token.

    ``augment``: a ``comera_fx.pretrained.Augmentation`` to train on edited copies of token batches (the calibration
    batches stay as given). ``progress``: a tqdm bar (rank 0 only under ``torch.distributed``). ``clock``: seconds
    for ``budget_seconds`` (default ``time.perf_counter``).

    ``autocast``: both models' forward passes under ``torch.autocast`` in this dtype, so their GEMMs (and the TT
    layers' backward GEMMs) run in it, attention (``scaled_dot_product_attention``) kept in fp32; the weights, the
    optimizer and the loss stay fp32. Pays where the CPU multiplies bf16 natively (``comera_fx.packed.bf16_native()``:
    AMX or AVX-512 BF16); elsewhere bf16 GEMMs are slower than fp32. None (default): fp32 throughout.

    ``compress_`` only: ``output_batches`` of the calibration batches (at most all of them) score the format
    candidates at the output; ``pack`` swaps the int layers for ``PackedLinear`` and the TT layers with
    quantized cores for ``PackedTTLinear`` at the end (codes in memory; multiplied by ``comera_fx.packed.cpu_kernel``
    where it runs, else rebuilt to fp32 per call);
    ``validation_batches`` of the user's batches (the last ones of a list or tuple longer than 4 times as many; else
    drawn after the calibration batches) are not trained on: their loss is checked every 5 % of the run and the
    weights at its lowest are the ones returned (``match_teacher(validation=)``; 0: the last step's weights)."""

    lr: float = 5e-4
    weight_decay: float = 0.0
    loss_fn: LossFn = relative_mse
    output_fn: Callable[[Any], Tensor] | None = None
    hidden_modules: tuple[str, ...] | None = None
    hidden_weight: float | None = None
    blockwise_fraction: float = 0.0
    quant_aware: float | None = None
    calibration_batches: int = 32
    token_mask: Callable[[Any], Tensor | None] | None = attention_mask_of
    augment: Augmentation | None = None
    output_batches: int = 2
    pack: bool = True
    validation_batches: int = 2
    progress: bool = True
    clock: Callable[[], float] | None = None
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not (_is_number(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0; got {self.lr!r}")
        if not (_is_number(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a number >= 0; got {self.weight_decay!r}")
        if isinstance(self.hidden_modules, str):
            raise ValueError("hidden_modules must be a tuple of module names, not one string")
        if self.hidden_modules is not None:
            object.__setattr__(self, "hidden_modules", tuple(self.hidden_modules))
        if self.hidden_weight is not None and not (_is_number(self.hidden_weight) and self.hidden_weight >= 0):
            raise ValueError(f"hidden_weight must be a number >= 0 or None; got {self.hidden_weight!r}")
        if not (_is_number(self.blockwise_fraction) and 0 <= self.blockwise_fraction <= 1):
            raise ValueError(f"blockwise_fraction must be a number in [0, 1]; got {self.blockwise_fraction!r}")
        if self.blockwise_fraction and self.hidden_modules == ():
            raise ValueError(
                "blockwise_fraction > 0 feeds the teacher's inputs to the hidden_modules blocks; name them "
                "(hidden_modules=(...), e.g. the encoder layers) or leave hidden_modules=None (the repeated blocks)"
            )
        if self.quant_aware is not None and not (_is_number(self.quant_aware) and 0 <= self.quant_aware <= 1):
            raise ValueError(f"quant_aware must be a fraction of the run in [0, 1] or None; got {self.quant_aware!r}")
        if (
            isinstance(self.calibration_batches, bool)
            or not isinstance(self.calibration_batches, int)
            or self.calibration_batches < 0
        ):
            raise ValueError(f"calibration_batches must be an int >= 0; got {self.calibration_batches!r}")
        if (
            isinstance(self.output_batches, bool)
            or not isinstance(self.output_batches, int)
            or self.output_batches < 0
            or (self.calibration_batches and self.output_batches > self.calibration_batches)
        ):
            raise ValueError(f"output_batches must be an int in [0, calibration_batches]; got {self.output_batches!r}")
        if (
            isinstance(self.validation_batches, bool)
            or not isinstance(self.validation_batches, int)
            or self.validation_batches < 0
        ):
            raise ValueError(f"validation_batches must be an int >= 0; got {self.validation_batches!r}")
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"autocast must be torch.bfloat16, torch.float16 or None (fp32 throughout); got {self.autocast!r}"
            )
        if self.augment is not None and not isinstance(self.augment, Augmentation):
            raise ValueError(
                f"augment must be a comera_fx.pretrained.Augmentation (e.g. augment=Augmentation()) or None; "
                f"got {self.augment!r}"
            )

    def replace(self, **changes: Any) -> DistillConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


_FIELDS = frozenset(f.name for f in dataclasses.fields(DistillConfig))


def check_distill_config(call: str, config: Any) -> DistillConfig:
    """``config``, or ``DistillConfig()`` for None; a TypeError naming the fix for anything else (a dict, a
    ``TensorizeConfig`` in the place of the distillation settings)."""
    if isinstance(config, TensorizeConfig):
        raise TypeError(
            f"{call} takes the distillation settings as config=DistillConfig(...); pass the TensorizeConfig as "
            f"tensorize_config="
        )
    check_config_type(f"{call}(config=...)", config, DistillConfig, "DistillConfig(lr=1e-3)")
    return config or DistillConfig()


def refuse_loose_settings(call: str, keywords: Mapping[str, Any], renamed: Mapping[str, str] | None = None) -> None:
    """A TypeError naming the fix for keywords the call no longer takes: the distillation settings that moved into
    ``DistillConfig`` (spelled out as the config to pass), ``renamed`` ones, and any other (unexpected)."""
    if not keywords:
        return
    moved = {k: v for k, v in keywords.items() if k in _FIELDS}
    if moved:
        spelled = ", ".join(f"{k}={v!r}" for k, v in moved.items())
        raise TypeError(
            f"{call} takes the distillation settings {sorted(moved)} in its config: "
            f"{call}(..., config=DistillConfig({spelled}))"
        )
    for key in keywords:
        if renamed and key in renamed:
            raise TypeError(f"{call} got {key}=; {renamed[key]}")
    raise TypeError(f"{call} got an unexpected keyword argument {next(iter(keywords))!r}")


def resolved(config: DistillConfig, student: nn.Module, teacher: nn.Module) -> DistillConfig:
    """``config`` with the model-derived defaults filled in: ``hidden_modules`` (the teacher's repeated blocks),
    ``hidden_weight`` (1 / their number) and ``quant_aware`` (1.0 with quantized weights in the student, else 0)."""
    hidden = repeated_blocks(teacher) if config.hidden_modules is None else config.hidden_modules
    weight = config.hidden_weight if config.hidden_weight is not None else 1 / max(1, len(hidden))
    if config.quant_aware is not None:
        share = config.quant_aware
    else:
        share = QUANT_AWARE_SHARE if quantized_specs(student) else 0.0
    return config.replace(hidden_modules=hidden, hidden_weight=weight, quant_aware=share)
