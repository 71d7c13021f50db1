"""Distillation keeps the weights at the lowest validation loss: a run that only hurts returns its start, a run that
helps returns its best point. Losses are recomputed here in float64 from the two models' outputs."""

from __future__ import annotations

import copy

import pytest
import torch

import comera_fx
from comera_fx.pretrained import DistillConfig, compress_, match_teacher
from comera_fx.pretrained.keep_best import split_validation
from test_compress import SMALL, batches, tiny_bert

pytestmark = pytest.mark.usefixtures("one_thread")
OUTPUT_ONLY = DistillConfig(hidden_modules=(), progress=False, calibration_batches=0)


def output_error(student, teacher, data) -> float:
    """Mean over batches of ‖s − t‖² / ‖t‖² on the last hidden state, in float64."""
    total = 0.0
    with torch.no_grad():
        for b in data:
            s = student(**b).last_hidden_state.double()
            t = teacher(**b).last_hidden_state.double()
            total += float((s - t).pow(2).mean() / t.pow(2).mean())
    return total / len(data)


def perturbed(teacher, scale: float, seed: int = 1):
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in student.parameters():
            if p.dim() == 2:
                p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return student


def test_a_run_that_only_hurts_returns_its_start():
    teacher = tiny_bert()
    train, held = batches(6, 0), batches(2, 1)
    start = perturbed(teacher, 0.05)
    hurt = copy.deepcopy(start)
    match_teacher(hurt, teacher, train, steps=6, config=OUTPUT_ONLY.replace(lr=0.3))
    assert output_error(hurt, teacher, held) > output_error(start, teacher, held)  # the setting does hurt
    student = copy.deepcopy(start)
    curve = []
    _, _, notes = match_teacher(
        student, teacher, train, steps=6, config=OUTPUT_ONLY.replace(lr=0.3), validation=held, validation_curve=curve
    )
    assert [step for step, _ in curve] == list(range(7))  # the start and every step: 6 steps, checks every 5 %
    assert min(curve, key=lambda point: point[1])[0] == 0
    assert any("kept the weights after step 0 of 6" in n for n in notes)
    for (name, p), q in zip(student.state_dict().items(), start.state_dict().values()):
        assert torch.equal(p, q), name
    assert curve[0][1] == pytest.approx(output_error(start, teacher, held), rel=1e-4)


def test_a_run_that_helps_returns_its_lowest_point():
    teacher = tiny_bert()
    train, held = batches(8, 0), batches(2, 1)
    student = perturbed(teacher, 0.5)
    before = output_error(student, teacher, held)
    curve = []
    match_teacher(
        student, teacher, train, steps=10, config=OUTPUT_ONLY.replace(lr=3e-3), validation=held, validation_curve=curve
    )
    best_step, best = min(curve, key=lambda point: point[1])
    assert best_step > 0 and best < curve[0][1]
    after = output_error(student, teacher, held)  # the weights returned are the best point's
    assert after == pytest.approx(best, rel=1e-4) and after < before


def test_compress_returns_a_quantized_start_that_training_would_blur():
    """At a budget int8 meets, a learning rate far too high only blurs the start: compress_ keeps the start, so
    the student is the plan built and rounded, untrained (compared with one built here from the same plan)."""
    teacher = tiny_bert()
    data = batches(12, 0)  # more than 4 x 2: the last two are held out
    config = DistillConfig(calibration_batches=4, output_batches=2, progress=False, pack=False, lr=0.3)
    calibration = comera_fx.calibrate(teacher, data[:4], config=SMALL, token_mask=lambda b: b["attention_mask"])
    student = copy.deepcopy(teacher)
    summary = compress_(
        student, teacher, data, byte_budget=0.3, budget_seconds=None, steps=4, config=config,
        tensorize_config=SMALL, calibration=calibration,
    )  # fmt: skip
    assert summary.validation[0][0] == 0 and len(summary.validation) == 5
    assert any("kept the weights after step 0 of 4" in n for n in summary.notes), summary.notes
    assert "validation loss" in str(summary)
    reference = copy.deepcopy(teacher)
    comera_fx.apply_formats_(reference, summary.plan, calibration)
    comera_fx.quantize.requantize_(reference)
    held = data[-2:]
    assert output_error(student, teacher, held) == pytest.approx(output_error(reference, teacher, held), rel=1e-5)


def test_validation_batches_are_split_from_the_training_batches():
    data = list(range(10))
    assert split_validation(data, 2) == (list(range(8)), [8, 9], True)
    assert split_validation(data[:8], 2) == (data[:8], [6, 7], False)  # too few to spare: validated, trained on too
    stream = iter(data)
    assert split_validation(stream, 2) == (stream, [], True)  # drawn from the stream after calibration
    assert split_validation(data, 0) == (data, [], True)


def test_validation_settings_are_checked():
    teacher = tiny_bert()
    with pytest.raises(ValueError, match="validation_batches"):
        DistillConfig(validation_batches=-1)
    with pytest.raises(ValueError, match="on_optimizer"):
        match_teacher(
            copy.deepcopy(teacher),
            teacher,
            batches(2, 0),
            steps=1,
            config=OUTPUT_ONLY,
            validation=batches(1, 1),
            on_optimizer=lambda optimizer, model: None,
        )
