"""What ``RankAdaptive`` records: one ``HistoryEntry`` per step (or per pruning) and a ``RankSummary`` on demand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class HistoryEntry:
    """The state after one optimizer step. ``ranks``: the live ranks (``TTMatrix.ranks``); ``tt_params``: the size
    at them (cores + gates); ``gate_ranks``: per bond, the gate entries above the threshold, and
    ``tt_params_without_dead`` the size at those ranks (what the model would hold if the dead slices were removed
    now). ``stage``: "early" / "late" (CoMERA) or "warmup" / "decay" / "final" (budget schedule). ``lam`` is the
    late stage's λ (None otherwise); ``budget`` the budget schedule's scheduled size S(p) (None with CoMERA's);
    ``shrunk`` lists the layers pruned at this step and ``zeroed`` those that became entirely zero (removed: only
    their bias is left)."""

    step: int
    stage: str
    loss: float | None
    lam: float | None
    ranks: dict[str, tuple[int, ...]]
    gate_ranks: dict[str, tuple[int, ...]]
    tt_params: int
    tt_params_without_dead: int
    dense_params: int
    shrunk: tuple[str, ...]
    zeroed: tuple[str, ...]
    wall_time: float
    budget: float | None = None

    @property
    def compression(self) -> float | None:
        return self.dense_params / self.tt_params if self.tt_params else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = {k: list(v) for k, v in self.ranks.items()}
        out["gate_ranks"] = {k: list(v) for k, v in self.gate_ranks.items()}
        out["shrunk"], out["zeroed"] = list(self.shrunk), list(self.zeroed)
        out["compression"] = self.compression
        return out


def materialized(entries: list["HistoryEntry | Callable[[], HistoryEntry]"]) -> list[HistoryEntry]:
    """``entries`` with every pending entry (a function that reads its gate counts back from the device) read now,
    in place: the hook takes an entry every step without a host synchronisation, and pays it when asked."""
    for i, entry in enumerate(entries):
        if not isinstance(entry, HistoryEntry):
            entries[i] = entry()
    return entries


@dataclass(frozen=True)
class RankSummary:
    """Where the adaptation stands: sizes, ranks, and the layers removed entirely (``zeroed``: name → why)."""

    schedule: str
    step: int
    stage: str
    progress: float | None
    initial_tt_params: int
    target_tt_params: float | None
    tt_params: int
    ranks: dict[str, tuple[int, ...]]
    zeroed: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        target = "none" if self.target_tt_params is None else f"{self.target_tt_params:,.0f}"
        done = "" if self.progress is None else f", {min(self.progress, 1.0):.0%} of the horizon"
        lines = [
            f"RankAdaptive ({self.schedule}), step {self.step}, {self.stage}{done}: TT params "
            f"{self.tt_params:,} (start {self.initial_tt_params:,}, target {target})"
        ]
        lines += [f"  {name}: ranks {ranks}" for name, ranks in self.ranks.items() if name not in self.zeroed]
        lines += [f"  {name}: rank 0 (bias only) — {why}" for name, why in self.zeroed.items()]
        return "\n".join(lines)
