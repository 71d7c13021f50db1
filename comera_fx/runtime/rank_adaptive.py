"""Rank-adaptive training of TT layers: ranks shrink during training towards a size target, and the removed rank
slices are taken out physically (cores, gates and the optimizer's state shrink together).

``RankAdaptive`` attaches to an existing optimizer through its step hooks, so the training loop stays as it is.
Two schedules (docs/rank_adaptive.md):

* ``BudgetConfig`` — the live TT size follows a known schedule
  (``schedule.BudgetSchedule``: warm-up, cubic decay, final window) from its size now to ``size_target`` /
  ``keep_fraction`` by the end of a horizon (``total_steps`` or ``budget_seconds``); at each of a few prune
  points the slices of least importance (``importance``: the bond's smoothed |g ⊙ ∂L/∂g| split by its singular
  values) are removed across all layers at once (``schedule.allocate``), by TT rounding
  (``shrink.round_to_ranks_``). Gradients are never touched.
* ``CoMERAConfig`` — CoMERA's two-stage scalarization (``comera``): an ℓ1 pull on the gates, a
  late stage that rescales the task gradient by λ, and removal of the dead slices (|g| <= threshold) every
  ``prune_every``.

The only extra call in the loop is ``hook.observe(loss)`` before ``optimizer.step()``, when the CoMERA schedule
needs the loss (a target loss, plateau detection) or for the loss column of the history.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..tt.inventory import (
    MatrixEntry,
    live_count_tensor,
    live_counts,
    live_counts_later,
    physical_params,
    tt_matrices,
)
from .distributed import RankSync
from .comera import (
    EARLY,
    LATE,
    PlateauDetector,
    achievement_lambda,
    achievement_lambda_on_device,
    add_gate_penalty_,
    scale_grads_,
    tt_params_at_counts,
)
from ..tt.plan.autograd import kernel_rank
from .compiled import ShapePolicy
from .history import HistoryEntry, RankSummary, materialized
from .importance import BondSensitivity
from .prune_plan import plan_prune
from .rank_config import BUDGET, COMERA, CONFIGS, ScheduleConfig, check_schedule_config
from .schedule import BudgetSchedule
from .shrink import (
    ShrinkRecord,
    compact_,
    live_params,
    params_at_ranks,
    remove_slices_,
    resize_bonds_,
    round_to_ranks_,
    same_shape_widths,
    shrink_,
)

__all__ = ["RankAdaptive"]

# ------------------------------------------------------------------------------------------------------ settings


#: Under ``shrink_slack`` the schedule's last prune point compacts the stored cores (shapes change: one recompile)
#: only if that frees at least this share of the stored TT size. With ``same_shape_blocks`` one block that keeps its
#: ranks holds the whole group at its widths, so the compaction can free almost nothing: 3 % of the demo's stored
#: size, for a recompile that cost about 9 s of its 600 s budget (benchmarks/RESULTS.md, issue 30 item 4).
#: ``compact()`` compacts regardless.
MIN_FINAL_COMPACTION = 0.1

# ------------------------------------------------------------------------------------------------------- the hook


class RankAdaptive:
    """Rank adaptation of every TT layer of ``model``, driven by ``optimizer``'s step hooks.

    Build it after the optimizer (whose parameters must include the TT gates), with the config of a schedule
    (``BudgetConfig`` or ``CoMERAConfig``: the size target, the horizon and the schedule's knobs, their defaults on
    the fields); then per step::

        hook = RankAdaptive(model, optimizer, BudgetConfig(size_target=0.1, total_steps=n))
        loss.backward(); hook.observe(loss); optimizer.step(); optimizer.zero_grad()

    ``self.settings`` is that config. **Budget schedule** (``BudgetConfig``): the TT size follows
    ``schedule.BudgetSchedule`` from its size now to the target by the end of the horizon (``total_steps``, or
    ``budget_seconds`` on ``clock``, default ``time.perf_counter``, counted from the first step); at each prune
    point the slices with the least importance per parameter freed are removed across all layers; a layer may go
    to rank 0 (its bias only; ``summary()`` says why). Gradients are not modified. **CoMERA** (``CoMERAConfig``):
    an ℓ1 pull on the gates, a late stage that rescales the gradients by λ (``achievement_lambda``), and removal of
    the dead slices (|g| <= ``threshold``) every ``prune_every`` steps.

    Removal is physical, optimizer state included. ``history`` holds one ``HistoryEntry`` per ``history_every``
    steps and per pruning. The parameters of shrunk matrices are new objects: read ``model.parameters()`` afresh
    after a pruning step (do not keep lists of them across steps).

    **Under torch.compile** (budget schedule) the hook compiles once by itself: when the model runs compiled
    (``runtime.compiled``: comera_fx's backend saw its parameters, ``compile`` / ``compile_regions`` marked it, or a
    stock ``torch.compile`` shows on the module tree it was handed; ``compiled_as`` says which), a prune writes the
    rounded cores into the stored ones in place, zero past the new ranks (the zero slices get zero gradients), so
    the compiled graphs run on without a recompile; the schedule's last prune point shrinks every matrix physically
    at once (one recompile) if that frees at least ``MIN_FINAL_COMPACTION`` (10 %) of the stored size and narrows
    some GEMM (``compaction_keeps_gemm_widths``: on the CPU, cores stored at ranks <= 16 run the same padded GEMMs
    at any live rank, so no recompile there). Repeated blocks also get one shape per matrix role at that shrink
    (``same_shape_blocks``): one graph serves regional blocks, and a whole-model graph's blocks share kernel code
    that Inductor compiles once. Eagerly every prune shrinks physically. Sizes,
    ranks and the history count the live ranks throughout. Overrides: ``BudgetConfig.shrink_slack`` (a float >= 1:
    shrink physically whenever the stored size would exceed it × the live size; 1.0: at every prune, compiled or
    not) and ``same_shape_blocks`` (True / False). ``shrink_eagerly()`` after training stores every matrix at its
    own live ranks.

    **Distributed** (docs/distributed.md): give it the ``DistributedDataParallel`` model. Every prune is decided on
    rank 0 and broadcast, the observed loss is averaged over the ranks, and after a prune the wrapper is rebuilt:
    call the model through ``hook.model`` (the old wrapper raises). FSDP2 models are refused (NotImplementedError).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ScheduleConfig | None = None,  # required: None gets a TypeError naming the two configs
        *,
        clock: Callable[[], float] | None = None,
        history_every: int | None = 1,
    ):
        check_schedule_config("RankAdaptive(model, optimizer, config)", config)
        self.settings = s = config
        if s.schedule == BUDGET:
            s.check_horizon()
        if clock is not None and (s.schedule != BUDGET or not callable(clock)):
            raise ValueError(
                f"RankAdaptive: clock= times the budget schedule's budget_seconds: a callable "
                f"returning seconds, with a BudgetConfig; got {clock!r} with a {type(s).__name__}"
            )
        if not (
            history_every is None
            or (isinstance(history_every, int) and not isinstance(history_every, bool) and history_every >= 1)
        ):
            raise ValueError(f"RankAdaptive: history_every must be an int >= 1 or None; got {history_every!r}")
        self.history_every = history_every
        # None: chosen by how the model runs (compiled_as); CoMERA's prunes always shrink physically
        self.shrink_slack = s.shrink_slack if s.schedule == BUDGET else None
        self.same_shape_blocks = s.same_shape_blocks if s.schedule == BUDGET else None
        # Under torch.distributed (runtime.distributed): decisions agreed across ranks, DDP rebuilt after a prune
        self.distributed, module = RankSync.for_model(model)
        self.model, self.optimizer = model, optimizer  # self.model: the current DDP wrapper after a prune
        self.module = module
        self.matrices = tt_matrices(module)
        self._check_model()
        self.shapes = ShapePolicy([m.tt for m in self.matrices], model)  # model: stock compiles show on it
        self.initial_tt_params = sum(live_params(m.tt) for m in self.matrices)
        self.dense_params = sum(m.tt.layout.dense_params for m in self.matrices)  # what a float size_target scales
        self.step = 0
        self._history: list = []  # HistoryEntry, or a function giving it (gate counts still on the device)
        self.zeroed: dict[str, str] = {}  # layer -> why it went to rank 0
        self._start = time.perf_counter()
        # the observed loss and the late stage's λ: tensors kept on the device, read when the history is
        self._pending_loss: Tensor | float | None = None
        self._step_loss: Tensor | float | None = None
        self._step_lam: Tensor | float | None = None
        if s.schedule == BUDGET:
            self.schedule: BudgetSchedule | None = self._make_schedule()
            self.importance: BondSensitivity | None = BondSensitivity(s.importance_beta)
            self.stage = self.schedule.phase(0.0)
            self._clock = clock or time.perf_counter
            self._elapsed_before, self._clock_start = 0.0, None
            self._next_prune = 0
            self._warned_floor = False
        else:
            self.schedule, self.importance = None, None
            self.stage = EARLY
        self.switch_step: int | None = None
        self._plateau = (
            PlateauDetector(s.plateau_patience, s.plateau_tol)
            if s.schedule == COMERA and s.plateau_patience is not None
            else None
        )
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def _make_schedule(self) -> BudgetSchedule:
        s = self.settings
        return BudgetSchedule(self.initial_tt_params, self.target_size, s.warmup_fraction, s.final_fraction, s.prunes)

    def _check_model(self) -> None:
        if not self.matrices:
            raise ValueError("RankAdaptive: the model has no TTMatrix; run comera_fx.tensorize_(model, ...) first")
        optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [m.name for m in self.matrices if any(id(g) not in optimized for g in m.tt.gates)]
        if missing:
            raise ValueError(
                f"RankAdaptive: the optimizer does not hold the gates of {missing}; build it after "
                f"tensorize_ (e.g. from comera_fx.runtime.param_groups(model))"
            )
        frozen = [m.name for m in self.matrices if not m.shrinkable]
        if frozen and self.settings.schedule == BUDGET:
            warnings.warn(
                f"RankAdaptive: {frozen} come from the graph pass, whose ranks are constants of the graph; "
                f"their slices are never removed, so the other TT matrices carry the whole size cut",
                stacklevel=3,
            )
        elif frozen and self.settings.prune_every is not None:
            warnings.warn(
                f"RankAdaptive: {frozen} come from the graph pass, whose ranks are constants of the graph; "
                f"their gates are penalised but their slices are never removed",
                stacklevel=3,
            )

    # -- public API ----------------------------------------------------------------------------------------------

    @property
    def target_size(self) -> float | None:
        """S_t in TT parameters (cores + gates), or None without a target."""
        s = self.settings
        if s.keep_fraction is not None:
            return s.keep_fraction * self.initial_tt_params
        if isinstance(s.size_target, float):
            return s.size_target * self.dense_params
        return None if s.size_target is None else float(s.size_target)

    def observe(self, loss: float | Tensor) -> None:
        """Pass this step's loss; call once per step, before ``optimizer.step()`` (it applies to that step).
        A tensor is kept where it is, not read: the history reads it when asked, CoMERA's late-stage λ uses it on
        the device. Only CoMERA's plateau detection (``plateau_patience``) reads it every step (one
        synchronisation): its stage switch is a decision on the host."""
        self._pending_loss = loss.detach() if torch.is_tensor(loss) else float(loss)
        if self.distributed is not None:  # CoMERA's λ and plateau read it: the same value on every rank
            self._pending_loss = self.distributed.mean(self._pending_loss, self._device())

    def live_tt_params(self) -> int:
        """TT parameters (cores + gates) at the live ranks now: what is stored, unless ``shrink_slack`` holds
        matrices wider (``stored_tt_params``)."""
        return sum(live_params(m.tt) for m in self.matrices)

    def stored_tt_params(self) -> int:
        """TT parameters as stored now, zero slices of matrices held wider (``shrink_slack``) included."""
        return sum(physical_params(m.tt) for m in self.matrices)

    def tt_params_without_dead(self) -> int:
        """TT parameters the model would hold if every dead slice (|g| <= threshold) were removed now (the S of
        CoMERA's late stage)."""
        counts = live_counts([m.tt for m in self.matrices], self.settings.threshold)
        return sum(params_at_ranks(m.tt, c) for m, c in zip(self.matrices, counts))

    @property
    def compiled_as(self) -> str | None:
        """How the model runs, as the shape policy sees it: None (eagerly), ``"whole"`` or ``"regional"``
        (``runtime.compiled``); kept for the run once found, ended by ``shrink_eagerly()``."""
        return self.shapes.compiled_as

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
        _ = self.shapes.compiled_as  # looked up before any parameter is replaced (the backend knows the old ones)
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

    def prune_to(self, size: float, *, compact: bool | None = None) -> list[ShrinkRecord]:
        """Cut the TT size to <= ``size`` (or until every bond is at its floor): rank the directions of every
        bond of every layer jointly by importance per parameter freed (``importance.slice_importance``,
        ``schedule.allocate``) and TT-round each reduced matrix to its new ranks (``shrink.round_to_ranks_``).
        The budget schedule calls this at its prune points. ``compact``: shrink every matrix physically (True),
        or keep the stored widths (False); None decides by ``shrink_slack``, or when it is None by how the model runs
        (compiled: in place; eagerly: physically)."""
        return self._prune_to(size, compact)

    def _prune_to(self, size: float, compact: bool | None, final: bool = False) -> list[ShrinkRecord]:
        """``prune_to``; ``final``: the schedule's last prune point, where matrices held wider are compacted if
        that frees at least ``MIN_FINAL_COMPACTION`` of the stored size."""
        if self.importance is None:
            raise RuntimeError(
                "RankAdaptive: prune_to() ranks slices by importance, which only the budget "
                "schedule (BudgetConfig) measures; with a CoMERAConfig use prune()"
            )
        if self.distributed is not None:
            self.distributed.check()
        _ = self.shapes.compiled_as  # looked up before any parameter is replaced (the backend knows the old ones)
        s = self.settings
        entries = [m for m in self.matrices if m.shrinkable and not m.tt.is_zero]
        unseen = self.importance.unseen(entries)  # e.g. experts no token reached since the last prune: kept as is
        if len(unseen) < len(entries):
            entries = [m for m in entries if m.name not in unseen]
        self.importance.start_window()
        fixed = self.live_tt_params() - sum(live_params(m.tt) for m in entries)
        sensitivity, layer_importance = self.importance.values(entries)
        decided, reasons = plan_prune(entries, sensitivity, layer_importance, s, size, fixed)
        records = []
        if self.distributed is not None:  # rank 0's ranks on every rank
            flat = iter(self.distributed.ints([r for ranks in decided for r in ranks], self._device()))
            decided = [[next(flat) for _ in ranks] for ranks in decided]
        live_after = fixed + sum(params_at_ranks(m.tt, r) for m, r in zip(entries, decided))
        in_place = not self._compacts(compact, live_after)
        for m, ranks in zip(entries, decided):
            record = round_to_ranks_(m.tt, ranks, optimizer=self.optimizer, name=m.name, in_place=in_place)
            if record is not None:
                self._after_shrink(record, reasons.get(m.name, ""))
                records.append(record)
        compact_now = not in_place or (
            final
            and self._compaction_frees() >= MIN_FINAL_COMPACTION * self.stored_tt_params()
            and not (self.shapes.compiled_as is not None and self.compaction_keeps_gemm_widths())
        )
        compacted = self._compact_all() if compact_now else []
        if compact_now and (records or compacted):
            self.shapes.shrunk_physically(self.shrink_slack, self.same_shape_blocks)
        if self.live_tt_params() > size + 0.5 and not self._warned_floor:
            self._warned_floor = True
            warnings.warn(
                f"RankAdaptive: the scheduled size {size:,.0f} is below what the rank floors allow "
                f"(min_rank={s.min_rank}); the TT size stays at {self.live_tt_params():,}. Lower min_rank or "
                f"raise the target",
                stacklevel=2,
            )
        self._after_prune(records + compacted)
        return records

    def compact(self) -> list[ShrinkRecord]:
        """Shrink every matrix held wider (``shrink_slack``) to its live ranks now, physically (the schedule does it
        at its last prune point; a run stopped before that point keeps the zero slices until this call). With
        ``same_shape_blocks`` the same matrix of repeated blocks goes to the group's widest live rank instead."""
        if self.distributed is not None:
            self.distributed.check()
        records = self._compact_all()
        self._after_prune(records)
        return records

    def compaction_keeps_gemm_widths(self) -> bool:
        """Would compacting leave every batch-dependent GEMM at its width? True where each shrinkable matrix's stored
        internal ranks all pad to its device's smallest kernel width (``tt.plan.autograd.kernel_rank``: on the CPU a
        planned product runs its two-factor bond at 16 or more, so cores stored at ranks <= 16 multiply the same
        b × 16 GEMMs at any live rank). A compiled model then skips the last prune point's compaction: its
        recompile would buy no faster step (the demo: 634–640 TT steps in 120 s without it, compiled; 587 with
        it, back to eager; benchmarks/history/2026-12-07-session12.md). Eagerly nothing changes (no recompile)."""
        for m in self.matrices:
            if not m.shrinkable:
                continue
            if max(m.tt.layout.internal_ranks, default=1) > kernel_rank(1, m.tt.device.type):
                return False
        return True

    def shrink_eagerly(self) -> list[ShrinkRecord]:
        """For a run that stops compiling (or never started): from now on every prune shrinks each matrix to its own
        live ranks (``shrink_slack`` and ``same_shape_blocks`` off: they only save recompiles, and eagerly the
        wider stored cores cost time every step); matrices held wider shrink now."""
        self.shrink_slack, self.same_shape_blocks, self.shapes.eager = None, False, True
        return self.compact()

    def _compaction_widths(self) -> tuple[list[MatrixEntry], dict[str, tuple[int, ...]]]:
        """The shrinkable matrices, and the stored widths a compaction gives those of a same-shape group (the rest
        go to their own live ranks)."""
        shrinkable = [m for m in self.matrices if m.shrinkable]
        same = self.shapes.same_shape_blocks(self.same_shape_blocks)
        widths = same_shape_widths([(m.name, m.tt) for m in shrinkable]) if same else {}
        return shrinkable, widths

    def _compact_all(self) -> list[ShrinkRecord]:
        shrinkable, widths = self._compaction_widths()
        records = []
        for m in shrinkable:
            if m.name in widths:
                record = resize_bonds_(m.tt, widths[m.name], optimizer=self.optimizer, name=m.name)
            else:
                record = compact_(m.tt, optimizer=self.optimizer, name=m.name)
            if record is not None:
                records.append(record)
        return records

    def _compaction_frees(self) -> int:
        """Stored TT parameters that ``compact()`` would free now (to the group widths with ``same_shape_blocks``)."""
        shrinkable, widths = self._compaction_widths()
        return sum(
            physical_params(m.tt)
            - params_at_ranks(m.tt, widths.get(m.name) or m.tt.live_internal_ranks or m.tt.layout.internal_ranks)
            for m in shrinkable
        )

    def _compacts(self, compact: bool | None, live_after: int) -> bool:
        """Does this prune shrink physically? When asked, else as ``ShapePolicy.compacts`` decides."""
        if compact is not None:
            return compact
        return self.shapes.compacts(self.shrink_slack, self.stored_tt_params(), live_after)

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
        return RankSummary(
            self.settings.schedule,
            self.step,
            self.stage,
            self.progress(),
            self.initial_tt_params,
            self.target_size,
            self.live_tt_params(),
            {m.name: m.tt.ranks for m in self.matrices},
            dict(self.zeroed),
        )

    def remove(self) -> None:
        """Detach from the optimizer; later steps are plain optimizer steps. Safe to call twice."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> "RankAdaptive":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def history(self) -> list[HistoryEntry]:
        """One entry per ``history_every`` steps and per pruning; the gate counts of the steps between prunes are
        read from the device here, when asked, not in the step (no host synchronisation per step)."""
        return materialized(self._history)

    def history_as_dicts(self) -> list[dict[str, Any]]:
        return [entry.to_dict() for entry in self.history]

    def save_history(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.history_as_dicts(), indent=1))

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (not the history), so a resumed run prunes the same slices at the same steps."""
        state = {
            "schedule": self.settings.schedule,
            "step": self.step,
            "stage": self.stage,
            "switch_step": self.switch_step,
            "initial_tt_params": self.initial_tt_params,
            "zeroed": dict(self.zeroed),
            "live_ranks": {
                m.name: m.tt.live_internal_ranks for m in self.matrices if m.tt.live_internal_ranks is not None
            },
        }
        if self.settings.schedule == BUDGET:
            state.update(
                elapsed_seconds=self.elapsed_seconds(),
                next_prune=self._next_prune,
                importance=self.importance.state_dict(),
            )
        else:
            state["plateau"] = (
                None if self._plateau is None else {"best": self._plateau.best, "since": self._plateau.since}
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("schedule", COMERA)  # checkpoints from before the budget schedule are CoMERA's
        if saved != self.settings.schedule:
            wanted = CONFIGS[saved].__name__ if saved in CONFIGS else "config"
            raise ValueError(
                f"RankAdaptive: the checkpoint is of schedule={saved!r}, this hook runs "
                f"schedule={self.settings.schedule!r}; build it with the checkpoint's {wanted}"
            )
        self.step, self.stage, self.switch_step = state["step"], state["stage"], state["switch_step"]
        self.initial_tt_params = state["initial_tt_params"]
        self.zeroed = dict(state.get("zeroed", {}))
        for m in self.matrices:  # matrices held wider (shrink_slack): the model's checkpoint has the stored widths
            live = state.get("live_ranks", {}).get(m.name)
            m.tt.live_internal_ranks = None if live is None else tuple(live)
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
        plateaued = self._plateau is not None and loss is not None and self._plateau.update(float(loss))
        start = self.settings.late_start_step
        if plateaued or (start is not None and self.step >= start):
            self.stage, self.switch_step = LATE, self.step

    def _late_lambda(self, loss: Tensor | float | None) -> Tensor | float:
        """CoMERA's λ for this step: a 0-d tensor computed on the gates' device from their live counts (no host
        read)."""
        s = self.settings
        if s.target_loss is not None and loss is None:
            raise RuntimeError(
                "RankAdaptive: target_loss is set, so call hook.observe(loss) before every "
                "optimizer.step() in the late stage"
            )
        counts = live_count_tensor([m.tt for m in self.matrices], s.threshold)
        if counts is None:  # no gates at all: nothing to count on a device
            loss = None if loss is None else float(loss)
            return achievement_lambda(loss, s.target_loss, self.tt_params_without_dead(), self.target_size)
        size = tt_params_at_counts([m.tt.layout for m in self.matrices], counts)
        return achievement_lambda_on_device(loss, s.target_loss, size, self.target_size)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if closure is not None:
            raise RuntimeError(
                "RankAdaptive: optimizer.step(closure) is not supported; the gradients must exist "
                "before step() (call backward first)"
            )
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
                # compact=None: by shrink_slack, or how the model runs (and the final floor)
                records = self._prune_to(budget, None, final=due >= len(points))
        elif s.prune_every is not None and self.step % s.prune_every == 0:
            records = self.prune()
            if records:  # compiled, a recompile at every scheduled prune: warned once
                self.shapes.shrinks_at_every_prune()
        if records or (self.history_every is not None and self.step % self.history_every == 0):
            entry = self._entry(records, budget)
            self._history.append(entry() if records else entry)

    def _entry(self, records: Sequence[ShrinkRecord], budget: float | None) -> Callable[[], HistoryEntry]:
        """This step's ``HistoryEntry``, as a function: the gates are counted now, on their device, and read back
        when it is called."""
        counts = live_counts_later([m.tt for m in self.matrices], self.settings.threshold)
        names, tts = [m.name for m in self.matrices], [m.tt for m in self.matrices]
        loss, lam = self._step_loss, self._step_lam  # tensors on the device, read with the gate counts
        fixed = dict(
            step=self.step,
            stage=self.stage,
            ranks={n: tt.ranks for n, tt in zip(names, tts)},
            tt_params=self.live_tt_params(),
            dense_params=sum(tt.layout.dense_params for tt in tts),
            shrunk=tuple(r.name for r in records),
            zeroed=tuple(r.name for r in records if r.zeroed),
            wall_time=time.perf_counter() - self._start,
            budget=budget,
        )

        def entry() -> HistoryEntry:
            alive = counts()
            return HistoryEntry(
                loss=None if loss is None else float(loss),
                lam=None if lam is None else float(lam),
                gate_ranks={n: (1, *c, 1) for n, c in zip(names, alive)},
                tt_params_without_dead=sum(params_at_ranks(tt, c) for tt, c in zip(tts, alive)),
                **fixed,
            )

        return entry
