"""Compress a trained model: tensorize a dense copy of it, then train the copy to match the original.

``distill_(student, teacher, batches, 0.25, budget_seconds=600, config=DistillConfig(...))`` is the whole recipe:
TT-SVD of the student's large linear weights at the size target, then ``match_teacher`` (AdamW on the distance
between the student's and the teacher's outputs and hidden states) on the user's batches, until the budget is spent.
Only the student changes; the teacher runs under ``torch.no_grad`` in eval mode and is restored exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import TensorizeConfig
from ..passes.sizing import SizeTargetTooSmall
from ..passes.tensorize import TensorizeSummary, tensorize_
from ..runtime.distributed import RankSync, world_size
from ..runtime.rank_adaptive import RankAdaptive
from ..runtime.rank_config import BudgetConfig
from ..tt.inventory import matrix_sizes, tt_matrices
from .batches import Batches, BatchStream
from .calibrate import Calibration, calibrate
from .distill_config import DistillConfig, check_distill_config, refuse_loose_settings, resolved
from .match import match_teacher, model_device
from .refit import refit_sequential_
from .student_checks import check_budget, check_student_copy


@dataclass
class DistillSummary:
    """What ``distill_`` did. ``ratio`` = TT parameters (cores + gates) / dense parameters of the converted linear
    weights, ``size_target`` the ratio asked; ``losses`` holds the training loss of every step; seconds are wall
    clock."""

    size_target: float
    ratio: float
    tt_params: int
    dense_params: int
    ranks: dict[str, tuple[int, ...]]
    steps: int
    losses: list[float]
    seconds: float
    setup_seconds: float
    strategy: str
    start_ratio: float
    tensorize: TensorizeSummary
    rank_summary: Any = None
    notes: list[str] = field(default_factory=list)
    refit: Any = None  # the RefitSummary of refit=True

    @property
    def compression(self) -> float:
        return self.dense_params / self.tt_params if self.tt_params else math.inf

    def __str__(self) -> str:
        first = f"{self.losses[0]:.4g}" if self.losses else "-"
        last = f"{sum(self.losses[-10:]) / len(self.losses[-10:]):.4g}" if self.losses else "-"
        lines = [
            f"comera_fx.distill_: {len(self.ranks)} linear weights in TT form, {self.dense_params:,} -> "
            f"{self.tt_params:,} params (ratio {self.ratio:.3f}, target {self.size_target:.3f}, "
            f"{self.compression:.1f}x smaller); {self.strategy} from ratio {self.start_ratio:.3f}",
            f"  {self.steps} steps in {self.seconds:.1f} s (+ {self.setup_seconds:.1f} s tensorize); "
            f"loss {first} -> {last} (mean of the last 10 steps)",
        ]
        lines += [f"  {name}: ranks {ranks}" for name, ranks in self.ranks.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_RANK_FIELDS = ("max_rank", "rank_ratio", "rel_tol")  # what a size target decides instead
_DEFAULT_MAX_RANK = next(f.default for f in dataclasses.fields(TensorizeConfig) if f.name == "max_rank")


def _check_tensorize_config(config: TensorizeConfig) -> None:
    """Refuse rank settings ``distill_`` would not use: it sizes the layers by ``size_target`` (and ``allocation``),
    so a ``max_rank``, ``rank_ratio`` or ``rel_tol`` of the caller's would otherwise be dropped without a word."""
    given = [
        f"{name}={getattr(config, name)!r}"
        for name in _RANK_FIELDS
        if getattr(config, name) not in (None, _DEFAULT_MAX_RANK if name == "max_rank" else None)
    ]
    given += [
        f"overrides[{pattern!r}][{name!r}]"
        for pattern, values in config.overrides.items()
        for name in _RANK_FIELDS
        if name in values
    ]
    if config.size_target is not None:
        raise ValueError(
            f"distill_ takes the size target as its own argument (distill_(student, teacher, batches, "
            f"size_target)); the tensorize_config's size_target={config.size_target!r} would be ignored: leave it "
            f"unset in the config"
        )
    if given:
        raise ValueError(
            f"distill_ decides the ranks from size_target= and allocation=, so tensorize_config's "
            f"{', '.join(given)} would be ignored; leave max_rank / rank_ratio / rel_tol unset in the "
            f"tensorize_config (and its overrides; skip= still excludes layers), or, to train at ranks of your "
            f"own, tensorize_(student, config) and then train with "
            f"comera_fx.pretrained.match_teacher(student, teacher, batches, budget_seconds, config=DistillConfig(...))"
        )


def _tensorize_at(student, ratio, config, filter_fn, allocation, calibration) -> TensorizeSummary:
    config = config.replace(size_target=float(ratio), allocation=allocation, max_rank=None)
    try:
        return tensorize_(student, config, filter_fn=_linear_only(filter_fn), calibration=calibration)
    except SizeTargetTooSmall as exc:
        raise SizeTargetTooSmall(
            f"distill_ at {ratio} of the dense size: {exc} (raise size_target, or start_ratio)"
        ) from None


def _linear_only(filter_fn):
    def accept(module: nn.Module, fqn: str) -> bool:
        return not isinstance(module, nn.Embedding) and (filter_fn is None or filter_fn(module, fqn))

    return accept


def distill_(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    size_target: float,
    budget_seconds: float | None = None,
    *,
    steps: int | None = None,
    config: DistillConfig | None = None,
    tensorize_config: TensorizeConfig | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    calibration: Calibration | None = None,
    start_ratio: float | None = None,
    allocation: str = "energy",
    refit: bool = False,
    **removed: Any,
) -> DistillSummary:
    """Tensorize ``student`` (a dense copy of ``teacher``) in place and train it to reproduce the teacher.

    Args:
        student: ``copy.deepcopy(teacher)`` (same parameter names and shapes, no shared storage); its large linear
            weights (``tensorize_config``'s size threshold; embeddings stay dense) become TT layers.
        teacher: the trained model. Never modified: it runs under ``torch.no_grad`` in eval mode and every module's
            training flag is restored; its parameters, ``requires_grad`` and buffers are untouched.
        batches: model inputs — an iterable (restarted when exhausted; a one-shot iterator ends the run early)
            or a callable returning one batch per call. A batch is a dict of keyword inputs, a tuple of
            positional inputs or a tensor; the same batch goes to both models.
        size_target: final TT size (cores + gates) / dense size of the converted linear weights, in (0, 1] (the
            meaning of ``TensorizeConfig.size_target`` as a float).
        budget_seconds / steps: the training budget (wall clock of the loop, not counting the tensorization, and/or
            optimizer steps); at least one; with both the first one reached ends the run.
        config: the distillation settings, a ``DistillConfig`` (learning rate, loss, hidden states matched,
            block-wise share, quantization-aware share, calibration batches, token mask, augmentation, progress
            bar, clock); default ``DistillConfig()``. Its ``calibration_batches`` are drawn from ``batches`` first
            and are the first training batches too, so a callable is called max(steps, calibration_batches) times
            in a run of ``steps`` steps; 0: plain TT-SVD. (``output_batches`` and ``pack`` are ``compress_``'s.)
        tensorize_config: base ``TensorizeConfig`` (size threshold, skip, overrides, format); ``size_target`` and
            ``allocation`` are set from ``size_target`` / ``start_ratio`` and ``allocation``. The ranks come from
            the size target, so a ``max_rank`` (other than the default), ``rank_ratio`` or ``rel_tol`` in it or
            in its overrides is refused (``ValueError`` naming the fix) rather than ignored.
            ``TensorizeConfig(num_modes=1)`` gives a whitened low-rank student (two cores per weight): on
            all-MiniLM-L6-v2 it ended level with TT at 4× and ahead at 8× after 600 s (docs/pretrained.md).
        filter_fn: as in ``tensorize_``.
        calibration: a ``comera_fx.calibrate`` result to decompose from (activation-aware, whitened TT-SVD); None:
            calibrate the student (still dense) on the first ``config.calibration_batches`` batches.
        start_ratio: ``None`` (default): tensorize at ``size_target`` directly. A value in (size_target, 1]:
            tensorize at that size and shrink to the target during training with ``RankAdaptive``'s budget
            schedule (same horizon as the training budget). Direct is the default: it spends the whole budget at
            the final size, and each step is cheaper (a larger start costs more per step). Measured so far only on a
            2-layer random BERT (d 64, 2x smaller, uniform ranks, 60 steps, busy machine): shrinking from 0.9 ended at a
            lower loss (2.3e-5 against 3.2e-5) but took 1.5x the wall clock for the same steps; on all-MiniLM-L6-v2
            the comparison was not run (benchmarks/RESULTS.md).
        allocation: how the size target is split over the layers (``TensorizeConfig.allocation``): ``"energy"``
            (default: ranks per layer and bond from the activation-weighted spectra) or ``"uniform"`` (one max rank).
        refit: after the tensorization, refit the TT layers in execution order on the compressed model's own inputs
            to the teacher's layer outputs (``comera_fx.refit_sequential_``, on the calibration batches, with the
            config's hidden modules as its ``blocks`` when they chain; counted in ``setup_seconds``). Needs
            ``config.calibration_batches`` >= 1, and enough tokens to pay (>= 32 batches of short texts). Off by
            default: on all-MiniLM-L6-v2 it lifted the start from cosine 0.61 to 0.73, but 100 s of distillation
            without it caught up, and after 600 s the two were equal (benchmarks/RESULTS.md "Issue 15: a better
            start").

    A distillation setting passed as a keyword (``lr=``, ``hidden_modules=``, ...) or a dict / ``TensorizeConfig``
    passed as ``config`` is refused with a TypeError spelling the ``DistillConfig`` to pass.

    **Distributed** (docs/distributed.md): with an initialized process group of several ranks, call it on every rank
    with that rank's own batches. The calibration it computes is all-reduced (``Calibration.all_reduce_``), so all
    ranks decompose from the same statistics; a ``calibration=`` given is used as is (give the same one everywhere).
    The training loop wraps the student in ``DistributedDataParallel`` (gradients averaged; the student you hold
    stays the bare module); rank 0's clock decides the end of a ``budget_seconds`` run, and a batch iterator that
    runs out on any rank ends the run on all of them. The summary is the same on every rank: losses averaged over
    the ranks, rank 0's seconds.

    The student is left in its original training mode(s) with every TT layer's contraction plans prepared, ready
    for ``eval()``, ``state_dict()`` and ``torch.compile(backend=comera_fx.backend)``. Frozen parameters stay frozen
    (TT cores of a frozen weight are frozen too) and are not trained.

    Random numbers: ``distill_`` draws none from the global RNGs — TT-SVD and TT rounding are deterministic, both
    models run in eval mode (no dropout) and ``augment`` has its own generator — so the global RNG advances only by
    what a ``batches`` callable draws.

    Returns a ``DistillSummary`` (ranks per layer, size, loss per step, time).
    """
    refuse_loose_settings(
        "distill_", removed, {"target_ratio": "pass size_target (the same fraction of the dense size)"}
    )
    config = check_distill_config("distill_", config)
    _check_size_target(size_target, start_ratio)
    check_budget("distill_", budget_seconds, steps)
    config = resolved(config, student, teacher)
    check_student_copy(student, teacher, config.hidden_modules)
    if refit and not config.calibration_batches:
        raise ValueError(
            "refit=True refits on the calibration batches: set DistillConfig(calibration_batches >= 1) (e.g. 32)"
        )
    distributed = world_size() > 1
    tensorize_config = tensorize_config or TensorizeConfig()
    _check_tensorize_config(tensorize_config)
    stream = BatchStream(batches)
    notes: list[str] = []

    setup_start = time.perf_counter()
    drawn: list = []
    if (calibration is None or refit) and config.calibration_batches:
        drawn = stream.take(config.calibration_batches)
        stream.push_back(drawn)
    if calibration is None and drawn:
        calibration = calibrate(
            student,
            drawn,
            config=tensorize_config,
            filter_fn=_linear_only(filter_fn),
            token_mask=config.token_mask,
        )
        if distributed:
            calibration.all_reduce_()  # every rank decomposes from the statistics of all ranks' batches
    first_ratio = start_ratio or size_target
    tensorized = _tensorize_at(student, first_ratio, tensorize_config, filter_fn, allocation, calibration)
    refit_summary = (
        refit_sequential_(student, teacher, drawn, token_mask=config.token_mask, blocks=config.hidden_modules)
        if refit
        else None
    )
    if refit_summary is not None:
        notes.append(str(refit_summary))
    _, dense = matrix_sizes(student)
    if distributed:
        _check_same_ranks(student)
    setup_seconds = time.perf_counter() - setup_start
    if distributed:
        setup_seconds = RankSync(None).value(setup_seconds, model_device(student))

    hook_box: list[RankAdaptive] = []

    def attach(optimizer: torch.optim.Optimizer, model: nn.Module):
        if start_ratio is not None:
            horizon = dict(total_steps=steps) if steps is not None else dict(budget_seconds=budget_seconds)
            schedule = BudgetConfig(size_target=int(size_target * dense), **horizon)
            clock = None if steps is not None else config.clock
            hook_box.append(RankAdaptive(model, optimizer, schedule, history_every=None, clock=clock))
            return lambda: hook_box[0].model  # rebuilt after every prune under DDP
        return None

    losses, seconds, loop_notes = match_teacher(
        student,
        teacher,
        stream,
        budget_seconds,
        steps=steps,
        config=config,
        on_optimizer=attach,
        observe=lambda loss: hook_box and hook_box[0].observe(loss),
        postfix=lambda: {"ratio": f"{matrix_sizes(student)[0] / dense:.3f}"},
    )
    notes += loop_notes
    hook = hook_box[0] if hook_box else None

    rank_summary = None
    if hook is not None:
        if matrix_sizes(student)[0] > size_target * dense:
            hook.prune_to(size_target * dense)
            notes.append(
                "the budget ended before the rank schedule reached the target; pruned to it at the end "
                "(without training after that cut)"
            )
        rank_summary = hook.summary()
        hook.remove()
    for entry in tt_matrices(student):
        if not entry.tt.is_zero:
            entry.tt.prepare_plans()
    tt, dense = matrix_sizes(student)
    ranks = {e.name: e.tt.ranks for e in tt_matrices(student)}
    return DistillSummary(
        size_target,
        tt / dense,
        tt,
        dense,
        ranks,
        len(losses),
        losses,
        seconds,
        setup_seconds,
        "shrink" if hook is not None else "direct",
        first_ratio,
        tensorized,
        rank_summary,
        notes,
        refit_summary,
    )


def _check_size_target(size_target: float, start_ratio: float | None) -> None:
    number = (int, float)
    if isinstance(size_target, bool) or not isinstance(size_target, number) or not 0 < size_target <= 1:
        raise ValueError(
            f"size_target must be a float in (0, 1] (TT size / dense size of the linear weights, "
            f"e.g. 0.25 for 4x smaller); got {size_target!r}"
        )
    if start_ratio is not None and (
        isinstance(start_ratio, bool) or not isinstance(start_ratio, number) or not size_target < start_ratio <= 1
    ):
        raise ValueError(
            f"start_ratio must be a float in (size_target, 1] = ({size_target}, 1] or None; got {start_ratio!r}"
        )


def _check_same_ranks(student: nn.Module) -> None:
    """Refuse (on every rank, before DDP fails with a shape error) TT shapes that differ between ranks."""
    ranks = [(e.name, tuple(e.tt.ranks)) for e in tt_matrices(student)]
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, ranks)
    differ = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if differ:
        raise ValueError(
            f"distill_ under torch.distributed: rank {differ[0]} tensorized to other TT ranks than rank "
            f"0 ({gathered[differ[0]][:2]} vs {gathered[0][:2]}); give every rank the same model, "
            f"config and calibration (distill_ all-reduces the calibration it computes itself; a "
            f"calibration= passed in must be the same on every rank: Calibration.all_reduce_())"
        )
