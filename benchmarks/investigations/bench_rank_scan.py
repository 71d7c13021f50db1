"""Does one TT linear's training time follow its FLOPs, and the planner's modelled cost, as its max rank drops?

Issue 30 item 3 asks a pruned model's compiled step to shrink with its FLOPs. This isolates one layer: a
``TTLinear`` (``tensorize_`` of an ``nn.Linear`` at each ``--ranks``), forward + backward at ``--tokens`` rows,
eager (the planned contraction, the same GEMMs the compiled graph calls), timed with the columns interleaved and
rotated. Per cell: the ranks, forward + backward FLOPs (``torch.utils.flop_counter``), the planner's weighted cost
at that batch (FLOPs + α·bytes + γ·GEMMs, ``comera_fx.plan``) and the median time.

    flock /tmp/timing.lock .venv/bin/python benchmarks/investigations/bench_rank_scan.py
    .venv/bin/python benchmarks/investigations/bench_rank_scan.py --shapes 768x3072 --ranks 32 8 --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()

import comera_fx  # noqa: E402


def tt_layer(n_in: int, n_out: int, rank: int) -> nn.Module:
    holder = nn.Sequential(nn.Linear(n_in, n_out))
    comera_fx.tensorize_(holder, comera_fx.TensorizeConfig(max_rank=rank, min_numel=1))
    return holder[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["512x2048", "2048x512"], help="IN x OUT of each layer")
    ap.add_argument("--ranks", type=int, nargs="+", default=[32, 16, 12, 8, 4])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    columns, cells = {}, {}
    for shape in args.shapes:
        n_in, n_out = (int(v) for v in shape.split("x"))
        x = torch.randn(args.tokens, n_in, requires_grad=True)
        for rank in args.ranks:
            layer = tt_layer(n_in, n_out, rank)

            def fwd_bwd(layer=layer, x=x):
                layer(x).sum().backward()

            with FlopCounterMode(display=False) as counter:
                fwd_bwd()
            cost = comera_fx.plan(layer, batch=args.tokens).choose(args.tokens).cost(args.tokens)
            name = f"{shape} r{rank}"
            columns[name] = fwd_bwd
            cells[name] = (layer.tt.ranks, counter.get_total_flops(), float(cost))
    seconds = common.time_rotated(columns, repeats=args.rounds, inner=args.inner)
    print(f"{args.tokens} tokens, threads {args.threads}, load {common.loadavg()}, {common.openmp_setting()}")
    print(f"{'layer':16s} {'ranks':28s} {'FLOPs':>9s} {'model cost':>10s} {'ms':>7s}")
    for name, (ranks, flops, cost) in cells.items():
        print(f"{name:16s} {str(ranks):28s} {flops:9.3g} {cost:10.3g} {1e3 * seconds[name]:7.2f}")
    for shape in args.shapes:
        top, low = f"{shape} r{args.ranks[0]}", f"{shape} r{args.ranks[-1]}"
        print(
            f"{shape}: r{args.ranks[-1]} / r{args.ranks[0]}: FLOPs {cells[low][1] / cells[top][1]:.2f}, model cost "
            f"{cells[low][2] / cells[top][2]:.2f}, time {seconds[low] / seconds[top]:.2f}"
        )


if __name__ == "__main__":
    main()
