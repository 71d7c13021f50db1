"""Smoke test of the training demo (examples/train_code_lm.py): the tiny preset end to end, in-process.

It trains a 2-layer, 64-wide byte-level model dense and with comera_fx for 1.5 s each on standard-library source and
checks the outputs: report.md with a row per run, validation losses that start near ln 256 and fall by a nat or more,
prunes that meet the budget schedule's size, and the three plots.
"""

from __future__ import annotations

import functools
import math
import re

import pytest

from helpers_models import load_demo


def table_rows(report: str) -> dict[str, list[str]]:
    """Rows of the results table (the first markdown table after '## Results'), keyed by run name."""
    section = report.split("## Results", 1)[1]
    lines = [line for line in section.strip().splitlines()]
    header_at = next(i for i, line in enumerate(lines) if line.startswith("| run"))
    header = [c.strip() for c in lines[header_at].strip("|").split("|")]
    rows = {}
    for line in lines[header_at + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_tiny_demo_writes_report_and_plots(tmp_path):
    demo = load_demo()
    out = tmp_path / "run"
    result = demo.main(["--preset", "tiny", "--budget-seconds", "1.5", "--out", str(out), "--quiet"])

    assert result["out"] == str(out)
    report = (out / "report.md").read_text()
    for name in ("val_loss.png", "compression.png", "ranks.png", "report.md"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    rows = table_rows(report)
    assert set(rows) == {"dense", "comera_fx"}, rows
    for run in result["results"]:
        (_, first_step, start), *_, (_, _, end) = run.evals
        # an untrained byte model predicts nearly uniformly: the first validation, before any step, reads ~ln 256
        assert first_step == 0 and abs(start - math.log(256)) < 0.3, (run.name, run.evals[0])
        # and 1.5 s of training (~200 dense / ~80 TT steps on a quiet core; ~15 suffice) lowers it by a nat or more
        assert end < start - 1.0, (run.name, run.evals)
        assert float(rows[run.name]["final val loss (nats/byte)"]) == pytest.approx(end, abs=5e-4), run.name
        assert int(rows[run.name]["steps"]) == run.steps >= 1
    dense_linear = int(re.match(r"[\d,]+", rows["dense"]["linear-layer params"]).group().replace(",", ""))
    tt_linear = int(re.match(r"[\d,]+", rows["comera_fx"]["linear-layer params"]).group().replace(",", ""))
    assert tt_linear < dense_linear
    # 1.5 s cannot repay a compile: --compile auto (the default) stays eager and says why, in the report too
    for run in result["results"]:
        assert run.compile["path"] == "eager" and "could not repay" in run.compile["reason"], run.compile
    assert "could not repay" in report.split("## Compiled or eager", 1)[1]
    # the RankAdaptive history made it to the run result and the rank plot
    tt = next(r for r in result["results"] if r.name == "comera_fx")
    assert tt.history and all(h["gate_ranks"] for h in tt.history)
    # every prune met the budget schedule's size at its step, and the target is half the starting TT size
    prunes = [h for h in tt.history if h["shrunk"]]
    assert prunes, "rank adaptation pruned nothing (its first prunes come ~15 steps in)"
    assert all(h["tt_params_without_dead"] <= h["budget"] for h in prunes), [
        (h["step"], h["tt_params_without_dead"], h["budget"]) for h in prunes
    ]
    assert tt.target_params == pytest.approx(0.5 * tt.history[0]["tt_params"], rel=0.01)


def test_openmp_wait_policy_follows_the_load(monkeypatch):
    """The demo's choice (examples/openmp_policy.py): an explicit setting wins, an idle machine keeps libgomp's
    spin-then-sleep (written out so children inherit it), a busy one waits passively. Busy is the CPUs' sampled busy
    time, the load average where there is no sample."""
    policy = load_demo().openmp_policy
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(policy, "_chosen", None)  # restored after the test, like the environment

    # a job that just ended: the load average still reads it, the sample does not
    monkeypatch.setattr(policy.os, "getloadavg", lambda: (1.35, 0.0, 0.0))
    monkeypatch.setattr(policy, "_sample_busy_cpus", lambda cpus: 0.1)
    assert policy.choose_wait_policy().endswith("(idle machine: 0.10 of 2 CPUs busy over 1 s)")
    assert policy.os.environ["GOMP_SPINCOUNT"] == policy.LIBGOMP_DEFAULT_SPINCOUNT
    assert "OMP_WAIT_POLICY" not in policy.os.environ

    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setattr(policy, "_sample_busy_cpus", lambda cpus: 1.2)
    assert policy.choose_wait_policy().startswith("OMP_WAIT_POLICY=PASSIVE (busy machine: 1.20 of 2")
    assert policy.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"

    # no /proc/stat: the load average decides
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(policy, "_sample_busy_cpus", lambda cpus: None)
    monkeypatch.setattr(policy.os, "getloadavg", lambda: (0.4, 0.0, 0.0))
    assert "idle machine: load average 0.40" in policy.choose_wait_policy()
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setattr(policy.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert "busy machine: load average 1.50" in policy.choose_wait_policy()

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(policy.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert policy.choose_wait_policy() == "OMP_WAIT_POLICY=ACTIVE (set by the environment)"
    assert "GOMP_SPINCOUNT" not in policy.os.environ
    assert policy.wait_policy_note() == "OMP_WAIT_POLICY=ACTIVE (set by the environment)"


def test_busy_cpus_from_proc_stat_by_hand():
    policy = load_demo().openmp_policy
    # user nice system idle iowait irq softirq steal guest guest_nice
    before = policy.cpu_times("cpu  100 0 50 800 50 0 0 0 7 0\ncpu0 50 0 25 400 25 0 0 0 0 0\nintr 1 2\n")
    after = policy.cpu_times("cpu  160 0 70 900 70 0 0 0 9 0\ncpu0 90 0 35 440 35 0 0 0 0 0\n")
    assert before == (150, 1000) and after == (230, 1200)  # guest is inside user: not counted twice
    assert policy.busy_cpus(before, after, cpus=2) == pytest.approx(2 * 80 / 200)
    assert policy.busy_cpus(before, before, cpus=2) == 0.0
    assert policy.cpu_times("intr 1 2\n") is None


def test_interleaved_runs_train_exactly_as_run_alone():
    """``training_steps`` (what benchmarks/bench_compile_ab.py interleaves) keeps each run's state to itself: two
    comera_fx runs of the tiny preset advanced step by step in turn take exactly the losses, ranks and validation of
    the same run trained alone by ``train`` (same seed and batches; the schedule's horizon in steps, so no prune
    depends on the clock; validation only at the start and the end, where the clock cannot move it)."""
    import torch

    demo = load_demo()
    args, p = demo.parse_args(
        [
            "--preset",
            "tiny",
            "--budget-seconds",
            "100",
            "--max-steps",
            "12",
            "--compile",
            "no",
            "--keep-fraction",
            "0.5",
            "--eval-every",
            "1000",  # validations are timed by the clock: only at the start and at the end here
            "--quiet",
        ]
    )
    device = torch.device("cpu")
    train_data, val_data, _ = demo.load_stdlib(p.data_bytes)
    val_set = [demo.get_batch(val_data, p.batch, p.seq_len, torch.Generator().manual_seed(3), device)]

    def run():
        torch.manual_seed(args.seed)
        model = demo.GPT(p)
        result = demo.RunResult("comera_fx")
        optimizer, hook, _, _ = demo.prepare_tt_run(model, p, args, train_data, device, result)
        return result, demo.training_steps(
            "comera_fx", model, optimizer, hook, train_data, val_set, p, args, device, result
        )

    alone, steps = run()
    for _ in steps:
        pass
    (first, first_steps), (second, second_steps) = run(), run()
    live = [first_steps, second_steps]
    while live:
        for steps in list(live):
            try:
                next(steps)
            except StopIteration:
                live.remove(steps)
    assert alone.steps == 12 and any(entry["shrunk"] for entry in alone.history)  # it pruned on the way
    for other in (first, second):
        assert other.train_losses == alone.train_losses
        # by step: a validation's step depends on the clock, its value at a given step must not
        assert [e[1] for e in other.evals] == [e[1] for e in alone.evals] == [0, 12]
        assert [e[2] for e in other.evals] == [e[2] for e in alone.evals]
        assert other.final_ranks == alone.final_ranks


class _NoCompile:
    """Stands in for compile_policy.compile_blocks: the probe's paths run, the blocks stay eager (no Inductor), and
    the blocks are marked compiled as ``compile_regions`` marks them, so the rank hook acts as under a compile."""

    def __init__(self, model):
        from comera_fx.runtime.compiled import mark_compiled

        mark_compiled(model.blocks, regional=True)

    def graphs(self):
        return 1


def test_a_run_that_may_compile_ends_stored_at_its_live_ranks(monkeypatch):
    """A run that compiles (``--compile yes``) holds its stored cores wider than the live ranks while it trains
    (``BudgetConfig``'s defaults for a compiled model: fewer recompiles). After training the demo shrinks them to the
    live ranks, which changes the stored size and not the model's function: the validation loss after the shrink is
    the run's last one."""
    import torch

    demo = load_demo()
    monkeypatch.setattr(demo.compile_policy, "compile_blocks", _NoCompile)
    # the probe "compiles" after one eager step, before the schedule's first prune point (step 2 of 12), as in the
    # demo's 120 s run (8 eager steps, first prune after 10 % of the clock)
    monkeypatch.setattr(
        demo.compile_policy, "CompileProbe", functools.partial(demo.compile_policy.CompileProbe, eager_steps=1)
    )
    args, p = demo.parse_args(
        [
            "--preset",
            "tiny",
            "--budget-seconds",
            "100",
            "--max-steps",
            "12",
            "--compile",
            "yes",
            "--keep-fraction",
            "0.3",
            "--quiet",
        ]
    )
    device = torch.device("cpu")
    train_data, val_data, _ = demo.load_stdlib(p.data_bytes)
    val_set = [demo.get_batch(val_data, p.batch, p.seq_len, torch.Generator().manual_seed(3), device)]
    torch.manual_seed(args.seed)
    model = demo.GPT(p)
    result = demo.RunResult("comera_fx")
    optimizer, hook, _, _ = demo.prepare_tt_run(model, p, args, train_data, device, result)
    held_wider = []
    for _ in demo.training_steps("comera_fx", model, optimizer, hook, train_data, val_set, p, args, device, result):
        held_wider.append(hook.stored_tt_params() > hook.live_tt_params())
    assert result.steps == 12 and held_wider[-1], "the test needs a run whose last prune kept slack"
    before, after = result.shrunk_after_training
    assert after == hook.stored_tt_params() == hook.live_tt_params() < before
    assert result.linear_params_end < result.linear_params_start
    assert demo.evaluate(model, val_set) == pytest.approx(result.final_val, rel=1e-5)
