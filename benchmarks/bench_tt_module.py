"""The TT layer as users call it: ``TTLinear`` *with bias* against ``nn.Linear`` with bias, forward + backward.

``bench_tt_linear.py`` times the planner's orders on raw cores without bias; real models have a bias, and the module
is what ``tensorize_`` puts in them. Here, per shape, one process, columns interleaved (each round times every column
once, in a rotated order, ``--repeats`` rounds, median reported):

* ``dense``       — ``nn.Linear(in, out)`` (bias fused into addmm by aten);
* ``tt``          — ``TTLinear`` as shipped (random init at the shape's rank, gates = 1, custom planned autograd): the
                    bond between the two factors padded to ``kernel_rank`` on CPU, the bias carried in its spare
                    slice (``autograd.PAD_RANKS`` / ``BIAS_IN_GEMM``), else folded into addmm;
* ``tt_addmm``    — padded, the bias through addmm (``BIAS_IN_GEMM = False``);
* ``tt_unpadded`` — neither (``PAD_RANKS = False``): the true rank, the bias through addmm (the previous default);
* ``tt_no_bias``  — the shipped module's cores without bias (what ``bench_tt_linear.py`` measures).

Each step is ``y = layer(x); y.backward(dy)`` with a real (random) dy and x requiring grad. Ratios are dense time
over TT time (> 1: TT faster). ``--ranks`` adds the pruned-rank check: the 768×768 layer at each rank, time per
planned FLOP (of the true rank) relative to rank 16 (the issue's "pruned ranks no slower per FLOP than 16"), padded
as shipped and unpadded.

Usage::

    flock /tmp/comera_timing.lock .venv/bin/python benchmarks/bench_tt_module.py
    .venv/bin/python benchmarks/bench_tt_module.py --shapes 768x768:30 --repeats 5   # a quick look
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# No OpenMP wait policy is set here: libgomp's default (spin briefly, then sleep) is what users run, and
# OMP_WAIT_POLICY=PASSIVE adds ~0.1 ms to every short parallel region, which a TT layer has many more of than
# a dense one (benchmarks/RESULTS.md, "The OpenMP wait policy"). Time on a quiet machine.

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402  (benchmarks/ is this script's sys.path[0])

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from common import loadavg, openmp_setting, time_rotated  # noqa: E402
from comera_fx.tt import TTLinear, layers  # noqa: E402
from comera_fx.tt.plan import autograd as planned_autograd  # noqa: E402


SHAPES = "4096x4096:32,768x768:30,768x3072:30"
PRUNED_RANKS = "7,11,13,16"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        dims, rank = item.split(":")
        n_in, n_out = dims.split("x")
        shapes.append((int(n_in), int(n_out), int(rank)))
    return shapes


def step_fn(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, pad: bool = True, bias_in_gemm: bool = True):
    def run() -> None:
        planned_autograd.PAD_RANKS, planned_autograd.BIAS_IN_GEMM = pad, bias_in_gemm
        try:
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            layer(x).backward(dy)
        finally:
            planned_autograd.PAD_RANKS = planned_autograd.BIAS_IN_GEMM = True

    return run


def tt_pair(n_in: int, n_out: int, rank: int, seed: int) -> tuple[nn.Linear, TTLinear, TTLinear]:
    torch.manual_seed(seed)
    dense = nn.Linear(n_in, n_out)
    tt = TTLinear.from_dense(dense, init="random", max_rank=rank)
    no_bias = TTLinear(tt.tt, None)
    return dense, tt, no_bias


def measure_shape(n_in: int, n_out: int, rank: int, tokens: int, repeats: int, seed: int) -> dict:
    dense, tt, no_bias = tt_pair(n_in, n_out, rank, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, n_in, generator=gen).requires_grad_()
    dy = torch.randn(tokens, n_out, generator=gen)
    chosen = layers.choose_plan(layers.planned_envelope(tt.tt.layout, "matmul", device=tt.tt.device), tokens)
    inner = 1 if n_in * n_out > 4_000_000 else 3
    times = time_rotated(
        {
            "dense": step_fn(dense, x, dy),
            "tt": step_fn(tt, x, dy),
            "tt_addmm": step_fn(tt, x, dy, bias_in_gemm=False),
            "tt_unpadded": step_fn(tt, x, dy, pad=False, bias_in_gemm=False),
            "tt_no_bias": step_fn(no_bias, x, dy),
        },
        repeats,
        inner,
    )
    dense_flops = 3 * 2 * tokens * n_in * n_out
    return dict(
        shape=f"{n_in}x{n_out}",
        rank=rank,
        ranks=list(tt.tt.ranks),
        tokens=tokens,
        padded_rank=planned_autograd.plan_runner(chosen).padded_rank(x),
        bias_in_gemm=planned_autograd.plan_runner(chosen).bias_in_gemm(x, tt.bias),
        folds=planned_autograd.folds_bias(chosen),
        seconds=times,
        flop_ratio=dense_flops / float(chosen.flops(tokens, backward=True)),
        speedup={name: times["dense"] / t for name, t in times.items() if name != "dense"},
    )


def measure_pruned(ranks: list[int], tokens: int, repeats: int, seed: int) -> list[dict]:
    """The 768×768 layer (with bias) at each rank, padded and unpadded: seconds per planned GFLOP of the true rank
    (forward + backward), interleaved."""
    columns, flops, modules = {}, {}, {}
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(tokens, 768, generator=gen).requires_grad_()
    dy = torch.randn(tokens, 768, generator=gen)
    for rank in ranks:
        _, tt, _ = tt_pair(768, 768, rank, seed)
        chosen = layers.choose_plan(layers.planned_envelope(tt.tt.layout, "matmul", device=tt.tt.device), tokens)
        for padded in (True, False):
            name = f"r{rank}" + ("" if padded else "_unpadded")
            columns[name] = step_fn(tt, x, dy, pad=padded, bias_in_gemm=padded)
            flops[name], modules[name] = chosen.flops(tokens, backward=True), tt
    times = time_rotated(columns, repeats, 3)
    rows = []
    for name, seconds in times.items():
        rows.append(
            dict(
                rank=int(name[1:].split("_")[0]),
                padded=not name.endswith("_unpadded"),
                ranks=list(modules[name].tt.ranks),
                seconds=seconds,
                gflops=float(flops[name]) / 1e9,
                s_per_gflop=seconds / (float(flops[name]) / 1e9),
            )
        )
    for row in rows:
        reference = next((r for r in rows if r["rank"] == 16 and r["padded"] == row["padded"]), rows[-1])
        row["per_flop_vs_16"] = row["s_per_gflop"] / reference["s_per_gflop"]
        row["time_vs_16"] = row["seconds"] / reference["seconds"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma list of INxOUT:RANK")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ranks", default=PRUNED_RANKS, help="pruned-rank check at 768x768 ('' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.tokens} tokens, {openmp_setting()}, load {loadavg()}"
    )
    results = {"shapes": [], "pruned": []}
    print(
        "| shape | rank (padded) | bias | dense ms | TT ms | addmm ms | unpadded ms | no-bias ms | dense/TT "
        "| dense/addmm | dense/unpadded | dense/no-bias | FLOP ratio |"
    )
    print("|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n_in, n_out, rank in parse_shapes(args.shapes):
        r = measure_shape(n_in, n_out, rank, args.tokens, args.repeats, args.seed)
        results["shapes"].append(r)
        t, s = r["seconds"], r["speedup"]
        where = "in GEMM" if r["bias_in_gemm"] else ("addmm" if r["folds"] else "add")
        print(
            f"| {r['shape']} | {rank} ({r['padded_rank']}) | {where} | {t['dense'] * 1e3:.2f} | "
            f"{t['tt'] * 1e3:.2f} | {t['tt_addmm'] * 1e3:.2f} | {t['tt_unpadded'] * 1e3:.2f} | "
            f"{t['tt_no_bias'] * 1e3:.2f} | {s['tt']:.2f}x | {s['tt_addmm']:.2f}x | {s['tt_unpadded']:.2f}x | "
            f"{s['tt_no_bias']:.2f}x | {r['flop_ratio']:.1f}x |",
            flush=True,
        )
    if args.ranks:
        ranks = [int(r) for r in args.ranks.split(",")]
        results["pruned"] = measure_pruned(ranks, args.tokens, args.repeats, args.seed)
        print(
            "\n| rank (768x768) | padded | bond ranks | ms | time vs rank 16 | planned GFLOP | ms per GFLOP "
            "| per FLOP vs rank 16 |"
        )
        print("|---:|:---:|---|---:|---:|---:|---:|---:|")
        for row in results["pruned"]:
            print(
                f"| {row['rank']} | {'yes' if row['padded'] else 'no'} | {row['ranks']} | "
                f"{row['seconds'] * 1e3:.2f} | {row['time_vs_16']:.2f} | {row['gflops']:.3f} | "
                f"{row['s_per_gflop'] * 1e3:.1f} | {row['per_flop_vs_16']:.2f} |"
            )
    print(f"load after: {loadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
