"""The demo's choice between the compiled and the eager path (examples/compile_policy.py).

The decision is checked against step counts worked out by hand; the state machine with the compile replaced by a
recorder (no Inductor in the default suite); the whole demo once with a real compile in the slow suite.
"""

from __future__ import annotations

import math

import pytest

from helpers_models import load_demo


@pytest.fixture(scope="module")
def policy():
    return load_demo().compile_policy


def test_steps_gained_by_hand(policy):
    # 100 s left: eager 1 s/step = 100 steps; compiled 0.5 s/step after 20 s of recompiles = 160 steps
    assert policy.steps_gained(100.0, 1.0, 0.5, 20.0) == pytest.approx(60.0)
    # recompiles longer than the time left: nothing compiled runs
    assert policy.steps_gained(10.0, 1.0, 0.5, 30.0) == pytest.approx(-10.0)
    # a compiled step no faster than eager never pays
    assert policy.steps_gained(100.0, 1.0, 1.0, 0.0) == pytest.approx(0.0)
    assert policy.steps_gained(100.0, 1.0, 1.1, 0.0) < 0


def test_could_pay_needs_budget_for_every_compile(policy):
    best, floor = policy.BEST_SPEEDUP, policy.MIN_COMPILE_SECONDS
    edge = floor / (1 - 1 / best)  # the budget at which one compile is exactly repaid at the best speed-up
    assert not policy.could_pay(edge * 0.99) and policy.could_pay(edge * 1.01)
    assert not policy.could_pay(edge * 1.5, recompiles=1) and policy.could_pay(edge * 2.01, recompiles=1)
    assert not policy.could_pay(1e6, recompiles=policy.UNBOUNDED)


class Recorder:
    """Stands in for compile_blocks / uncompile_blocks: counts calls, reports a graph count."""

    def __init__(self):
        self.compiled = self.uncompiled = self.settled_eager = 0
        self.count = 0

    def on_eager(self):
        self.settled_eager += 1

    def compile_blocks(self, model):
        self.compiled += 1
        self.count = 1
        return self

    def uncompile_blocks(self, model):
        self.uncompiled += 1

    def graphs(self):
        return self.count


def drive(policy, monkeypatch, mode, budget, eager_s, first_compiled_s, compiled_s, recompiles=0):
    """Run a probe over a budget of fixed step times; returns (probe, recorder, steps)."""
    recorder = Recorder()
    monkeypatch.setattr(policy, "compile_blocks", recorder.compile_blocks)
    monkeypatch.setattr(policy, "uncompile_blocks", recorder.uncompile_blocks)
    probe = policy.CompileProbe(mode=mode, budget_s=budget, expected_recompiles=recompiles,
                                on_eager=recorder.on_eager, eager_steps=4, probe_steps=4)
    spent, steps = 0.0, 0
    while spent < budget:
        probe.before_step(None)
        if probe.state == "eager" or probe.state in ("declined", "reverted"):
            seconds = eager_s
        else:
            seconds = first_compiled_s if not probe.compiled_times else compiled_s
        probe.after_step(seconds, None)
        spent += seconds
        steps += 1
    return probe, recorder, steps


def test_a_compile_that_pays_is_kept(policy, monkeypatch):
    # 4 eager steps of 1 s, a compile of 10 s, then 0.5 s steps; 100 s budget, one recompile expected
    probe, recorder, steps = drive(policy, monkeypatch, "auto", 100.0, 1.0, 11.0, 0.5, recompiles=1)
    assert probe.state == "kept" and recorder.compiled == 1 and recorder.uncompiled == 0
    assert recorder.settled_eager == 0  # the rank settings for compiling stay
    summary = probe.summary()
    assert summary["path"] == "compiled" and summary["compile_s"] == pytest.approx(10.0)
    assert summary["eager_step_s"] == pytest.approx(1.0) and summary["compiled_step_s"] == pytest.approx(0.5)
    # by hand: 4 eager steps, then 1 + ceil((100 - 4 - 11) / 0.5) compiled steps
    assert steps == 4 + 1 + math.ceil(85 / 0.5)
    # the compiled steps ran in 11 + 170·0.5 = 96 s, where eager would have run 96 steps
    assert summary["steps_gained"] == pytest.approx(171 - 96.0)


def test_a_compile_that_does_not_pay_goes_back_to_eager(policy, monkeypatch):
    # compiled 0.95 s against eager 1 s, 30 s budget: 10 s of compile and 10 s of recompile are never repaid
    probe, recorder, _ = drive(policy, monkeypatch, "auto", 30.0, 1.0, 11.0, 0.95, recompiles=1)
    assert probe.state == "reverted" and recorder.uncompiled == 1 and recorder.settled_eager == 1
    assert probe.summary()["path"] == "compiled, then eager" and "back to eager" in probe.reason
    assert probe.summary()["steps_gained"] < 0  # the probe's compile was paid from the run's clock


def test_yes_keeps_and_no_never_compiles(policy, monkeypatch):
    probe, recorder, _ = drive(policy, monkeypatch, "yes", 30.0, 1.0, 11.0, 0.95, recompiles=1)
    assert probe.state == "kept" and recorder.uncompiled == 0 and "--compile yes" in probe.reason
    probe, recorder, _ = drive(policy, monkeypatch, "no", 300.0, 1.0, 11.0, 0.5)
    assert probe.state == "declined" and recorder.compiled == 0 and probe.summary()["path"] == "eager"


def test_a_short_budget_is_not_probed(policy, monkeypatch):
    probe, recorder, _ = drive(policy, monkeypatch, "auto", 8.0, 1.0, 11.0, 0.5)
    assert probe.state == "declined" and recorder.compiled == 0 and "could not repay" in probe.reason
    assert recorder.settled_eager == 1


def test_bad_mode_is_refused(policy):
    with pytest.raises(ValueError, match="'auto', 'yes' or 'no'"):
        policy.CompileProbe(mode="always")


@pytest.mark.slow
def test_demo_compiled_path_recompiles_once_and_trains(tmp_path):
    """The tiny demo with --compile yes: both runs compile their blocks (the TT run through comera_fx's backend),
    the TT run recompiles at most once across its prunes, and both reach a finite validation loss."""
    demo = load_demo()
    result = demo.main(["--preset", "tiny", "--budget-seconds", "40", "--compile", "yes", "--out",
                        str(tmp_path / "run"), "--quiet"])
    runs = {r.name: r for r in result["results"]}
    for run in runs.values():
        assert run.compile["path"] == "compiled" and run.compile["graphs"] >= 1, run.compile
        assert math.isfinite(run.final_val) and run.final_val < 5.0
    tt = runs["comera_fx"]
    assert tt.compile["recompiles"] <= 1, tt.compile
    assert tt.history[-1]["tt_params"] < tt.history[0]["tt_params"]  # it really shrank
    assert "Compiled or eager" in (tmp_path / "run" / "report.md").read_text()
