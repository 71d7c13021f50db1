"""Issue 11 item 4: RankAdaptive's budget schedule under ``torch.compile(model, backend=comera_fx backend)``.

A small MLP of TT linears trains for ``--steps`` steps while the budget schedule prunes at ``--prunes`` points.
Each prune changes the core shapes, so Dynamo's shape guards fail once and the changed graph is recompiled: static
shapes, one recompile per prune (dynamic rank dimensions were not tried). Prints, per step: the time, the backend's graph count, and whether the step pruned;
then the recompile cost (steps after a prune minus the median step) and the largest difference between the
compiled and the eager model's outputs after the last prune.

    .venv/bin/python benchmarks/bench_recompile.py                 # Inductor (minutes on 2 cores)
    .venv/bin/python benchmarks/bench_recompile.py --no-inductor   # AOTAutograd graphs run eagerly (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import comera_fx
from comera_fx.backend import make_backend
from comera_fx.runtime import RankAdaptive


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prunes", type=int, default=3)
    ap.add_argument("--no-inductor", action="store_true")
    opts = ap.parse_args(argv)
    torch.manual_seed(0)
    d = opts.width
    model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=16, min_numel=1, min_dim=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = RankAdaptive(model, optimizer, target_ratio=0.4, total_steps=opts.steps, prunes=opts.prunes)
    backend = make_backend(inductor=not opts.no_inductor)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    x, y = torch.randn(opts.batch, d), torch.randn(opts.batch, d)
    rows = []
    for step in range(1, opts.steps + 1):
        t0 = time.perf_counter()
        loss = ((compiled(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rows.append((step, time.perf_counter() - t0, backend.stats.graphs, bool(hook.history[-1].shrunk)))
    base = statistics.median(t for _, t, _, _ in rows[2:])
    print(f"{'step':>4} {'s':>7} graphs pruned")
    for step, t, graphs, pruned in rows:
        print(f"{step:4d} {t:7.3f} {graphs:6d} {'yes' if pruned else ''}")
    prune_steps = [s for s, _, _, p in rows if p]
    extra = [rows[s][1] - base for s in prune_steps if s < len(rows)]  # the step after each prune recompiles
    print(f"median step {base:.3f} s; prunes at {prune_steps}; graphs compiled {backend.stats.graphs} "
          f"(first compile + {backend.stats.graphs - 1} recompiles); extra seconds of the step after each prune: "
          + ", ".join(f"{e:.2f}" for e in extra) + f"; backend compile_seconds {backend.stats.compile_seconds:.1f}")
    with torch.no_grad():
        diff = (compiled(x) - model(x)).abs().max().item()
    print(f"ranks {[m.tt.ranks for m in hook.matrices]}; TT params {hook.tt_params()} (target "
          f"{hook.target_size:.0f}); max |compiled - eager| = {diff:.2e}")


if __name__ == "__main__":
    main()
