"""Rank-adaptive training of TT layers: ranks shrink during training towards a size target, and the removed rank
slices are taken out physically (cores, gates and the optimizer's state shrink together).

``RankAdaptive`` attaches to an existing optimizer through its step hooks, so the training loop stays as it is.
Two schedules (docs/rank_adaptive.md):

* ``schedule="budget"`` (default) — the live TT size follows a known schedule (``schedule.BudgetSchedule``:
  warm-up, cubic decay, final window) from its size now to ``target_ratio`` / ``target_params`` by the end of a
  horizon (``total_steps`` or ``budget_seconds``); at each of a few prune points the slices of least importance
  (``importance``: the bond's smoothed |g ⊙ ∂L/∂g| split by its singular values) are removed across all
  layers at once (``schedule.allocate``), by TT rounding (``shrink.round_to_ranks_``). Gradients are never
  touched.
* ``schedule="comera"`` — CoMERA's two-stage scalarization (``comera``): an ℓ1 pull on the gates, a late stage
  that rescales the task gradient by λ, and removal of the dead slices (|g| <= threshold) every ``prune_every``.

The only extra call in the loop is ``hook.observe(loss)`` before ``optimizer.step()``, when the CoMERA schedule
needs the loss (a target loss, plateau detection) or for the loss column of the history.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx, nn

from ..report import DEFAULT_GATE_THRESHOLD, _layer_name
from .distributed import RankSync
from ..tt.layers import TTMatrix
from .comera import EARLY, LATE, PlateauDetector, achievement_lambda, add_gate_penalty_, scale_grads_
from .history import HistoryEntry, RankSummary
from .importance import BondSensitivity, slice_importance
from .schedule import BudgetSchedule, LayerSlices, allocate
from .shrink import (ShrinkRecord, bond_singular_values, params_at_ranks, physical_params, remove_slices_,
                     round_to_ranks_, shrink_)

__all__ = ["RankAdaptive", "param_groups", "tt_matrices", "MatrixEntry", "HistoryEntry", "RankSummary", "EARLY",
           "LATE", "achievement_lambda", "add_gate_penalty_", "shrink_", "remove_slices_", "ShrinkRecord",
           "params_at_ranks", "physical_params"]

BUDGET, COMERA = "budget", "comera"

# --------------------------------------------------------------------------------------------- finding matrices


@dataclass(frozen=True)
class MatrixEntry:
    """One TT matrix of the model. ``shrinkable`` is False for matrices registered by the graph pass
    (``passes.tensorize``): their ranks are baked into the graph as constants, so their slices cannot be removed."""

    name: str
    tt: TTMatrix
    shrinkable: bool


def tt_matrices(model: nn.Module) -> list[MatrixEntry]:
    """Every TTMatrix of ``model`` once, in registration order (a tied matrix appears under its first name)."""
    found: dict[int, MatrixEntry] = {}
    frozen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        for child in module.children():
            if isinstance(child, TTMatrix) and isinstance(module, fx.GraphModule):
                frozen.add(id(child))
        if isinstance(module, TTMatrix) and id(module) not in found:
            found[id(module)] = MatrixEntry(_layer_name(path), module, True)
    return [MatrixEntry(e.name, e.tt, id(e.tt) not in frozen) for e in found.values()]


def param_groups(
    model: nn.Module,
    *,
    lr_cores: float = 1e-4,
    lr_gates: float = 1e-3,
    lr_other: float = 5e-5,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups "tt_cores", "tt_gates" and "other" with CoMERA's separate learning rates.

    Every parameter appears exactly once (a tied matrix's cores too). Empty groups are left out. The gates get no
    weight decay whatever ``weight_decay`` is: decay would be a second, unscheduled rank penalty next to the one
    ``RankAdaptive`` controls.
    """
    matrices = tt_matrices(model)
    cores = [p for m in matrices for p in m.tt.cores]
    gates = [p for m in matrices for p in m.tt.gates]
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken]
    groups = [
        {"name": "tt_cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "tt_gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "other", "params": other, "lr": lr_other, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


# ------------------------------------------------------------------------------------------------ size accounting


def _live_counts(matrices: Sequence[MatrixEntry], threshold: float) -> list[tuple[int, ...]]:
    """Live gate entries (|g| > threshold) per bond of each matrix, read back with one transfer per device."""
    gates = [g for m in matrices for g in m.tt.gates]
    if not gates:
        return [() for _ in matrices]
    counts = [(g.detach().abs() > threshold).sum().to(gates[0].device) for g in gates]
    flat = iter(torch.stack(counts).tolist())
    return [tuple(next(flat) for _ in m.tt.gates) for m in matrices]


# ------------------------------------------------------------------------------------------------------ settings


def _check(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"RankAdaptive: {name} must be {what}; got {value!r}")


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


_UNSET: Any = object()  # prune_every=None means "never prune", so "not given" needs its own marker

BUDGET_DEFAULTS = {"warmup_fraction": 0.1, "final_fraction": 0.2, "prunes": 10, "importance_beta": 0.85,
                   "min_rank": 1, "rank0_below": 0.01}
COMERA_DEFAULTS = {"l1_weight": 0.01, "prune_every": 100, "plateau_tol": 1e-3, "reduction": "mean",
                   "late_loss_weight": 0.1, "late_size_weight": 0.0}
_ONLY = {BUDGET: (*BUDGET_DEFAULTS, "total_steps", "budget_seconds", "clock"),
         COMERA: (*COMERA_DEFAULTS, "target_loss", "late_start_step", "plateau_patience")}


@dataclass
class _Settings:
    """Validated constructor arguments (see ``RankAdaptive``); the other schedule's options are None."""

    schedule: str
    threshold: float
    history_every: int | None
    target_ratio: float | None
    target_params: int | None
    total_steps: int | None = None
    budget_seconds: float | None = None
    clock: Callable[[], float] | None = None
    warmup_fraction: float | None = None
    final_fraction: float | None = None
    prunes: int | None = None
    importance_beta: float | None = None
    min_rank: int | None = None
    rank0_below: float | None = None
    l1_weight: float | None = None
    prune_every: int | None = None
    target_loss: float | None = None
    late_start_step: int | None = None
    plateau_patience: int | None = None
    plateau_tol: float | None = None
    reduction: str | None = None
    late_loss_weight: float | None = None
    late_size_weight: float | None = None

    @classmethod
    def resolve(cls, schedule: str, common: dict[str, Any], given: dict[str, Any]) -> "_Settings":
        """Refuse the other schedule's options, fill this one's defaults."""
        _check("schedule", schedule, schedule in (BUDGET, COMERA), "'budget' (the default) or 'comera'")
        other = COMERA if schedule == BUDGET else BUDGET
        wrong = [n for n in _ONLY[other] if given[n] is not None and given[n] is not _UNSET]
        if wrong:
            raise ValueError(f"RankAdaptive: {', '.join(wrong)} belong to schedule={other!r}, not to "
                             f"schedule={schedule!r}; pass schedule={other!r} to use them, or drop them "
                             f"(docs/rank_adaptive.md)")
        defaults = BUDGET_DEFAULTS if schedule == BUDGET else COMERA_DEFAULTS
        values = {n: given[n] for n in _ONLY[schedule]}
        for name, default in defaults.items():
            if values[name] is _UNSET or (values[name] is None and name != "prune_every"):
                values[name] = default
        return cls(schedule=schedule, **common, **values)

    def __post_init__(self) -> None:
        _check("threshold", self.threshold, self.threshold >= 0, "a float >= 0")
        _check("history_every", self.history_every, self.history_every is None or _is_int(self.history_every, 1),
               "an int >= 1 or None")
        _check("target_ratio", self.target_ratio, self.target_ratio is None or 0 < self.target_ratio <= 1,
               "a float in (0, 1] or None")
        _check("target_params", self.target_params, self.target_params is None or _is_int(self.target_params, 0),
               "an int >= 0 or None")
        _check("target_ratio / target_params", (self.target_ratio, self.target_params),
               self.target_ratio is None or self.target_params is None, "given at most one of them")
        (self._check_budget if self.schedule == BUDGET else self._check_comera)()

    def _check_budget(self) -> None:
        if not self.has_target:
            raise ValueError("RankAdaptive: the budget schedule (the default) needs a size target: pass "
                             "target_ratio= (a fraction of the TT size now) or target_params= (TT parameters), "
                             "with total_steps= or budget_seconds=; schedule='comera' runs CoMERA's ℓ1 penalty, "
                             "which works without a target")
        if self.total_steps is None and self.budget_seconds is None:
            raise ValueError("RankAdaptive: a size target needs a horizon to reach it by: pass total_steps= (the "
                             "optimizer steps of the run) or budget_seconds= (its wall clock); the size then "
                             "reaches the target at 1 - final_fraction of the horizon")
        _check("total_steps / budget_seconds", (self.total_steps, self.budget_seconds),
               self.total_steps is None or self.budget_seconds is None, "given at most one of them")
        _check("total_steps", self.total_steps, self.total_steps is None or _is_int(self.total_steps, 1),
               "an int >= 1 or None")
        _check("budget_seconds", self.budget_seconds, self.budget_seconds is None or (
            isinstance(self.budget_seconds, (int, float)) and self.budget_seconds > 0), "a number > 0 or None")
        _check("clock", self.clock, self.clock is None or callable(self.clock), "a callable returning seconds")
        _check("min_rank", self.min_rank, _is_int(self.min_rank, 0), "an int >= 0")
        _check("rank0_below", self.rank0_below, self.rank0_below >= 0, "a float >= 0")

    def _check_comera(self) -> None:
        _check("l1_weight", self.l1_weight, self.l1_weight >= 0, "a float >= 0")
        for name in ("prune_every", "plateau_patience"):
            value = getattr(self, name)
            _check(name, value, value is None or _is_int(value, 1), "an int >= 1 or None")
        _check("late_start_step", self.late_start_step,
               self.late_start_step is None or _is_int(self.late_start_step, 0), "an int >= 0 or None")
        _check("reduction", self.reduction, self.reduction in ("mean", "sum"), "'mean' or 'sum'")
        _check("plateau_tol", self.plateau_tol, self.plateau_tol >= 0, "a float >= 0")
        has_switch = self.late_start_step is not None or self.plateau_patience is not None
        _check("late_start_step / plateau_patience", (self.late_start_step, self.plateau_patience),
               not has_switch or self.has_target, "used with target_ratio or target_params (the late stage "
               "needs a size target)")
        if self.has_target and not has_switch:
            raise ValueError("RankAdaptive: with schedule='comera' a size target is pursued only in the late "
                             "stage, which starts at late_start_step= or on a plateau (plateau_patience=); give "
                             "one of them, or use the default budget schedule with total_steps= / "
                             "budget_seconds=")

    @property
    def has_target(self) -> bool:
        return self.target_ratio is not None or self.target_params is not None


# ------------------------------------------------------------------------------------------------------- the hook


def _mids(tt: TTMatrix) -> tuple[int, ...]:
    return tuple(math.prod(core.shape[1:-1]) for core in tt.cores)


class RankAdaptive:
    """Rank adaptation of every TT layer of ``model``, driven by ``optimizer``'s step hooks.

    Build it after the optimizer (whose parameters must include the TT gates); then per step::

        loss.backward(); hook.observe(loss); optimizer.step(); optimizer.zero_grad()

    **Budget schedule** (default): needs a size target (``target_ratio`` of the TT size now, or ``target_params``)
    and a horizon (``total_steps``, or ``budget_seconds`` on ``clock``, default ``time.perf_counter``, counted
    from the first step). The TT size stays put for ``warmup_fraction`` (0.1) of the horizon, decays cubically to
    the target by 1 − ``final_fraction`` (0.8), then stays there; it is cut to the scheduled size at ``prunes``
    (10) evenly spaced points of the decay. Each cut removes, across all layers, the slices with the least
    importance (EMA, β = ``importance_beta`` 0.85, of |g ⊙ ∂L/∂g|) per parameter freed. Every bond keeps at least
    ``min_rank`` (1) slices, except in layers whose importance is below ``rank0_below`` (0.01) × the mean layer
    importance: those may go to rank 0 (their bias only; ``summary()`` says why). Gradients are not modified.

    **CoMERA** (``schedule="comera"``): ``l1_weight`` (0.01) · ∂R/∂g is added to the gates' gradients (R = mean
    |live gate entries|; ``reduction="sum"``: the sum). The late stage (needs a target, and ``late_start_step`` or
    ``plateau_patience``; optional ``target_loss``) scales every gradient by (1 − λ) + ``late_loss_weight`` (0.1)
    and adds (λ + ``late_size_weight`` (0)) · ∂R/∂g, λ from ``achievement_lambda``. Every ``prune_every`` (100)
    steps the dead slices (|g| <= ``threshold``) are removed.

    Removal is physical, optimizer state included. ``history`` holds one ``HistoryEntry`` per ``history_every``
    steps and per pruning. The parameters of shrunk matrices are new objects: read ``model.parameters()`` afresh
    after a pruning step (do not keep lists of them across steps).

    **Distributed** (docs/distributed.md): give it the ``DistributedDataParallel`` model. Every prune is decided on
    rank 0 and broadcast, the observed loss is averaged over the ranks, and after a prune the wrapper is rebuilt:
    call the model through ``hook.model`` (the old wrapper raises). FSDP2 models are refused (NotImplementedError).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        schedule: str = BUDGET,
        target_ratio: float | None = None,
        target_params: int | None = None,
        total_steps: int | None = None,
        budget_seconds: float | None = None,
        clock: Callable[[], float] | None = None,
        warmup_fraction: float | None = None,
        final_fraction: float | None = None,
        prunes: int | None = None,
        importance_beta: float | None = None,
        min_rank: int | None = None,
        rank0_below: float | None = None,
        l1_weight: float | None = None,
        prune_every: int | None = _UNSET,
        target_loss: float | None = None,
        late_start_step: int | None = None,
        plateau_patience: int | None = None,
        plateau_tol: float | None = None,
        reduction: str | None = None,
        late_loss_weight: float | None = None,
        late_size_weight: float | None = None,
        threshold: float = DEFAULT_GATE_THRESHOLD,
        history_every: int | None = 1,
    ):
        given = dict(total_steps=total_steps, budget_seconds=budget_seconds, clock=clock,
                     warmup_fraction=warmup_fraction, final_fraction=final_fraction, prunes=prunes,
                     importance_beta=importance_beta, min_rank=min_rank, rank0_below=rank0_below,
                     l1_weight=l1_weight, prune_every=prune_every, target_loss=target_loss,
                     late_start_step=late_start_step, plateau_patience=plateau_patience, plateau_tol=plateau_tol,
                     reduction=reduction, late_loss_weight=late_loss_weight, late_size_weight=late_size_weight)
        common = dict(threshold=threshold, history_every=history_every, target_ratio=target_ratio,
                      target_params=target_params)
        self.settings = s = _Settings.resolve(schedule, common, given)
        # Under torch.distributed (comera_fx.runtime.distributed): decisions agreed across ranks, DDP rebuilt after a prune
        self.distributed, module = RankSync.for_model(model)
        self.model, self.optimizer = model, optimizer  # self.model: the current DDP wrapper after a prune
        self.module = module
        self.matrices = tt_matrices(module)
        self._check_model()
        self.initial_tt_params = sum(physical_params(m.tt) for m in self.matrices)
        self.step = 0
        self.history: list[HistoryEntry] = []
        self.zeroed: dict[str, str] = {}  # layer -> why it went to rank 0
        self._start = time.perf_counter()
        self._pending_loss: float | None = None
        self._step_loss: float | None = None
        self._step_lam: float | None = None
        if s.schedule == BUDGET:
            self.schedule: BudgetSchedule | None = self._make_schedule()
            self.importance: BondSensitivity | None = BondSensitivity(s.importance_beta)
            self.stage = self.schedule.phase(0.0)
            self._clock = s.clock or time.perf_counter
            self._elapsed_before, self._clock_start = 0.0, None
            self._next_prune = 0
            self._warned_floor = False
        else:
            self.schedule, self.importance = None, None
            self.stage = EARLY
        self.switch_step: int | None = None
        self._plateau = (PlateauDetector(s.plateau_patience, s.plateau_tol)
                         if s.schedule == COMERA and s.plateau_patience is not None else None)
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def _make_schedule(self) -> BudgetSchedule:
        s = self.settings
        return BudgetSchedule(self.initial_tt_params, self.target_size, s.warmup_fraction, s.final_fraction,
                              s.prunes)

    def _check_model(self) -> None:
        if not self.matrices:
            raise ValueError("RankAdaptive: the model has no TTMatrix; run comera_fx.tensorize_(model, ...) first")
        optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [m.name for m in self.matrices if any(id(g) not in optimized for g in m.tt.gates)]
        if missing:
            raise ValueError(f"RankAdaptive: the optimizer does not hold the gates of {missing}; build it after "
                             f"tensorize_ (e.g. from comera_fx.runtime.param_groups(model))")
        frozen = [m.name for m in self.matrices if not m.shrinkable]
        if frozen and self.settings.schedule == BUDGET:
            warnings.warn(f"RankAdaptive: {frozen} come from the graph pass, whose ranks are constants of the graph; "
                          f"their slices are never removed, so the other TT matrices carry the whole size cut",
                          stacklevel=3)
        elif frozen and self.settings.prune_every is not None:
            warnings.warn(f"RankAdaptive: {frozen} come from the graph pass, whose ranks are constants of the graph; "
                          f"their gates are penalised but their slices are never removed", stacklevel=3)

    # -- public API ----------------------------------------------------------------------------------------------

    @property
    def target_size(self) -> float | None:
        """S_t in TT parameters (cores + gates), or None without a target."""
        if self.settings.target_params is not None:
            return float(self.settings.target_params)
        if self.settings.target_ratio is not None:
            return self.settings.target_ratio * self.initial_tt_params
        return None

    def observe(self, loss: float | Tensor) -> None:
        """Pass this step's loss; call once per step, before ``optimizer.step()`` (it applies to that step).
        Reads the value to the host (one synchronisation)."""
        self._pending_loss = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        if self.distributed is not None:  # CoMERA's λ and plateau read it: the same value on every rank
            self._pending_loss = self.distributed.mean(self._pending_loss, self._device())

    def tt_params(self) -> int:
        """Stored TT parameters (cores + gates) now."""
        return sum(physical_params(m.tt) for m in self.matrices)

    def live_tt_params(self) -> int:
        """TT parameters the model would hold if every dead slice were removed now (the S of the late stage)."""
        counts = _live_counts(self.matrices, self.settings.threshold)
        return sum(params_at_ranks(m.tt, c) for m, c in zip(self.matrices, counts))

    def elapsed_seconds(self) -> float:
        """Budget schedule: seconds on ``clock`` since the first step (carried over by checkpoints)."""
        running = 0.0 if self._clock_start is None else self._clock() - self._clock_start
        return self._elapsed_before + running

    def progress(self) -> float | None:
        """Budget schedule: the fraction of the horizon done (steps or seconds); None with CoMERA's."""
        s = self.settings
        if s.schedule != BUDGET:
            return None
        if s.total_steps is not None:
            return self.step / s.total_steps
        return self.elapsed_seconds() / s.budget_seconds

    def prune(self) -> list[ShrinkRecord]:
        """Remove every dead slice (|g| <= threshold) now (CoMERA's schedule does it every ``prune_every``)."""
        if self.distributed is not None:
            self.distributed.check()  # refuse before removing anything if the wrapper cannot be rebuilt
        records = []
        for m in self.matrices:
            if m.shrinkable:
                if self.distributed is None:
                    record = shrink_(m.tt, threshold=self.settings.threshold, optimizer=self.optimizer, name=m.name)
                else:  # rank 0's dead slices on every rank
                    masks = self.distributed.masks([g.detach().abs() > self.settings.threshold for g in m.tt.gates])
                    record = remove_slices_(m.tt, masks, optimizer=self.optimizer, name=m.name)
                if record is not None:
                    self._after_shrink(record, "its gates fell below the threshold")
                    records.append(record)
        self._after_prune(records)
        return records

    def prune_to(self, size: float) -> list[ShrinkRecord]:
        """Cut the TT size to <= ``size`` (or until every bond is at its floor): rank the directions of every
        bond of every layer jointly by importance per parameter freed (``importance.slice_importance``,
        ``schedule.allocate``) and TT-round each reduced matrix to its new ranks (``shrink.round_to_ranks_``).
        The budget schedule calls this at its prune points."""
        if self.importance is None:
            raise RuntimeError("RankAdaptive: prune_to() ranks slices by importance, which only the budget "
                               "schedule measures; with schedule='comera' use prune()")
        if self.distributed is not None:
            self.distributed.check()
        s = self.settings
        entries = [m for m in self.matrices if m.shrinkable and not m.tt.is_zero]
        unseen = self.importance.unseen(entries)  # e.g. experts no token reached since the last prune: kept as is
        if len(unseen) < len(entries):
            entries = [m for m in entries if m.name not in unseen]
        self.importance.start_window()
        fixed = self.tt_params() - sum(physical_params(m.tt) for m in entries)
        sensitivity, layer_importance = self.importance.values(entries)
        mean = sum(layer_importance.values()) / max(len(entries), 1)
        layers, reasons = [], {}
        for m in entries:
            imp = layer_importance[m.name]
            if s.min_rank == 0:
                floor, reasons[m.name] = 0, f"min_rank=0 (importance {imp:.3g}, mean layer importance {mean:.3g})"
            elif s.rank0_below > 0 and imp < s.rank0_below * mean:
                floor, reasons[m.name] = 0, (f"importance {imp:.3g} < rank0_below {s.rank0_below:g} × mean layer "
                                             f"importance {mean:.3g}")
            else:
                floor = s.min_rank
            sigmas = [sig.tolist() for sig in bond_singular_values(m.tt)]
            ranks = m.tt.layout.internal_ranks
            layers.append(LayerSlices(_mids(m.tt), tuple(slice_importance(sens, sig, r) for sens, sig, r in
                                                         zip(sensitivity[m.name], sigmas, ranks)), floor))
        records, decided = [], [[len(kept) for kept in keep] for keep in allocate(layers, size, fixed)]
        if self.distributed is not None:  # rank 0's ranks on every rank
            flat = iter(self.distributed.ints([r for ranks in decided for r in ranks], self._device()))
            decided = [[next(flat) for _ in ranks] for ranks in decided]
        for m, ranks in zip(entries, decided):
            record = round_to_ranks_(m.tt, ranks, optimizer=self.optimizer, name=m.name)
            if record is not None:
                self._after_shrink(record, reasons.get(m.name, ""))
                records.append(record)
        if self.tt_params() > size + 0.5 and not self._warned_floor:
            self._warned_floor = True
            warnings.warn(f"RankAdaptive: the scheduled size {size:,.0f} is below what the rank floors allow "
                          f"(min_rank={s.min_rank}); the TT size stays at {self.tt_params():,}. Lower min_rank or "
                          f"raise the target", stacklevel=2)
        self._after_prune(records)
        return records

    def _device(self) -> torch.device:
        return next((g.device for g in self._gates()), torch.device("cpu"))

    def _after_prune(self, records: Sequence[ShrinkRecord]) -> None:
        """Distributed: rebuild the DDP wrapper around the new parameters (``self.model`` is the new one)."""
        if records and self.distributed is not None:
            self.model = self.distributed.after_prune(self.module)

    def _after_shrink(self, record: ShrinkRecord, why: str) -> None:
        if record.zeroed:
            if self.importance is not None:
                self.importance.forget(record.name)
            self.zeroed[record.name] = why

    def summary(self) -> RankSummary:
        """Sizes, ranks, and which layers went to rank 0 and why (``str()`` formats it)."""
        return RankSummary(self.settings.schedule, self.step, self.stage, self.progress(), self.initial_tt_params,
                           self.target_size, self.tt_params(), {m.name: m.tt.ranks for m in self.matrices},
                           dict(self.zeroed))

    def remove(self) -> None:
        """Detach from the optimizer; later steps are plain optimizer steps. Safe to call twice."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> "RankAdaptive":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def history_as_dicts(self) -> list[dict[str, Any]]:
        return [entry.to_dict() for entry in self.history]

    def save_history(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.history_as_dicts(), indent=1))

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (not the history), so a resumed run prunes the same slices at the same steps."""
        state = {"schedule": self.settings.schedule, "step": self.step, "stage": self.stage,
                 "switch_step": self.switch_step, "initial_tt_params": self.initial_tt_params,
                 "zeroed": dict(self.zeroed)}
        if self.settings.schedule == BUDGET:
            state.update(elapsed_seconds=self.elapsed_seconds(), next_prune=self._next_prune,
                         importance=self.importance.state_dict())
        else:
            state["plateau"] = (None if self._plateau is None
                                else {"best": self._plateau.best, "since": self._plateau.since})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("schedule", COMERA)  # checkpoints from before the budget schedule are CoMERA's
        if saved != self.settings.schedule:
            raise ValueError(f"RankAdaptive: the checkpoint is of schedule={saved!r}, this hook runs "
                             f"schedule={self.settings.schedule!r}; build it with the checkpoint's settings")
        self.step, self.stage, self.switch_step = state["step"], state["stage"], state["switch_step"]
        self.initial_tt_params = state["initial_tt_params"]
        self.zeroed = dict(state.get("zeroed", {}))
        if self.settings.schedule == BUDGET:
            self.schedule = self._make_schedule()
            self._elapsed_before, self._clock_start = state["elapsed_seconds"], None
            self._next_prune = state["next_prune"]
            self.importance.load_state_dict(state["importance"])
        elif self._plateau is not None and state.get("plateau") is not None:
            self._plateau.best, self._plateau.since = state["plateau"]["best"], state["plateau"]["since"]

    # -- hooks ---------------------------------------------------------------------------------------------------

    def _gates(self) -> list[Tensor]:
        return [g for m in self.matrices for g in m.tt.gates]

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _update_stage(self, loss: float | None) -> None:
        """CoMERA: early → late at ``late_start_step`` or on a plateau of the observed loss; never back."""
        if self.stage == LATE or not self.settings.has_target:
            return
        plateaued = self._plateau is not None and loss is not None and self._plateau.update(loss)
        start = self.settings.late_start_step
        if plateaued or (start is not None and self.step >= start):
            self.stage, self.switch_step = LATE, self.step

    def _late_lambda(self, loss: float | None) -> float:
        if self.settings.target_loss is not None and loss is None:
            raise RuntimeError("RankAdaptive: target_loss is set, so call hook.observe(loss) before every "
                               "optimizer.step() in the late stage")
        return achievement_lambda(loss, self.settings.target_loss, self.live_tt_params(), self.target_size)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if closure is not None:
            raise RuntimeError("RankAdaptive: optimizer.step(closure) is not supported; the gradients must exist "
                               "before step() (call backward first)")
        loss, self._pending_loss = self._pending_loss, None
        self._step_loss, self._step_lam = loss, None
        s = self.settings
        if s.schedule == BUDGET:
            if self._clock_start is None:
                self._clock_start = self._clock()
            self.importance.update([m for m in self.matrices if m.shrinkable])
            return
        self._update_stage(loss)
        if self.stage == EARLY:
            add_gate_penalty_(self._gates(), s.l1_weight, s.threshold, s.reduction)
        else:
            self._step_lam = lam = self._late_lambda(loss)
            scale_grads_(self._params(), (1.0 - lam) + s.late_loss_weight)
            add_gate_penalty_(self._gates(), lam + s.late_size_weight, s.threshold, s.reduction)

    def _post_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        s = self.settings
        records, budget = [], None
        if s.schedule == BUDGET:
            progress = self.progress()
            if self.distributed is not None and s.budget_seconds is not None:  # rank 0's clock decides
                progress = self.distributed.value(progress, self._device())
            budget, self.stage = self.schedule.budget(progress), self.schedule.phase(progress)
            points, due = self.schedule.prune_points(), self._next_prune
            while due < len(points) and progress >= points[due] - 1e-9:
                due += 1
            if due > self._next_prune:
                self._next_prune = due
                records = self.prune_to(budget)
        elif s.prune_every is not None and self.step % s.prune_every == 0:
            records = self.prune()
        if records or (s.history_every is not None and self.step % s.history_every == 0):
            self.history.append(self._entry(records, budget))

    def _entry(self, records: Sequence[ShrinkRecord], budget: float | None) -> HistoryEntry:
        counts = _live_counts(self.matrices, self.settings.threshold)
        ranks = {m.name: m.tt.ranks for m in self.matrices}
        live = {m.name: (1, *c, 1) for m, c in zip(self.matrices, counts)}
        live_params = sum(params_at_ranks(m.tt, c) for m, c in zip(self.matrices, counts))
        dense = sum(m.tt.layout.dense_params for m in self.matrices)
        return HistoryEntry(self.step, self.stage, self._step_loss, self._step_lam, ranks, live, self.tt_params(),
                            live_params, dense, tuple(r.name for r in records),
                            tuple(r.name for r in records if r.zeroed), time.perf_counter() - self._start, budget)
