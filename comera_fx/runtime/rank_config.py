"""What ``RankAdaptive`` does, as one small frozen dataclass per schedule (data; the hook acts on it):
``BudgetConfig`` (the TT size follows a known schedule to a target by a horizon) and ``CoMERAConfig`` (CoMERA's ℓ1
pull on the gates and its late stage). The class is the schedule; defaults sit on the fields.

A size target is spelled as everywhere else in comera_fx: ``size_target`` is TT parameters (an int) or a fraction
of the dense size of the TT layers (a float in (0, 1]), as ``TensorizeConfig.size_target`` and
``distill_(size_target=...)``. ``keep_fraction`` is the other way to say it: a fraction of the TT size the hook
finds at construction.

``to_dict`` / ``config_from_dict`` serialise a config for logs and checkpoints; the dict carries the schedule's name.
``config_from_dict`` also reads the dicts of the single config these two replaced (``RankConfig.to_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..tt.inventory import DEFAULT_GATE_THRESHOLD

BUDGET, COMERA = "budget", "comera"


def _check(cls: str, name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{cls}.{name} must be {what}; got {value!r}")


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _ScheduleConfig:
    """What both configs share: the size target's checks, ``to_dict``, ``replace``."""

    schedule: ClassVar[str]
    size_target: int | float | None
    keep_fraction: float | None
    threshold: float

    def _check(self, name: str, ok: bool, what: str) -> None:
        _check(type(self).__name__, name, getattr(self, name), ok, what)

    def _check_target(self) -> None:
        target, keep = self.size_target, self.keep_fraction
        self._check(
            "size_target",
            target is None or _is_int(target, 0) or (isinstance(target, float) and 0 < target <= 1),
            "an int >= 0 (TT parameters), a float in (0, 1] (fraction of the TT layers' dense size) or None",
        )
        self._check("keep_fraction", keep is None or (_is_number(keep) and 0 < keep <= 1), "a float in (0, 1] or None")
        _check(
            type(self).__name__,
            "size_target / keep_fraction",
            (target, keep),
            target is None or keep is None,
            "given at most one of them",
        )
        self._check("threshold", _is_number(self.threshold) and self.threshold >= 0, "a float >= 0")

    @property
    def has_target(self) -> bool:
        return self.size_target is not None or self.keep_fraction is not None

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict with the schedule's name, for logs and checkpoints; ``config_from_dict`` inverts it."""
        return {"schedule": self.schedule, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclass(frozen=True)
class BudgetConfig(_ScheduleConfig):
    """The budget schedule: the live TT size stays put for ``warmup_fraction`` of the horizon, decays cubically to
    the target by 1 − ``final_fraction``, then stays there; it is cut to the scheduled size at ``prunes`` evenly
    spaced points of the decay, each cut removing the slices of least importance across all layers
    (docs/rank_adaptive.md).

    Args:
        size_target: where the TT size goes: TT parameters (cores + gates) as an int, or a float in (0, 1], that
            fraction of the dense size of the model's TT layers. Exactly one of ``size_target`` / ``keep_fraction``.
        keep_fraction: the target as a fraction in (0, 1] of the TT size at construction (a checkpoint keeps that
            reference size).
        total_steps / budget_seconds: the horizon (optimizer steps, or wall clock); one of them. ``RankAdaptive``
            refuses a config without one; ``RankAdaptiveCallback`` fills in the Trainer's ``max_steps``.
        warmup_fraction, final_fraction, prunes: the schedule's shape.
        importance_beta: the EMA factor of the slices' importance (|g ⊙ ∂L/∂g|).
        min_rank: every bond keeps at least this many slices, except in layers whose importance is below
            ``rank0_below`` × the mean layer importance: those may go to rank 0.
        shrink_slack: an override of how prunes change stored shapes. None (default): chosen by how the model runs
            — compiled (``RankAdaptive.compiled_as``), prunes round in place, zero slices past the live ranks, and the
            last prune point shrinks physically (one recompile in the run); eagerly, every prune shrinks physically.
            A float >= 1: keep the stored widths while the stored TT size stays within ``shrink_slack`` × the live
            size (1.0: shrink physically at every prune, compiled or not) (docs/rank_adaptive.md, "Under
            torch.compile").
        same_shape_blocks: when the cores shrink physically, the same matrix of every repeated block (names equal up
            to the block index, same modes) is stored at one width per bond, the widest live rank among them, the
            narrower ones holding zero slices past their live ranks, so regionally compiled blocks keep one shape
            and recompile one graph instead of one per block. None (default): on whenever the model runs compiled
            (regionally, one graph for all blocks; whole, the blocks' kernels are one code that Inductor compiles
            once), off eagerly; True / False: always / never.
        threshold: a gate entry with |g| <= threshold is dead.
    """

    schedule: ClassVar[str] = BUDGET
    size_target: int | float | None = None
    keep_fraction: float | None = None
    total_steps: int | None = None
    budget_seconds: float | None = None
    warmup_fraction: float = 0.1
    final_fraction: float = 0.2
    prunes: int = 10
    importance_beta: float = 0.85
    min_rank: int = 1
    rank0_below: float = 0.01
    shrink_slack: float | None = None
    same_shape_blocks: bool | None = None
    threshold: float = DEFAULT_GATE_THRESHOLD

    def __post_init__(self) -> None:
        self._check_target()
        if not self.has_target:
            raise ValueError(
                "BudgetConfig needs a size target: pass size_target= (TT parameters, or a fraction of the dense "
                "size) or keep_fraction= (a fraction of the TT size now), with total_steps= or budget_seconds=; "
                "CoMERAConfig() runs CoMERA's ℓ1 penalty, which works without a target"
            )
        _check(
            "BudgetConfig",
            "total_steps / budget_seconds",
            (self.total_steps, self.budget_seconds),
            self.total_steps is None or self.budget_seconds is None,
            "given at most one of them",
        )
        self._check("total_steps", self.total_steps is None or _is_int(self.total_steps, 1), "an int >= 1 or None")
        seconds = self.budget_seconds
        self._check("budget_seconds", seconds is None or (_is_number(seconds) and seconds > 0), "a number > 0 or None")
        for name in ("warmup_fraction", "final_fraction", "importance_beta"):
            self._check(name, _is_number(getattr(self, name)) and 0 <= getattr(self, name) <= 1, "a float in [0, 1]")
        self._check("min_rank", _is_int(self.min_rank, 0), "an int >= 0")
        self._check("rank0_below", _is_number(self.rank0_below) and self.rank0_below >= 0, "a float >= 0")
        slack = self.shrink_slack
        self._check("shrink_slack", slack is None or (_is_number(slack) and slack >= 1), "a number >= 1 or None")
        self._check("same_shape_blocks", self.same_shape_blocks in (None, True, False), "True, False or None")

    @property
    def has_horizon(self) -> bool:
        return self.total_steps is not None or self.budget_seconds is not None

    def check_horizon(self) -> None:
        """ValueError unless a horizon is given (``RankAdaptive`` needs it; ``RankAdaptiveCallback`` fills it in)."""
        if not self.has_horizon:
            raise ValueError(
                "BudgetConfig: a size target needs a horizon to reach it by: pass total_steps= (the optimizer "
                "steps of the run) or budget_seconds= (its wall clock); the size then reaches the target at "
                "1 - final_fraction of the horizon"
            )


@dataclass(frozen=True)
class CoMERAConfig(_ScheduleConfig):
    """CoMERA's two-stage scalarization: ``l1_weight`` · ∂R/∂g is added to the gates' gradients (R = mean |live gate
    entries|; ``reduction="sum"``: the sum). The late stage (needs a target, and ``late_start_step`` or
    ``plateau_patience``; optional ``target_loss``) scales every gradient by (1 − λ) + ``late_loss_weight`` and adds
    (λ + ``late_size_weight``) · ∂R/∂g. Every ``prune_every`` steps the dead slices (|g| <= ``threshold``) are
    removed; ``prune_every=None``: never (call ``RankAdaptive.prune()`` yourself).

    Args:
        size_target / keep_fraction: the late stage's size target, as in ``BudgetConfig``; at most one of them.
        late_start_step / plateau_patience, plateau_tol: the late stage starts at that step, or when the observed
            loss has not improved by ``plateau_tol`` for ``plateau_patience`` steps (needs a target).
        target_loss: the loss the late stage's λ aims at (then ``hook.observe(loss)`` every step).
    """

    schedule: ClassVar[str] = COMERA
    l1_weight: float = 0.01
    prune_every: int | None = 100
    target_loss: float | None = None
    size_target: int | float | None = None
    keep_fraction: float | None = None
    late_start_step: int | None = None
    plateau_patience: int | None = None
    plateau_tol: float = 1e-3
    reduction: str = "mean"
    late_loss_weight: float = 0.1
    late_size_weight: float = 0.0
    threshold: float = DEFAULT_GATE_THRESHOLD

    def __post_init__(self) -> None:
        self._check_target()
        for name in ("l1_weight", "plateau_tol", "late_loss_weight", "late_size_weight"):
            self._check(name, _is_number(getattr(self, name)) and getattr(self, name) >= 0, "a float >= 0")
        for name in ("prune_every", "plateau_patience"):
            value = getattr(self, name)
            self._check(name, value is None or _is_int(value, 1), "an int >= 1 or None")
        start = self.late_start_step
        self._check("late_start_step", start is None or _is_int(start, 0), "an int >= 0 or None")
        self._check("reduction", self.reduction in ("mean", "sum"), "'mean' or 'sum'")
        has_switch = self.late_start_step is not None or self.plateau_patience is not None
        _check(
            "CoMERAConfig",
            "late_start_step / plateau_patience",
            (self.late_start_step, self.plateau_patience),
            not has_switch or self.has_target,
            "used with size_target or keep_fraction (the late stage needs a size target)",
        )
        if self.has_target and not has_switch:
            raise ValueError(
                "CoMERAConfig: a size target is pursued only in the late stage, which starts at late_start_step= "
                "or on a plateau (plateau_patience=); give one of them, or use BudgetConfig(..., total_steps= / "
                "budget_seconds=)"
            )


ScheduleConfig = BudgetConfig | CoMERAConfig
CONFIGS: dict[str, type[BudgetConfig] | type[CoMERAConfig]] = {BUDGET: BudgetConfig, COMERA: CoMERAConfig}


def config_from_dict(data: dict[str, Any]) -> ScheduleConfig:
    """The config a ``to_dict()`` wrote (its ``"schedule"`` picks the class). Also reads the dicts of ``RankConfig``,
    the single config before these: the other schedule's fields (all None there) are dropped, and a None where the
    field now has a default meant that default (except ``prune_every``, whose None means "never")."""
    data = dict(data)
    name = data.pop("schedule", BUDGET)
    if name not in CONFIGS:
        raise ValueError(f"unknown schedule {name!r} in a rank config dict; known: {sorted(CONFIGS)}")
    cls = CONFIGS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    other = {f.name for c in CONFIGS.values() if c is not cls for f in dataclasses.fields(c)} - set(fields)
    wrong = sorted(k for k in set(data) - set(fields) if k not in other or data[k] is not None)
    if wrong:
        raise ValueError(f"unknown {cls.__name__} fields {wrong}")
    kept = {k: v for k, v in data.items() if k in fields and (v is not None or k == "prune_every")}
    return cls(**kept)


def check_schedule_config(call: str, value: Any) -> None:
    """TypeError at the call unless ``value`` is a ``BudgetConfig`` or a ``CoMERAConfig``, naming both (a dict's error
    spells the config it meant)."""
    if isinstance(value, (BudgetConfig, CoMERAConfig)):
        return
    got = "no config" if value is None else f"{type(value).__name__} {value!r}"
    fix = (
        "BudgetConfig(keep_fraction=0.5, total_steps=...) (the TT size follows a schedule to half its size now) "
        "or CoMERAConfig() (CoMERA's ℓ1 pull on the gates)"
    )
    if isinstance(value, Mapping):
        options = {k: v for k, v in value.items() if k != "schedule"}
        cls = CoMERAConfig if value.get("schedule") == COMERA else BudgetConfig
        spelled = [f"{k}={v!r}" for k, v in options.items()]
        if cls is BudgetConfig and "total_steps" not in options and "budget_seconds" not in options:
            spelled.append("total_steps=...")
        fix = f"{cls.__name__}({', '.join(spelled)})"
    raise TypeError(f"{call} takes a BudgetConfig or a CoMERAConfig, not {got}; pass {fix} (docs/rank_adaptive.md)")
