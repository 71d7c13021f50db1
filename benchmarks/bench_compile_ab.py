"""Does compiling pay for the demo's comera_fx run? The same run compiled and eager, interleaved in one process.

Issue 30 item 4 asks that, at ``--budget-seconds 600``, the demo's comera_fx run on the compiled path reach a lower
validation loss than the same run eagerly. With the same seed and batches the two runs follow nearly the same
trajectory, so the one that takes more steps in its budget ends lower: the comparison is one of steps per budget.
Run one after the other (``bench_equal_time.py --compile yes`` then ``--compile no``), the two runs see a shared
machine at different speeds, and on this 2-core VM the eager step's speed moved by more between two such runs (8 %)
than compiling gains (about 10 % per step, less the compile). So this script trains both runs in one process, in
alternating slices of ``--slice-seconds`` of each run's own training clock: whatever the machine does over the
twenty minutes, each run meets it for half of every minute or so. Each run keeps its own clock (its compile and
recompile on it, validation off it), its own optimizer, ``RankAdaptive`` hook and batch generator, exactly as
``examples/train_code_lm.py`` builds them (``prepare_tt_run``, ``training_steps``).

The report gives each run's steps, final validation loss, compile figures (path, compile seconds, graphs,
recompiles) and the steps each took in every slice round, so the drift the two shared can be read off.

Usage::

    .venv/bin/python benchmarks/bench_compile_ab.py --budget-seconds 600          # ~22 minutes
    .venv/bin/python benchmarks/bench_compile_ab.py --modes auto,no               # the demo's default policy
    .venv/bin/python benchmarks/bench_compile_ab.py --budget-seconds 30 --slice-seconds 5   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime

import common  # noqa: E402  (torch-free; benchmarks/ is this script's sys.path[0])

common.use_this_checkout()
import openmp_policy  # noqa: E402  (torch-free)

WAIT_POLICY = openmp_policy.choose_wait_policy()  # before torch loads OpenMP, as the demo does

import torch  # noqa: E402

import train_code_lm as demo  # noqa: E402
from common import OthersMeter, loadavg, write_record  # noqa: E402

MODES = ("auto", "yes", "no")


def build_run(mode: str, opts, p: demo.Preset, train_data, val_set, device):
    """One comera_fx run of the demo with ``--compile mode``: (result, step generator, hook)."""
    argv = [
        "--budget-seconds",
        str(opts.budget_seconds),
        "--eval-every",
        str(opts.eval_every),
        "--seed",
        str(opts.seed),
        "--max-rank",
        str(opts.rank),
        "--compile",
        mode,
        "--quiet",
    ]
    args, _ = demo.parse_args(argv)
    torch.manual_seed(args.seed)
    model = demo.GPT(p).to(device)  # every run starts from the same initial model
    result = demo.RunResult(f"comera_fx, --compile {mode}")
    optimizer, hook, _, _ = demo.prepare_tt_run(model, p, args, train_data, device, result)
    steps = demo.training_steps(result.name, model, optimizer, hook, train_data, val_set, p, args, device, result)
    return result, steps, hook


def interleave(runs: dict, slice_seconds: float) -> list[dict]:
    """Advance every run by ``slice_seconds`` of its own training clock in turn until all are done; return the
    steps each took in each round (the order within a round alternates, so neither run always follows the other's
    cache footprint)."""
    rounds = []
    live = dict(runs)
    boundary = slice_seconds
    order = list(live)
    while live:
        taken = {}
        for name in order:
            if name not in live:
                continue
            result, steps, _ = live[name]
            before = result.steps
            try:
                while result.train_seconds < boundary:
                    next(steps)
            except StopIteration:
                del live[name]
            taken[name] = result.steps - before
        rounds.append(taken)
        boundary += slice_seconds
        order.reverse()
    return rounds


def summary(mode: str, result: demo.RunResult, hook) -> dict:
    """One run's figures, JSON-ready."""
    return {
        "name": result.name,
        "mode": mode,
        "steps": result.steps,
        "train_seconds": result.train_seconds,
        "final_val": result.final_val,
        "evals": result.evals,
        "compile": result.compile,
        "linear_params_end": result.linear_params_end,
        "tt_params_end": hook.live_tt_params(),
        "target_tt_params": result.target_params,
    }


def report(results: list[dict], rounds: list[dict]) -> str:
    lines = [
        "| run | steps | final val loss (nats/byte) | path | compile | stored linear params at the end |",
        "|---|---:|---:|---|---|---:|",
    ]
    for r in results:
        c = r["compile"]
        compiled = "—"
        if "compile_s" in c:
            # the probe's paired ratio: the run's medians would set the whole run's compiled steps against eager
            # ones from its first minute, across the machine's drift
            compiled = f"{c['compile_s']:.1f} s, {c['graphs']} graph(s), {c['recompiles']} recompile(s)"
            if "probe_pairs" in c:
                compiled += f", probe {c['probe_speedup']:.2f}x over {c['probe_pairs']} pairs"
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['final_val']:.4f} | {c['path']} | {compiled} | "
            f"{r['linear_params_end']:,} |"
        )
    modes = [r["mode"] for r in results]
    lines += [
        "",
        f"Steps per slice round ({' / '.join(modes)}): "
        + "; ".join("/".join(str(rnd.get(m, 0)) for m in modes) for rnd in rounds),
    ]
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budget-seconds", type=float, default=600.0, help="training wall clock per run")
    ap.add_argument(
        "--eval-every", type=float, default=None, help="seconds of training between validations (default: budget / 8)"
    )
    ap.add_argument("--modes", default="yes,no", help=f"--compile of each run, comma-separated ({', '.join(MODES)})")
    ap.add_argument(
        "--slice-seconds", type=float, default=15.0, help="training seconds a run takes before the next run's turn"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=16, help="TT max rank")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write every measurement here")
    opts = ap.parse_args(argv)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if len(modes) < 2 or len(set(modes)) != len(modes) or any(m not in MODES for m in modes):
        ap.error(f"--modes takes two or more distinct modes of {MODES}; got {opts.modes!r}")
    if opts.slice_seconds <= 0:
        ap.error("--slice-seconds must be positive")
    opts.modes = modes
    if opts.eval_every is None:
        opts.eval_every = max(opts.budget_seconds / 8, 1.0)
    return opts


def main(argv=None) -> dict:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    started = datetime.now()
    print(
        f"{started:%Y-%m-%d %H:%M:%S}  load {loadavg()}  torch {torch.__version__}  threads "
        f"{torch.get_num_threads()}  budget {opts.budget_seconds:g} s per run  modes {opts.modes}  "
        f"{WAIT_POLICY}",
        flush=True,
    )
    _, p = demo.parse_args([])
    device = torch.device("cpu")
    train_data, val_data, _ = demo.load_stdlib(p.data_bytes)
    val_gen = torch.Generator().manual_seed(1234)  # bench_equal_time's validation batches
    val_set = [demo.get_batch(val_data, p.batch, p.seq_len, val_gen, device) for _ in range(p.val_batches)]
    runs = {mode: build_run(mode, opts, p, train_data, val_set, device) for mode in opts.modes}
    load_start, meter, wall = loadavg(), OthersMeter().start(), time.perf_counter()
    rounds = interleave(runs, opts.slice_seconds)
    wall, others, load_end = time.perf_counter() - wall, meter.stop(), loadavg()
    results = [summary(mode, result, hook) for mode, (result, _, hook) in runs.items()]
    text = report(results, rounds)
    print("\n" + text)
    print(
        f"\nfinished {datetime.now():%Y-%m-%d %H:%M:%S} ({wall:.0f} s), load {load_start} → {load_end}, other "
        f"processes {others:.2f} cores (Inductor's compile workers among them)"
    )
    if opts.json:
        write_record(
            opts.json,
            openmp=WAIT_POLICY,
            budget_seconds=opts.budget_seconds,
            slice_seconds=opts.slice_seconds,
            results=results,
            rounds=rounds,
            wall_seconds=wall,
            load_start=load_start,
            load_end=load_end,
            others_cores=others,
        )
    return {"results": results, "rounds": rounds}


if __name__ == "__main__":
    main()
