"""``RankConfig``: what ``RankAdaptive`` does, as one validated, frozen dataclass (data; the hook acts on it).

A size target is spelled as everywhere else in comera_fx: ``size_target`` is TT parameters (an int) or a fraction
of the dense size of the TT layers (a float in (0, 1]), as ``TensorizeConfig.size_target`` and
``distill_(size_target=...)``. ``keep_fraction`` is the other way to say it: a fraction of the TT size the hook
finds at construction (what ``RankAdaptive(target_ratio=...)`` meant). Options of the schedule not run are refused;
``None`` takes the running schedule's default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..tt.inventory import DEFAULT_GATE_THRESHOLD

BUDGET, COMERA = "budget", "comera"

BUDGET_DEFAULTS = {
    "warmup_fraction": 0.1,
    "final_fraction": 0.2,
    "prunes": 10,
    "importance_beta": 0.85,
    "min_rank": 1,
    "rank0_below": 0.01,
}
COMERA_DEFAULTS = {
    "l1_weight": 0.01,
    "prune_every": 100,
    "plateau_tol": 1e-3,
    "reduction": "mean",
    "late_loss_weight": 0.1,
    "late_size_weight": 0.0,
}
_ONLY = {
    BUDGET: (*BUDGET_DEFAULTS, "total_steps", "budget_seconds", "shrink_slack", "same_shape_blocks"),
    COMERA: (*COMERA_DEFAULTS, "target_loss", "late_start_step", "plateau_patience"),
}


class _Default:
    """``prune_every``'s "not given": its ``None`` already means "never prune"."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


def _check(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"RankConfig.{name} must be {what}; got {value!r}")


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RankConfig:
    """How ``RankAdaptive`` moves the ranks (docs/rank_adaptive.md).

    Args:
        schedule: ``"budget"`` (default: the TT size follows a known schedule to the target by a horizon) or
            ``"comera"`` (CoMERA's ℓ1 pull on the gates and its late stage).
        size_target: where the TT size goes: TT parameters (cores + gates) as an int, or a float in (0, 1], that
            fraction of the dense size of the model's TT layers. At most one of ``size_target`` / ``keep_fraction``.
        keep_fraction: the target as a fraction in (0, 1] of the TT size at construction (a checkpoint keeps that
            reference size).
        total_steps / budget_seconds: the budget schedule's horizon (optimizer steps, or wall clock); one of them.
        warmup_fraction (0.1), final_fraction (0.2), prunes (10), importance_beta (0.85), min_rank (1),
            rank0_below (0.01): the budget schedule's shape and pruning (see ``RankAdaptive``).
        l1_weight (0.01), prune_every (100; None: never), target_loss, late_start_step, plateau_patience,
            plateau_tol (1e-3), reduction ("mean"), late_loss_weight (0.1), late_size_weight (0): CoMERA's options.
        shrink_slack: budget schedule, an override of how prunes change stored shapes. None (default): chosen by
            how the model runs — compiled (``RankAdaptive.compiled_as``), prunes round in place, zero slices past
            the live ranks, and the last prune point shrinks physically (one recompile in the run); eagerly, every
            prune shrinks physically. A float >= 1: keep the stored widths while the stored TT size stays within
            ``shrink_slack`` × the live size (1.0: shrink physically at every prune, compiled or not)
            (docs/rank_adaptive.md, "Under torch.compile").
        same_shape_blocks: budget schedule: when the cores shrink physically, the same matrix of every repeated
            block (names equal up to the block index, same modes) is stored at one width per bond, the widest live
            rank among them, the narrower ones holding zero slices past their live ranks, so regionally compiled
            blocks keep one shape and recompile one graph instead of one per block. None (default): on when the
            blocks are compiled regionally (``compile_regions``), off otherwise; True / False: always / never.
        threshold: a gate entry with |g| <= threshold is dead.
    """

    schedule: str = BUDGET
    size_target: int | float | None = None
    keep_fraction: float | None = None
    total_steps: int | None = None
    budget_seconds: float | None = None
    warmup_fraction: float | None = None
    final_fraction: float | None = None
    prunes: int | None = None
    importance_beta: float | None = None
    min_rank: int | None = None
    rank0_below: float | None = None
    l1_weight: float | None = None
    prune_every: int | None = DEFAULT
    target_loss: float | None = None
    late_start_step: int | None = None
    plateau_patience: int | None = None
    plateau_tol: float | None = None
    reduction: str | None = None
    late_loss_weight: float | None = None
    late_size_weight: float | None = None
    shrink_slack: float | None = None
    same_shape_blocks: bool | None = None
    threshold: float = DEFAULT_GATE_THRESHOLD

    def __post_init__(self) -> None:
        _check("schedule", self.schedule, self.schedule in (BUDGET, COMERA), "'budget' (the default) or 'comera'")
        other = COMERA if self.schedule == BUDGET else BUDGET
        wrong = [n for n in _ONLY[other] if getattr(self, n) is not None and getattr(self, n) is not DEFAULT]
        if wrong:
            raise ValueError(
                f"RankConfig: {', '.join(wrong)} belong to schedule={other!r}, not to "
                f"schedule={self.schedule!r}; pass schedule={other!r} to use them, or drop them "
                f"(docs/rank_adaptive.md)"
            )
        _check("threshold", self.threshold, _is_number(self.threshold) and self.threshold >= 0, "a float >= 0")
        target = self.size_target
        _check(
            "size_target",
            target,
            target is None or _is_int(target, 0) or (isinstance(target, float) and 0 < target <= 1),
            "an int >= 0 (TT parameters), a float in (0, 1] (fraction of the TT layers' dense size) or None",
        )
        _check(
            "keep_fraction",
            self.keep_fraction,
            self.keep_fraction is None or (_is_number(self.keep_fraction) and 0 < self.keep_fraction <= 1),
            "a float in (0, 1] or None",
        )
        _check(
            "size_target / keep_fraction",
            (self.size_target, self.keep_fraction),
            self.size_target is None or self.keep_fraction is None,
            "given at most one of them",
        )
        (self._check_budget if self.schedule == BUDGET else self._check_comera)()

    def _check_budget(self) -> None:
        if not self.has_target:
            raise ValueError(
                "RankConfig: the budget schedule (the default) needs a size target: pass "
                "size_target= (TT parameters, or a fraction of the dense size) or keep_fraction= (a "
                "fraction of the TT size now), with total_steps= or budget_seconds=; "
                "schedule='comera' runs CoMERA's ℓ1 penalty, which works without a target"
            )
        if self.total_steps is None and self.budget_seconds is None:
            raise ValueError(
                "RankConfig: a size target needs a horizon to reach it by: pass total_steps= (the "
                "optimizer steps of the run) or budget_seconds= (its wall clock); the size then "
                "reaches the target at 1 - final_fraction of the horizon"
            )
        _check(
            "total_steps / budget_seconds",
            (self.total_steps, self.budget_seconds),
            self.total_steps is None or self.budget_seconds is None,
            "given at most one of them",
        )
        _check(
            "total_steps",
            self.total_steps,
            self.total_steps is None or _is_int(self.total_steps, 1),
            "an int >= 1 or None",
        )
        _check(
            "budget_seconds",
            self.budget_seconds,
            self.budget_seconds is None or (_is_number(self.budget_seconds) and self.budget_seconds > 0),
            "a number > 0 or None",
        )
        _check("min_rank", self.min_rank, self.min_rank is None or _is_int(self.min_rank, 0), "an int >= 0")
        _check(
            "shrink_slack",
            self.shrink_slack,
            self.shrink_slack is None or (_is_number(self.shrink_slack) and self.shrink_slack >= 1),
            "a number >= 1 or None",
        )
        _check(
            "same_shape_blocks",
            self.same_shape_blocks,
            self.same_shape_blocks in (None, True, False),
            "True, False or None",
        )
        _check("rank0_below", self.rank0_below, self.rank0_below is None or self.rank0_below >= 0, "a float >= 0")

    def _check_comera(self) -> None:
        _check("l1_weight", self.l1_weight, self.l1_weight is None or self.l1_weight >= 0, "a float >= 0")
        for name in ("prune_every", "plateau_patience"):
            value = getattr(self, name)
            _check(name, value, value is None or value is DEFAULT or _is_int(value, 1), "an int >= 1 or None")
        _check(
            "late_start_step",
            self.late_start_step,
            self.late_start_step is None or _is_int(self.late_start_step, 0),
            "an int >= 0 or None",
        )
        _check("reduction", self.reduction, self.reduction in (None, "mean", "sum"), "'mean' or 'sum'")
        _check("plateau_tol", self.plateau_tol, self.plateau_tol is None or self.plateau_tol >= 0, "a float >= 0")
        has_switch = self.late_start_step is not None or self.plateau_patience is not None
        _check(
            "late_start_step / plateau_patience",
            (self.late_start_step, self.plateau_patience),
            not has_switch or self.has_target,
            "used with size_target or keep_fraction (the late stage needs a size target)",
        )
        if self.has_target and not has_switch:
            raise ValueError(
                "RankConfig: with schedule='comera' a size target is pursued only in the late "
                "stage, which starts at late_start_step= or on a plateau (plateau_patience=); give "
                "one of them, or use the default budget schedule with total_steps= / "
                "budget_seconds="
            )

    @property
    def has_target(self) -> bool:
        return self.size_target is not None or self.keep_fraction is not None

    def resolved(self) -> "RankConfig":
        """This config with the running schedule's defaults filled in where ``None`` (``DEFAULT``) was given."""
        defaults = BUDGET_DEFAULTS if self.schedule == BUDGET else COMERA_DEFAULTS
        filled = {
            name: default
            for name, default in defaults.items()
            if getattr(self, name) is DEFAULT or (getattr(self, name) is None and name != "prune_every")
        }
        return dataclasses.replace(self, **filled)

    def replace(self, **changes: Any) -> "RankConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, for logs and checkpoints; ``from_dict`` inverts it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["prune_every"] is DEFAULT:
            del out["prune_every"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown RankConfig fields {sorted(unknown)}")
        return cls(**data)
