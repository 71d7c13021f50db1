"""search_plan: plans judged by the loss of the whole plan built; checked against the loss written out by hand."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_compress import QUICK, SMALL, batches, tiny_bert

import comera_fx
from comera_fx.pretrained import compress_
from comera_fx.pretrained.format_select import FormatChoice
from comera_fx.pretrained.formats import FormatPlan
from comera_fx.pretrained.plan_search import one_step_moves, ranked_pairs, search_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def choice(fqn: str, nbytes: int, error: float, fmt: str = "int4") -> FormatChoice:
    return FormatChoice(fqn, fmt, None, nbytes, error)


def test_one_step_moves_walk_the_pareto_front():
    a = [choice("a", 10, 1.0), choice("a", 20, 0.5), choice("a", 25, 0.7), choice("a", 30, 0.2)]
    b = [choice("b", 10, 1.0), choice("b", 20, 0.4)]
    plan = FormatPlan({"a": a[1], "b": b[0]}, {"a": a, "b": b}, budget_bytes=40, dense_bytes=100)
    up, down = one_step_moves(plan)
    assert up == {"a": a[3], "b": b[1]}  # a's 25-byte candidate is dominated by its 20-byte one
    assert down == {"a": a[0]}  # b sits at its smallest


def test_ranked_pairs_keep_the_budget_and_sort_by_predicted_gain():
    gain = {"a": 0.5, "b": 0.2, "c": 0.1}
    cost = {"a": 0.1, "b": 0.05, "c": 0.3}
    extra = {"a": 10, "b": 4, "c": 1}
    saved = {"a": 3, "b": 6, "c": 8}
    pairs = ranked_pairs(gain, cost, extra, saved, room=2)
    # a up (10 bytes) needs a layer down saving >= 8: only c; b up with c down and c up with a down lose or tie
    expected = [(0.2, "a", "c"), (0.1, "b", "a"), (0.05, "c", "b")]
    assert [(u, d) for _, u, d in pairs] == [(u, d) for _, u, d in expected]
    assert [p for p, _, _ in pairs] == pytest.approx([p for p, _, _ in expected])
    assert all(extra[u] - saved[d] <= 2 and gain[u] > cost[d] for _, u, d in pairs)


def hand_loss(model: torch.nn.Module, teacher: torch.nn.Module, data: list[dict]) -> float:
    """The default distillation loss written out in float64: relative MSE of the last hidden state plus 1/2 × that
    of each of the two blocks' outputs (hidden_states[1:]), averaged over the batches."""

    def rel(s, t):
        return float((s.double() - t.double()).pow(2).mean() / t.double().pow(2).mean())

    total = 0.0
    with torch.no_grad():
        for b in data:
            s = model(**b, output_hidden_states=True)
            t = teacher(**b, output_hidden_states=True)
            total += rel(s.last_hidden_state, t.last_hidden_state)
            total += 0.5 * sum(rel(s.hidden_states[i], t.hidden_states[i]) for i in (1, 2))
    return total / len(data)


def built(teacher, plan, calibration):
    model = copy.deepcopy(teacher)
    comera_fx.apply_formats_(model, plan, calibration)
    return model


def test_search_lowers_the_built_loss_within_the_budget():
    """The losses the search reports are those of the plans built, written out by hand; the plan it returns is
    never dearer than the budget and scores no higher than the one it started from; the dense model and the RNG
    are untouched."""
    teacher = tiny_bert()
    student = copy.deepcopy(teacher)
    data = batches(8, 0)
    calibration = comera_fx.calibrate(student, data[:4], config=SMALL, token_mask=lambda b: b["attention_mask"])
    plan = comera_fx.choose_formats(student, calibration, 0.12, config=SMALL)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    rng = torch.get_rng_state()
    found, report = search_plan(student, teacher, plan, calibration, data[:4], QUICK, rounds=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in before.items())
    start = hand_loss(built(teacher, plan, calibration), teacher, data[:4])
    end = hand_loss(built(teacher, found, calibration), teacher, data[:4])
    assert report.losses[0] == pytest.approx(start, rel=1e-4)
    assert report.losses[-1] == pytest.approx(end, rel=1e-4)
    assert report.moves, "no move kept: the test model should leave room to improve"
    assert end < start
    assert found.total_bytes <= plan.budget_bytes
    moved = {a for a, _, _ in report.moves} | {b for _, b, _ in report.moves}
    changed = {f for f in plan.choices if found.choices[f] != plan.choices[f]}
    assert changed and changed <= moved  # a later round may move a layer back
    assert str(report).startswith("plan search: loss ")


def test_compress_runs_the_search_and_says_so():
    teacher = tiny_bert()
    student = copy.deepcopy(teacher)
    summary = compress_(
        student,
        teacher,
        batches(12, 0),
        byte_budget=0.12,
        budget_seconds=None,
        steps=1,
        config=dataclasses.replace(QUICK, plan_search=1),
        tensorize_config=SMALL,
    )
    assert "plan_search" in summary.seconds
    assert any(n.startswith("plan search: loss ") for n in summary.notes)
    assert summary.plan.total_bytes <= summary.plan.budget_bytes
    with pytest.raises(ValueError, match="plan_search must be an int >= 0"):
        dataclasses.replace(QUICK, plan_search=-1)
