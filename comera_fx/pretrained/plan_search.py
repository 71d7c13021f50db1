"""Improve a format plan by measuring it built: ``search_plan``.

``choose_formats`` sums per-layer output errors, each measured with that layer alone replaced. At 16x fewer bytes
on all-MiniLM-L6-v2 the errors no longer add up: plans it made from different calibration draws tied on that sum
and trained to 0.871 or 0.883 cosine on other-source text, and the plan, not the calibration, carried the
difference (benchmarks/history/2026-12-08-session16.md). This search judges plans by what training starts from: the
whole plan built (weights rounded onto their grids) and scored with the distillation loss on a few batches.

One round: every layer may move one step along its Pareto front of the plan's candidates (bytes against the
short-list's error): up (more bytes, less error) or down. Each single move is measured in context, the plan built
once with every layer up and once with every layer down, their modules swapped in one at a time. Pairs of one move
up and one down that keep the budget are tried in the order of their predicted gain; each is kept when the measured
loss of the combined plan drops. The model passed in is read only: the search builds copies.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from .calibrate import Calibration
from .calling import default_output, eval_modes, preserved_rng
from .distill_config import DistillConfig, resolved
from .format_select import FormatChoice, pareto_front
from .formats import FormatPlan, apply_formats_
from .keep_best import BestWeights
from .match_hooks import HiddenCapture

#: pairs tried a round at most (each costs one scoring pass)
MAX_TRIES = 40
#: ``compress_`` scores plans on this many of its first calibration batches
PLAN_SEARCH_BATCHES = 4


@dataclass
class PlanSearchReport:
    """What ``search_plan`` did: the loss on its batches before and after every round, the moves kept
    (``(layer moved up, layer moved down, loss after)``), the pairs tried and the seconds spent."""

    losses: list[float] = field(default_factory=list)
    moves: list[tuple[str, str, float]] = field(default_factory=list)
    tried: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        trail = " -> ".join(f"{loss:.4g}" for loss in self.losses)
        return f"plan search: loss {trail}, {len(self.moves)} of {self.tried} pair moves kept, {self.seconds:.0f} s"


def one_step_moves(
    plan: FormatPlan,
) -> tuple[dict[str, FormatChoice], dict[str, FormatChoice]]:
    """Each layer's next candidate up (the cheapest on its Pareto front with more bytes and less error than the
    chosen one) and down (the dearest with fewer bytes)."""
    up, down = {}, {}
    for fqn, chosen in plan.choices.items():
        front = pareto_front(plan.candidates[fqn])
        bigger = [c for c in front if c.bytes > chosen.bytes and c.error < chosen.error]
        smaller = [c for c in front if c.bytes < chosen.bytes]
        if bigger:
            up[fqn] = bigger[0]
        if smaller:
            down[fqn] = smaller[-1]
    return up, down


def ranked_pairs(
    gain: dict[str, float],
    cost: dict[str, float],
    extra: dict[str, int],
    saved: dict[str, int],
    room: int,
) -> list[tuple[float, str, str]]:
    """(predicted loss drop, layer up, layer down) for every pair of two layers whose move up (``extra`` bytes,
    loss ``gain``) and move down (``saved`` bytes, loss ``cost``) fit in ``room`` spare bytes, best first; pairs
    predicted to lose are left out."""
    pairs = [
        (gain[a] - cost[b], a, b)
        for a in gain
        for b in cost
        if a != b and extra[a] - saved[b] <= room and gain[a] > cost[b]
    ]
    return sorted(pairs, key=lambda p: (-p[0], p[1], p[2]))


def search_plan(
    student: nn.Module,
    teacher: nn.Module,
    plan: FormatPlan,
    calibration: Calibration,
    batches: Sequence,
    config: DistillConfig,
    rounds: int = 2,
) -> tuple[FormatPlan, PlanSearchReport]:
    """``plan`` improved for ``rounds`` rounds (module docstring) by the loss ``match_teacher`` trains on
    (``config``, its ``hidden_modules`` matched), measured on ``batches`` with the weights rounded as at the start
    of training. ``student``: the dense model ``choose_formats`` read (not changed). Three built copies are held at
    once. Returns the plan (the same budget, bytes never above it) and a ``PlanSearchReport``."""
    report = PlanSearchReport()
    start = time.perf_counter()
    with preserved_rng():
        for _ in range(rounds):
            plan, moved = _one_round(student, teacher, plan, calibration, list(batches), config, report)
            if not moved:
                break
    report.seconds = time.perf_counter() - start
    return plan, report


def _build(student: nn.Module, plan: FormatPlan, choices: dict[str, FormatChoice], calibration) -> nn.Module:
    built = copy.deepcopy(student)
    apply_formats_(built, dataclasses.replace(plan, choices=choices), calibration)
    return built


def _one_round(student, teacher, plan, calibration, batches, config, report) -> tuple[FormatPlan, bool]:
    up, down = one_step_moves(plan)
    built = _build(student, plan, plan.choices, calibration)
    all_up = _build(student, plan, {**plan.choices, **up}, calibration)
    all_down = _build(student, plan, {**plan.choices, **down}, calibration)
    settings = resolved(config, built, teacher)
    hidden = settings.hidden_modules
    captures = (HiddenCapture(teacher, hidden), HiddenCapture(built, hidden)) if hidden else None
    paths = plan.module_paths

    def swap(fqn: str, source: nn.Module) -> nn.Module:
        kept = built.get_submodule(paths[fqn])
        built.set_submodule(paths[fqn], source.get_submodule(paths[fqn]))
        return kept

    try:
        with eval_modes(teacher), eval_modes(built), eval_modes(all_up), eval_modes(all_down):
            scorer = BestWeights(
                built,
                teacher,
                batches,
                config=settings,
                output_fn=settings.output_fn or default_output,
                hidden=captures,
            )
            base = scorer.loss()
            if not report.losses:
                report.losses.append(base)

            def moved_loss(fqn: str, source: nn.Module) -> float:
                kept = swap(fqn, source)
                try:
                    return scorer.loss()
                finally:
                    built.set_submodule(paths[fqn], kept)

            gain = {fqn: base - moved_loss(fqn, all_up) for fqn in up}
            cost = {fqn: moved_loss(fqn, all_down) - base for fqn in down}
            choices = dict(plan.choices)
            extra = {fqn: c.bytes - choices[fqn].bytes for fqn, c in up.items()}
            saved = {fqn: choices[fqn].bytes - c.bytes for fqn, c in down.items()}
            room = plan.budget_bytes - plan.total_bytes
            current, moved, tries = base, set(), 0
            for _, a, b in ranked_pairs(gain, cost, extra, saved, room):
                if tries >= MAX_TRIES:
                    break
                if a in moved or b in moved or extra[a] - saved[b] > room:
                    continue
                tries += 1
                kept_a, kept_b = swap(a, all_up), swap(b, all_down)
                loss = scorer.loss()
                if loss < current:
                    current, room = loss, room - extra[a] + saved[b]
                    choices[a], choices[b] = up[a], down[b]
                    moved |= {a, b}
                    report.moves.append((a, b, loss))
                else:
                    built.set_submodule(paths[a], kept_a)
                    built.set_submodule(paths[b], kept_b)
    finally:
        for capture in captures or ():
            capture.remove()
    report.tried += tries
    report.losses.append(current)
    return dataclasses.replace(plan, choices=choices), bool(moved)
