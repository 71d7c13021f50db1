"""The training runs' choice between the compiled and the eager path (comera_fx.compile_policy).

The decision is checked against step counts worked out by hand; the state machine with the compile replaced by a
recorder (no Inductor in the default suite); the whole demo once with a real compile in the slow suite.
"""

from __future__ import annotations

import math
import statistics

import pytest

from comera_fx import compile_policy
from helpers_models import load_demo


@pytest.fixture(scope="module")
def policy():
    return compile_policy


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
    """Stands in for compile_blocks / uncompile_blocks / pause_blocks / resume_blocks: counts calls, reports a graph
    count, and knows which path the next step runs."""

    def __init__(self):
        self.compiled = self.uncompiled = self.settled_eager = 0
        self.count = 0
        self.paused = False

    def on_eager(self):
        self.settled_eager += 1

    def compile_blocks(self, model):
        self.compiled += 1
        self.count = 1
        return self

    def uncompile_blocks(self, model):
        self.uncompiled += 1

    def pause_blocks(self, model):
        assert not self.paused
        self.paused = True
        return ["compiled calls"]

    def resume_blocks(self, model, calls):
        assert self.paused and calls == ["compiled calls"]
        self.paused = False

    def graphs(self):
        return self.count


def drive(
    policy, monkeypatch, mode, budget, eager_s, first_compiled_s, compiled_s, recompiles=0, min_pairs=4, max_pairs=16
):
    """Run a probe over a budget of step times (``eager_s`` / ``compiled_s``: seconds, or a function of the step's
    index); returns (probe, recorder, paths of the steps)."""
    recorder = Recorder()
    for name in ("compile_blocks", "uncompile_blocks", "pause_blocks", "resume_blocks"):
        monkeypatch.setattr(policy, name, getattr(recorder, name))
    probe = policy.CompileProbe(
        mode=mode,
        budget_s=budget,
        expected_recompiles=recompiles,
        on_eager=recorder.on_eager,
        eager_steps=4,
        min_pairs=min_pairs,
        max_pairs=max_pairs,
    )
    timed = [t if callable(t) else (lambda i, t=t: t) for t in (eager_s, compiled_s)]
    spent, paths = 0.0, []
    while spent < budget:
        probe.before_step(None)
        if probe.state in ("eager", "declined", "reverted") or recorder.paused:
            path, seconds = "eager", timed[0](len(paths))
        elif not probe.compiled_times:
            path, seconds = "compile", first_compiled_s
        else:
            path, seconds = "compiled", timed[1](len(paths))
        probe.after_step(seconds, None)
        spent += seconds
        paths.append(path)
    assert not recorder.paused or probe.state == "compiled"  # a decided probe leaves the blocks compiled
    return probe, recorder, paths


def test_a_compile_that_pays_is_kept(policy, monkeypatch):
    # 4 eager steps of 1 s, a compile of 10 s, then 0.5 s steps; 100 s budget, one recompile expected
    probe, recorder, paths = drive(policy, monkeypatch, "auto", 100.0, 1.0, 11.0, 0.5, recompiles=1)
    assert probe.state == "kept" and recorder.compiled == 1 and recorder.uncompiled == 0
    assert recorder.settled_eager == 0  # the rank settings for compiling stay
    summary = probe.summary()
    assert summary["path"] == "compiled" and summary["compile_s"] == pytest.approx(10.0)
    assert summary["eager_step_s"] == pytest.approx(1.0) and summary["compiled_step_s"] == pytest.approx(0.5)
    # by hand: every pair reads 2x against the 1.14-1.15x needed; a one-sided sign test first passes 0.02 at
    # 6 of 6 pairs (1/64), so 4 eager steps, the compile step, 6 pairs in alternating order, then compiled steps
    # for the (100 - 4 - 11 - 6·1.5) = 76 s left
    assert summary["probe_pairs"] == 6 and summary["probe_speedup"] == pytest.approx(2.0)
    assert paths[:5] == ["eager"] * 4 + ["compile"]
    assert paths[5:17] == ["compiled", "eager", "eager", "compiled"] * 3
    assert paths[17:] == ["compiled"] * 152
    # the 159 compiled steps ran in 11 + 6·0.5 + 76 = 90 s, where eager would have run 90 steps
    assert summary["compiled_steps"] == 159 and summary["steps_gained"] == pytest.approx(159 - 90.0)


def test_a_speeding_machine_does_not_flatter_a_slower_compiled_step(policy, monkeypatch):
    """The machine gets 1.5 % faster every step (a neighbour's job ending), the compiled step is 3 % slower than
    eager at the same moment. Compiled steps timed after the eager ones would read faster; neighbouring pairs in
    alternating order see the 3 %."""

    def eager(i):
        return max(2.0 * 0.985**i, 1.0)

    def compiled(i):
        return 1.03 * eager(i)

    probe, recorder, _ = drive(policy, monkeypatch, "auto", 300.0, eager, 11.0, compiled)
    assert probe.state == "reverted" and recorder.uncompiled == 1
    assert all(r < 1.0 for r in probe.pair_ratios) and len(probe.pair_ratios) == 6
    # what the old probe read: the median of 3 eager steps before the compile against 4 compiled ones after
    assert statistics.median([eager(i) for i in (1, 2, 3)]) > statistics.median([compiled(i) for i in (5, 6, 7, 8)])


def test_noisy_pairs_are_probed_longer_and_the_median_decides_at_the_cap(policy, monkeypatch):
    # compiled 10 % faster but every third pair reads the other way: the sign test cannot decide before the cap
    def compiled(i):
        return 0.9 if (i // 2) % 3 else 1.2

    probe, _, _ = drive(policy, monkeypatch, "auto", 1000.0, 1.0, 11.0, compiled, min_pairs=4, max_pairs=12)
    assert probe.state == "kept" and len(probe.pair_ratios) == 12
    assert probe.summary()["probe_speedup"] == pytest.approx(1 / 0.9)


def test_paired_verdict_by_hand(policy):
    assert policy.sign_test_tail(6, 6) == pytest.approx(1 / 64)
    assert policy.sign_test_tail(5, 6) == pytest.approx(7 / 64)
    assert policy.sign_test_tail(0, 6) == pytest.approx(1.0)
    verdict = policy.paired_verdict
    assert verdict([1.2] * 5, 1.0, min_pairs=4, max_pairs=20) is None  # 1/32 > 0.02: not yet
    assert verdict([1.2] * 6, 1.0, min_pairs=4, max_pairs=20) is True
    assert verdict([0.9] * 6, 1.0, min_pairs=4, max_pairs=20) is False
    assert verdict([1.2] * 6, 1.0, min_pairs=8, max_pairs=20) is None  # below the minimum
    assert verdict([1.2] * 6, 1.3, min_pairs=4, max_pairs=20) is False  # the recompiles need 1.3x
    assert verdict([1.2, 0.9] * 4, 1.0, min_pairs=4, max_pairs=20) is None
    assert verdict([1.2, 0.9, 1.1] * 4, 1.0, min_pairs=4, max_pairs=12) is True  # at the cap: median 1.1
    assert policy.speedup_needed(100.0, 20.0) == pytest.approx(1.25)
    assert policy.speedup_needed(10.0, 20.0) == math.inf


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
    result = demo.main(
        ["--preset", "tiny", "--budget-seconds", "40", "--compile", "yes", "--out", str(tmp_path / "run"), "--quiet"]
    )
    runs = {r.name: r for r in result["results"]}
    for run in runs.values():
        assert run.compile["path"] == "compiled" and run.compile["graphs"] >= 1, run.compile
        assert math.isfinite(run.final_val) and run.final_val < 5.0
    tt = runs["comera_fx"]
    assert tt.compile["recompiles"] <= 1, tt.compile
    assert tt.history[-1]["tt_params"] < tt.history[0]["tt_params"]  # it really shrank
    assert "Compiled or eager" in (tmp_path / "run" / "report.md").read_text()


def test_steps_gained_at_the_probes_ratio_by_hand(policy):
    """The machine halves its speed half-way through a run (1.25x compiled gain throughout); a recompile of 10 s
    comes at that point. Each compiled step counts 1 - 1/1.25 = 0.2 steps gained against the compiled steps around
    it, the recompile 1 - 10 / (1.25 · 1.0) = -7 (the median around it is 1.0 s), the compile 1 - 10.5 / 0.5 = -20.
    Against the eager step measured before the compile the same run would read -89: the slowdown taken for a
    loss."""
    times = [10.5] + [0.5] * 50 + [10.0] + [1.0] * 50
    assert policy.steps_gained_at_ratio(times, 0.5, 1.25) == pytest.approx(-20 + 50 * 0.2 - 7 + 50 * 0.2)
    assert len(times) - sum(times) / 0.5 == pytest.approx(-89)
    assert policy.steps_gained_at_ratio([], 0.5, 1.25) == 0.0


def test_pausing_the_blocks_runs_them_eagerly_and_resuming_recompiles_nothing(policy):
    """The paired probe's switch (pause_blocks / resume_blocks) on blocks compiled by Dynamo (its eager backend, no
    Inductor): paused, no compiled frame runs; resumed, the same compiled calls run again and nothing is traced anew."""
    import torch
    from torch import nn

    class Block(nn.Module):  # user code: Dynamo does not trace a torch.nn module's own forward at the top
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch._dynamo.reset()
    traced, ran = [], []

    def counting_backend(gm, example_inputs):  # Dynamo's eager backend, counting graphs traced and run
        traced.append(gm)

        def run(*args):
            ran.append(gm)
            return gm.forward(*args)

        return run

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    expected = net(x)
    for block in net.blocks:
        block.compile(backend=counting_backend)
    torch.testing.assert_close(net(x), expected)
    graphs = len(traced)
    assert graphs >= 1 and len(ran) == 2  # one graph for both blocks (same code, same shapes), run twice
    calls = policy.pause_blocks(net)
    assert all(block._compiled_call_impl is None for block in net.blocks)
    torch.testing.assert_close(net(x), expected)
    assert len(ran) == 2  # paused: no compiled graph ran
    policy.resume_blocks(net, calls)
    torch.testing.assert_close(net(x), expected)
    assert len(ran) == 4 and len(traced) == graphs  # the compiled calls came back, nothing traced anew
    with pytest.raises(ValueError):
        policy.resume_blocks(net, calls[:1])  # one call per block, or nothing is changed silently
    torch._dynamo.reset()
