"""Compress a trained model: tensorize a dense copy of it, then train the copy to match the original.

``distill_(student, teacher, batches, size_target=0.25, budget_seconds=600)`` is the whole recipe: TT-SVD of the
student's large linear weights at the size target, then AdamW on the distance between the student's and the
teacher's outputs (and optionally hidden states) on the user's batches, until the budget is spent. Only the student
changes; the teacher runs under ``torch.no_grad`` in eval mode and is restored exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..config import TensorizeConfig, warn_renamed
from .augment import Augmentation, Augmenter
from .calibrate import Calibration, calibrate
from ..runtime.distributed import RankSync, world_size
from .calling import default_output, eval_modes, input_slot
from ..passes.sizing import SizeTargetTooSmall
from ..passes.tensorize import TensorizeSummary, tensorize_
from ..quantize import on_grid, quantized_specs
from .refit import refit_sequential_
from ..runtime.rank_adaptive import RankAdaptive
from ..runtime.rank_config import BudgetConfig
from ..tt.inventory import matrix_sizes, tt_matrices
from ..tt.layers import TTLinear

Batches = Iterable[Any] | Callable[[], Any]
LossFn = Callable[[Tensor, Tensor], Tensor]


def relative_mse(student: Tensor, teacher: Tensor) -> Tensor:
    """‖s − t‖² / ‖t‖² (mean over elements): scale-free, 1.0 for a student that outputs zeros."""
    return (student - teacher).pow(2).mean() / teacher.pow(2).mean().clamp_min(1e-12)


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
    def target_ratio(self) -> float:
        """Deprecated spelling of ``size_target``."""
        warn_renamed("DistillSummary.target_ratio", "DistillSummary.size_target")
        return self.size_target

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


# ---------------------------------------------------------------------------------------------------- checks


def _size_target_of(size_target: float | None, target_ratio: float | None) -> float:
    """``size_target``, or its deprecated spelling ``target_ratio`` (the same fraction of the dense size)."""
    if target_ratio is None:
        if size_target is None:
            raise TypeError(
                "distill_() needs size_target= (TT size / dense size of the linear weights, e.g. 0.25 for 4x smaller)"
            )
        return size_target
    if size_target is not None:
        raise TypeError("distill_: pass size_target= only (target_ratio= is its deprecated spelling); got both")
    warn_renamed(
        "distill_(target_ratio=...)", "distill_(size_target=...), the same fraction of the dense size", stacklevel=4
    )
    return target_ratio


def _check_args(
    student,
    teacher,
    size_target,
    start_ratio,
    budget_seconds,
    steps,
    lr,
    hidden_weight,
    calibration_batches,
    hidden_modules,
) -> None:
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
    if budget_seconds is None and steps is None:
        raise ValueError(
            "distill_ needs a budget: pass steps= (optimizer steps) and/or budget_seconds= "
            "(wall clock of the training loop)"
        )
    if budget_seconds is not None and (
        isinstance(budget_seconds, bool) or not isinstance(budget_seconds, number) or not budget_seconds > 0
    ):
        raise ValueError(f"budget_seconds must be a number > 0 or None; got {budget_seconds!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an int >= 1 or None; got {steps!r}")
    if not (isinstance(lr, number) and lr > 0):
        raise ValueError(f"lr must be a number > 0; got {lr!r}")
    if isinstance(calibration_batches, bool) or not isinstance(calibration_batches, int) or calibration_batches < 0:
        raise ValueError(f"calibration_batches must be an int >= 0; got {calibration_batches!r}")
    if not (isinstance(hidden_weight, number) and hidden_weight >= 0):
        raise ValueError(f"hidden_weight must be a number >= 0; got {hidden_weight!r}")
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


# ------------------------------------------------------------------------------------------------ batches


class _BatchStream:
    """Batches from a callable (one call per batch) or an iterable (restarted when exhausted, if it can be)."""

    def __init__(self, batches: Batches):
        if callable(batches) and not isinstance(batches, (Sequence, nn.Module)):
            self._call, self._iterable = batches, None
        elif isinstance(batches, Iterable):
            self._call, self._iterable = None, batches
        else:
            raise ValueError(
                f"batches must be an iterable of model inputs or a callable returning one; got {type(batches).__name__}"
            )
        self._it = None
        self._replay: list[Any] = []
        self.exhausted = False

    def push_back(self, batches: Sequence[Any]) -> None:
        """Hand these batches out again first (the calibration batches also serve for training)."""
        self._replay = list(batches) + self._replay

    def next(self) -> Any | None:
        """The next batch, or None when a one-shot iterator is used up."""
        batch = self._replay.pop(0) if self._replay else self._draw()
        if batch is not None and not isinstance(batch, (Mapping, tuple, list, Tensor)):
            raise ValueError(
                f"a batch must be a dict of keyword inputs, a tuple of positional inputs or a tensor; "
                f"got {type(batch).__name__}"
            )
        return batch

    def _draw(self) -> Any | None:
        if self._call is not None:
            return self._call()
        for attempt in range(2):
            if self._it is None:
                self._it = iter(self._iterable)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                if self._iterable is iter(self._iterable) or attempt:  # a one-shot iterator, or an empty iterable
                    self.exhausted = True
                    return None
        return None


def _call(model: nn.Module, batch: Any) -> Any:
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


class _Capture:
    """Forward hooks keeping the first tensor output of the named modules (hidden-state matching)."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        modules = dict(model.named_modules())
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise ValueError(
                f"hidden_modules {unknown} are not modules of the model; names are those of "
                f"model.named_modules(), e.g. {list(modules)[1:4]}"
            )
        self.outputs: dict[str, Tensor] = {}
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def keep(module, args, output):
            self.outputs[name] = default_output(output)

        return keep

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _TeacherInputs:
    """Block-wise distillation: while ``active``, each named block of the student runs on the teacher's input to
    the same block instead of its own predecessor's output, so every block learns its own map from correct inputs
    (its error is not compounded by the blocks before it, and its gradient does not pass through them)."""

    def __init__(self, teacher: nn.Module, student: nn.Module, names: Sequence[str]):
        t_modules, s_modules = dict(teacher.named_modules()), dict(student.named_modules())
        self.active = False
        self.inputs: dict[str, Tensor] = {}
        self._handles = []
        for name in names:
            self._handles.append(t_modules[name].register_forward_pre_hook(self._keep(name), with_kwargs=True))
            self._handles.append(s_modules[name].register_forward_pre_hook(self._feed(name), with_kwargs=True))

    def _keep(self, name: str):
        def keep(module, args, kwargs):
            slot = input_slot(args, kwargs)
            if slot is None:
                raise ValueError(
                    f"blockwise distillation: module {name!r} was called without a tensor input; "
                    f"name blocks whose first argument (or hidden_states=) is the hidden state, "
                    f"or pass blockwise_fraction=0"
                )
            if name in self.inputs:  # a shared block (one module called several times) has no single input
                raise ValueError(
                    f"blockwise distillation: module {name!r} ran more than once in one forward "
                    f"(shared weights); name blocks that run once per forward, or pass "
                    f"blockwise_fraction=0"
                )
            self.inputs[name] = (args[slot] if isinstance(slot, int) else kwargs[slot]).detach()

        return keep

    def _feed(self, name: str):
        def feed(module, args, kwargs):
            if not self.active or name not in self.inputs:
                return None
            slot = input_slot(args, kwargs)
            if isinstance(slot, int):
                args = args[:slot] + (self.inputs[name],) + args[slot + 1 :]
            else:
                kwargs = {**kwargs, slot: self.inputs[name]}
            return args, kwargs

        return feed

    def new_step(self) -> None:
        """Forget the previous batch's inputs (called before the teacher's forward)."""
        self.inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# -------------------------------------------------------------------------------------------------- sizing


# ---------------------------------------------------------------------------------------------- the recipe


_RANK_FIELDS = ("max_rank", "rank_ratio", "rel_tol")  # what a size target decides instead
_DEFAULT_MAX_RANK = next(f.default for f in dataclasses.fields(TensorizeConfig) if f.name == "max_rank")


def _check_config(config: TensorizeConfig) -> None:
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
            f"distill_ takes the size target as distill_(size_target=...); the config's "
            f"size_target={config.size_target!r} would be ignored: leave it unset in the config"
        )
    if given:
        raise ValueError(
            f"distill_ decides the ranks from size_target= and allocation=, so the config's "
            f"{', '.join(given)} would be ignored; leave max_rank / rank_ratio / rel_tol unset in the "
            f"config (and its overrides; skip= still excludes layers), or, to train at ranks of your "
            f"own, tensorize_(student, config) and then train with "
            f"comera_fx.pretrained.distill.match_teacher(student, teacher, batches, ...)"
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


def _lr_factor(progress: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first 5 % of the budget, then cosine decay to 10 % of the peak."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def distill_(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    *,
    size_target: float | None = None,
    budget_seconds: float | None = None,
    steps: int | None = None,
    output_fn: Callable[[Any], Tensor] | None = None,
    loss_fn: LossFn = relative_mse,
    hidden_modules: Sequence[str] = (),
    hidden_weight: float = 1.0,
    blockwise_fraction: float = 0.0,
    lr: float = 5e-4,
    weight_decay: float = 0.0,
    start_ratio: float | None = None,
    config: TensorizeConfig | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    allocation: str = "energy",
    calibration: Calibration | None = None,
    calibration_batches: int = 8,
    token_mask: Callable[[Any], Tensor] | None = None,
    refit: bool = False,
    augment: Augmentation | None = None,
    progress: bool = True,
    clock: Callable[[], float] | None = None,
    target_ratio: float | None = None,
) -> DistillSummary:
    """Tensorize ``student`` (a dense copy of ``teacher``) in place and train it to reproduce the teacher.

    Args:
        student: ``copy.deepcopy(teacher)`` (same parameter names and shapes, no shared storage); its large linear
            weights (``config``'s size threshold; embeddings stay dense) become TT layers.
        teacher: the trained model. Never modified: it runs under ``torch.no_grad`` in eval mode and every module's
            training flag is restored; its parameters, ``requires_grad`` and buffers are untouched.
        batches: model inputs — an iterable (restarted when exhausted; a one-shot iterator ends the run early)
            or a callable returning one batch per call. A batch is a dict of keyword inputs, a tuple of
            positional inputs or a tensor; the same batch goes to both models.
        size_target: final TT size (cores + gates) / dense size of the converted linear weights, in (0, 1] (the
            meaning of ``TensorizeConfig.size_target`` as a float; ``target_ratio=`` is its deprecated spelling).
        budget_seconds / steps: the training budget (wall clock of the loop, not counting the tensorization, and/or
            optimizer steps); at least one; with both the first one reached ends the run.
        output_fn: ``output_fn(outputs) -> Tensor``, what to match; default: the output if it is a tensor, else
            ``last_hidden_state``, else the first tensor of a tuple / dict.
        loss_fn: ``loss_fn(student_out, teacher_out)``; default ``relative_mse`` (‖s − t‖² / ‖t‖²).
        hidden_modules: names (``named_modules()``) of modules whose first tensor output is also matched
            (relative MSE, weight ``hidden_weight``), e.g. ``[f"encoder.layer.{i}" for i in range(6)]``.
        blockwise_fraction: for this first fraction of the budget (0 to 1, default 0), every ``hidden_modules``
            block of the student runs on the teacher's input to that block (block-wise distillation: each block
            learns its own map from correct inputs; errors do not compound across blocks); end to end after it.
            The blocks' first tensor argument (or ``hidden_states=``) is the input replaced.
        lr / weight_decay: AdamW on every trainable parameter of the student (cores, gates, biases, norms, the
            dense embedding); the learning rate warms up over 5 % of the budget, then follows a cosine to 10 %.
        start_ratio: ``None`` (default): tensorize at ``size_target`` directly. A value in (size_target, 1]:
            tensorize at that size and shrink to the target during training with ``RankAdaptive``'s budget
            schedule (same horizon as the training budget). Direct is the default: it spends the whole budget at
            the final size, and each step is cheaper (a larger start costs more per step). Measured so far only on a
            2-layer random BERT (d 64, 2x smaller, uniform ranks, 60 steps, busy machine): shrinking from 0.9 ended at a
            lower loss (2.3e-5 against 3.2e-5) but took 1.5x the wall clock for the same steps; on all-MiniLM-L6-v2
            the comparison was not run (benchmarks/RESULTS.md).
        config: base ``TensorizeConfig`` (size threshold, skip, overrides, format); ``size_target`` and
            ``allocation`` are set from ``size_target`` / ``start_ratio`` and ``allocation``. The ranks come from
            the size target, so a ``max_rank`` (other than the default), ``rank_ratio`` or ``rel_tol`` in it or
            in its overrides is refused (``ValueError`` naming the fix) rather than ignored.
            ``TensorizeConfig(num_modes=1)`` gives a whitened low-rank student (two cores per weight): on
            all-MiniLM-L6-v2 it ended level with TT at 4× and ahead at 8× after 600 s (docs/pretrained.md).
        filter_fn: as in ``tensorize_``.
        allocation: how the size target is split over the layers (``TensorizeConfig.allocation``): ``"energy"``
            (default: ranks per layer and bond from the activation-weighted spectra) or ``"uniform"`` (one max rank).
        calibration / calibration_batches: activation-aware (whitened) TT-SVD: a ``comera_fx.calibrate`` result, or
            None to calibrate the student (still dense) on the first ``calibration_batches`` batches (default 8;
            0: plain TT-SVD). Those batches are drawn from ``batches`` first and are the first training batches
            too, so a callable is called max(steps, calibration_batches) times in a run of ``steps`` steps.
        token_mask: ``token_mask(batch) -> Tensor`` (batch × seq, nonzero at real tokens), e.g.
            ``lambda b: b["attention_mask"]``: padding rows are left out of the calibration and the refit statistics.
        refit: after the tensorization, refit the TT layers in execution order on the compressed model's own inputs
            to the teacher's layer outputs (``comera_fx.refit_sequential_``, on the calibration batches, with
            ``hidden_modules`` as its ``blocks`` when they chain; counted in ``setup_seconds``). Needs
            ``calibration_batches`` >= 1, and enough tokens to pay (>= 32 batches of short texts). Off by default:
            on all-MiniLM-L6-v2 it lifted the start from cosine 0.61 to 0.73, but 100 s of distillation without it
            caught up, and after 600 s the two were equal (benchmarks/RESULTS.md "Issue 15: a better start").
        augment: ``comera_fx.pretrained.Augmentation(...)`` to train on edited copies of the batches (random spans,
            dropped tokens, shuffled chunks, rows spliced together; the teacher labels them), so that the student
            matches the teacher on text unlike the user's; for token batches (dicts with ``input_ids`` and a
            right-padded ``attention_mask``). The calibration batches stay as given. None (default): the batches
            as given. Measured on all-MiniLM-L6-v2: benchmarks/RESULTS.md, issue 29.
        progress: show a tqdm bar (if tqdm is installed; on rank 0 only under ``torch.distributed``).
        clock: seconds for ``budget_seconds`` (default ``time.perf_counter``; also ``start_ratio``'s schedule).

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
    size_target = _size_target_of(size_target, target_ratio)
    _check_args(
        student,
        teacher,
        size_target,
        start_ratio,
        budget_seconds,
        steps,
        lr,
        hidden_weight,
        calibration_batches,
        hidden_modules,
    )
    _check_blockwise(blockwise_fraction, hidden_modules)
    if refit and not calibration_batches:
        raise ValueError("refit=True refits on the calibration batches: set calibration_batches >= 1 (e.g. 32)")
    distributed = world_size() > 1
    config = config or TensorizeConfig()
    _check_config(config)
    output_fn = output_fn or default_output
    stream = _BatchStream(batches)
    notes: list[str] = []

    setup_start = time.perf_counter()
    drawn: list = []
    if (calibration is None or refit) and calibration_batches:
        drawn = [b for b in (stream.next() for _ in range(calibration_batches)) if b is not None]
        if not drawn:
            raise ValueError("batches yielded no batch; pass an iterable of model inputs or a callable returning one")
        stream.push_back(drawn)
    if calibration is None and drawn:
        calibration = calibrate(student, drawn, config=config, filter_fn=_linear_only(filter_fn), token_mask=token_mask)
        if distributed:
            calibration.all_reduce_()  # every rank decomposes from the statistics of all ranks' batches
    first_ratio = start_ratio or size_target
    tensorized = _tensorize_at(student, first_ratio, config, filter_fn, allocation, calibration)
    refit_summary = (
        refit_sequential_(student, teacher, drawn, token_mask=token_mask, blocks=hidden_modules) if refit else None
    )
    if refit_summary is not None:
        notes.append(str(refit_summary))
    _, dense = matrix_sizes(student)
    if distributed:
        _check_same_ranks(student)
    setup_seconds = time.perf_counter() - setup_start
    if distributed:
        setup_seconds = RankSync(None).value(setup_seconds, _device(student))

    hook_box: list[RankAdaptive] = []

    def attach(optimizer: torch.optim.Optimizer, model: nn.Module):
        if start_ratio is not None:
            horizon = dict(total_steps=steps) if steps is not None else dict(budget_seconds=budget_seconds)
            schedule = BudgetConfig(size_target=int(size_target * dense), **horizon)
            hook_box.append(
                RankAdaptive(model, optimizer, schedule, history_every=None, clock=None if steps is not None else clock)
            )
            return lambda: hook_box[0].model  # rebuilt after every prune under DDP
        return None

    losses, seconds, loop_notes = match_teacher(
        student,
        teacher,
        stream,
        steps=steps,
        budget_seconds=budget_seconds,
        output_fn=output_fn,
        loss_fn=loss_fn,
        hidden_modules=hidden_modules,
        hidden_weight=hidden_weight,
        blockwise_fraction=blockwise_fraction,
        lr=lr,
        weight_decay=weight_decay,
        progress=progress,
        on_optimizer=attach,
        augment=augment,
        observe=lambda loss: hook_box and hook_box[0].observe(loss),
        postfix=lambda: {"ratio": f"{matrix_sizes(student)[0] / dense:.3f}"},
        clock=clock,
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


def match_teacher(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    *,
    steps: int | None,
    budget_seconds: float | None,
    output_fn: Callable[[Any], Tensor] | None = None,
    loss_fn: LossFn = relative_mse,
    hidden_modules: Sequence[str] = (),
    hidden_weight: float = 1.0,
    blockwise_fraction: float = 0.0,
    lr: float = 5e-4,
    weight_decay: float = 0.0,
    progress: bool = True,
    on_optimizer: Callable[[torch.optim.Optimizer, nn.Module], Callable[[], nn.Module] | None] | None = None,
    observe: Callable[[Tensor], Any] | None = None,
    postfix: Callable[[], dict] | None = None,
    clock: Callable[[], float] | None = None,
    augment: Augmentation | None = None,
    quant_aware: float = 0.0,
) -> tuple[list[float], float, list[str]]:
    """The training loop of ``distill_`` for any student (no tensorization): AdamW on ``loss_fn`` between the
    student's and the teacher's outputs (+ hidden states) until ``steps`` and/or ``budget_seconds`` (on ``clock``,
    default ``time.perf_counter``) are spent. ``on_optimizer(optimizer, model)`` runs once the optimizer exists, with
    the model the loop calls (attach a ``RankAdaptive`` to it there); it may return a callable giving the model to
    call from then on (``lambda: hook.model``). ``observe(loss)`` runs before every ``optimizer.step()``. Both models
    run in eval mode; their training flags are restored. ``blockwise_fraction``: as in ``distill_`` (the first part
    of the budget feeds each ``hidden_modules`` block of the student the teacher's input to it).

    Under ``torch.distributed`` (an initialized group of several ranks; every rank calls it with its own batches)
    the student is wrapped in ``DistributedDataParallel(student, find_unused_parameters=True)`` for the loop (its
    constructor broadcasts rank 0's parameters and buffers), rank 0's clock decides the end of a
    ``budget_seconds`` run, the run ends on every rank when any rank's batches run out, and the losses returned are
    the mean over the ranks, the seconds rank 0's. ``augment``: as in ``distill_``. ``quant_aware``: the last
    fraction of the run (of ``steps`` or ``budget_seconds``) trains quantization-aware: each step's forward and
    backward run at the weights ``quantize_`` / ``apply_formats_`` put on a grid, rounded
    (``comera_fx.quantize.on_grid``), and the step updates their float values; ``requantize_`` the student
    afterwards, as without it. Returns (loss per step, seconds, notes)."""
    _check_blockwise(blockwise_fraction, hidden_modules)
    _check_quant_aware(quant_aware, student)
    stream = batches if isinstance(batches, _BatchStream) else _BatchStream(batches)
    augmenter = Augmenter(augment) if augment is not None else None
    output_fn = output_fn or default_output
    clock = clock or time.perf_counter
    notes: list[str] = []
    trainable = [p for p in student.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the student has no trainable parameter (every weight is frozen); nothing to distill")
    sync = RankSync(None) if world_size() > 1 else None
    device = _device(student)
    # find_unused_parameters: a part of the model the matched output does not depend on (BERT's pooler) gets no
    # gradient; DDP would otherwise raise at the next step
    runner = DistributedDataParallel(student, find_unused_parameters=True) if sync is not None else student
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    current = on_optimizer(optimizer, runner) if on_optimizer is not None else None

    modes = contextlib.ExitStack()  # both models in eval mode for the loop, each module's flag restored after it
    modes.enter_context(eval_modes(teacher))
    modes.enter_context(eval_modes(student))
    t_capture = _Capture(teacher, hidden_modules) if hidden_modules else None
    s_capture = _Capture(student, hidden_modules) if hidden_modules else None
    feed = _TeacherInputs(teacher, student, hidden_modules) if blockwise_fraction else None
    bar = _progress_bar(progress and (sync is None or dist.get_rank() == 0), steps, budget_seconds)
    losses: list[float] = []
    start = clock()
    try:
        while True:
            elapsed = clock() - start
            if sync is not None and budget_seconds:
                elapsed = sync.value(elapsed, device)  # rank 0's clock: every rank stops at the same step
            done = [len(losses) / steps if steps else 0.0, elapsed / budget_seconds if budget_seconds else 0.0]
            if max(done) >= 1.0:
                break
            batch = stream.next()
            ran_out = batch is None
            if sync is not None:
                ran_out = sync.mean(float(ran_out), device) > 0  # any rank's iterator ends the run on all
            if ran_out:
                notes.append(f"the batch iterator ran out after {len(losses)} steps, before the budget was spent")
                break
            if augmenter is not None:
                batch = augmenter(batch)
            model = current() if current is not None else runner
            for group in optimizer.param_groups:
                group["lr"] = lr * _lr_factor(max(done))
            if feed is not None:
                feed.active = max(done) < blockwise_fraction
                feed.new_step()
            with torch.no_grad():
                target = output_fn(_call(teacher, batch)).detach()
                t_hidden = {k: v.detach() for k, v in t_capture.outputs.items()} if t_capture else {}
            with on_grid(student) if quant_aware and max(done) >= 1 - quant_aware else contextlib.nullcontext():
                loss = loss_fn(output_fn(_call(model, batch)), target)
                for name, value in t_hidden.items():
                    loss = loss + hidden_weight * relative_mse(s_capture.outputs[name], value)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            if observe is not None:
                observe(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", **(postfix() if postfix else {}))
    finally:
        if t_capture:
            t_capture.remove()
            s_capture.remove()
        if feed is not None:
            feed.remove()
        modes.close()
        if bar is not None:
            bar.close()
    seconds = clock() - start
    if not losses:
        raise ValueError("batches yielded no batch; pass an iterable of model inputs or a callable returning one")
    if sync is not None:
        seconds = sync.value(seconds, device)
        mean = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        losses = (mean / sync.size).tolist()
    return losses, seconds, notes


def _check_blockwise(blockwise_fraction: float, hidden_modules: Sequence[str]) -> None:
    if not (isinstance(blockwise_fraction, (int, float)) and 0 <= blockwise_fraction <= 1):
        raise ValueError(f"blockwise_fraction must be a number in [0, 1]; got {blockwise_fraction!r}")
    if blockwise_fraction and not hidden_modules:
        raise ValueError(
            "blockwise_fraction > 0 feeds the teacher's inputs to the hidden_modules blocks; pass "
            "hidden_modules=[...] (e.g. the encoder layers)"
        )


def _check_quant_aware(quant_aware: float, student: nn.Module) -> None:
    if isinstance(quant_aware, bool) or not (isinstance(quant_aware, (int, float)) and 0 <= quant_aware <= 1):
        raise ValueError(f"quant_aware must be a fraction of the run in [0, 1]; got {quant_aware!r}")
    if quant_aware and not quantized_specs(student):
        raise ValueError(
            "quant_aware > 0 trains at the quantized weights, and the student has none; round it onto "
            "a grid first (comera_fx.quantize_ or comera_fx.apply_formats_)"
        )


def _device(model: nn.Module) -> torch.device:
    """Where collectives' tensors go: the model's (NCCL needs CUDA tensors, gloo takes CPU ones)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


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


def _progress_bar(progress: bool, steps: int | None, budget_seconds: float | None):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    desc = "distill" + (f" ({budget_seconds:.0f} s)" if budget_seconds else "")
    return tqdm(total=steps, desc=desc, unit="step")
