"""Calibrate the planner's cost weights (comera_fx/tt/plan/) on this machine.

The planner scores a contraction plan as ``FLOPs + alpha * bytes_moved + beta * bytes_saved``. ``alpha`` converts
memory traffic into FLOP-equivalents: how many FLOPs the machine does in the time it moves one byte to or from
main memory. So it is measured, not chosen:

* GEMM rate: square fp32 ``torch.mm`` (large enough to be compute bound), FLOPs = 2·n³.
* Bandwidth: ``dst.copy_(src)`` on buffers far larger than the caches; bytes = read + write = 2·nbytes.
* Each figure is the best run (of ``--repeat`` runs, two sizes and ``--rounds`` interleaved rounds): on a shared
  machine, other work only ever slows a run down, so the best run is the closest to what the hardware does.
* ``alpha = gemm_rate / bandwidth`` (FLOPs per byte).
* Per-GEMM overhead: the time of a tiny GEMM, where the arithmetic is negligible and only the launch (dispatch,
  autograd bookkeeping, the executor's reshapes) is left. Measured as forward + backward of a chain of
  ``(4 × 4) @ (4 × 4)`` steps through reshapes, like ``execute`` runs them, divided by the GEMMs launched (one
  forward and two backward per step). ``gamma = overhead * gemm_rate`` (FLOP-equivalents per GEMM). A bare
  ``torch.mm`` without autograd is printed for reference.

``beta`` is not a time: bytes kept alive for backward cost memory, not seconds (their write and later read are
already in ``alpha``'s traffic). It is a policy weight — see the planner's docstring — so this script only prints
the ratio that the default corresponds to.

Usage::

    python benchmarks/calibrate_plan_cost.py [--threads 2] [--repeat 7] [--rounds 3] [--check]

Prints the measured figures and the constants to paste into plan/cost.py (with today's date). ``--check`` then times
forward + backward of every plan on the envelope of CoMERA's 768² and 768×3072 layers at a few batch sizes and
prints the planner's predicted time (cost / GEMM rate) next to the measured one.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch

from comera_fx.tt import TTFormat, TTLayout
from comera_fx.tt import plan as planner
from comera_fx.tt.decompose import random_tt_cores

COMERA_LAYERS = {
    "768x768": TTLayout(TTFormat.TT, 768, 768, (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1)),
    "768x3072": TTLayout(TTFormat.TT, 768, 3072, (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1)),
}


def _best_seconds(fn, repeat: int) -> float:
    """Best wall time of ``fn()`` over ``repeat`` runs after one warm-up (the least disturbed run)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_flop_rate(n: int, repeat: int) -> float:
    """FLOP/s of an (n × n) @ (n × n) fp32 matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), repeat)
    return 2.0 * n**3 / seconds


def copy_bandwidth(n_bytes: int, repeat: int) -> float:
    """Bytes/s of a large fp32 copy: every byte is read once and written once."""
    src = torch.randn(n_bytes // 4)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeat)
    return 2.0 * src.numel() * 4 / seconds


def skinny_gemm_rate(tokens: int, k: int, n: int, repeat: int) -> float:
    """FLOP/s of a (tokens × k) @ (k × n) matmul — the shape of a TT step like x·L; shown for reference."""
    a, b = torch.randn(tokens, k), torch.randn(k, n)
    seconds = _best_seconds(lambda: torch.mm(a, b), repeat)
    return 2.0 * tokens * k * n / seconds


def tiny_gemm_seconds(repeat: int, steps: int = 32) -> tuple[float, float]:
    """(seconds per GEMM launched in an autograd chain of tiny steps, seconds of one bare tiny torch.mm)."""
    a = torch.randn(4, 4, requires_grad=True)
    mats = [torch.randn(4, 4, requires_grad=True) for _ in range(steps)]

    def chain():
        t = a
        for m in mats:
            t = torch.mm(t.reshape(4, 4), m).reshape(2, 8)
        t.sum().backward()

    chained = _best_seconds(chain, repeat) / (3 * steps)
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def bare():
        for _ in range(steps):
            torch.mm(x, y)

    return chained, _best_seconds(bare, repeat) / steps


def fwd_bwd_seconds(chosen: planner.Plan, layout: TTLayout, batch: int, repeat: int) -> float:
    """Median wall time of forward + backward of one plan (x and cores need gradients), fp32."""
    cores = [c.requires_grad_() for c in random_tt_cores(layout.core_shapes, 0.1)]
    x = torch.randn(batch, layout.rows, requires_grad=True)

    def run():
        planner.execute(chosen, x, cores, layout).sum().backward()

    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_plans(flop_rate: float, alpha: float, gamma: float, repeat: int) -> None:
    """Predicted (cost / GEMM rate) vs measured fwd+bwd time of each envelope plan of CoMERA's layers."""
    print(
        f"\nplan check: predicted = cost / {flop_rate / 1e9:.1f} GFLOP/s with alpha = {alpha:.2f}, gamma = {gamma:.3g}"
    )
    for name, layout in COMERA_LAYERS.items():
        result = planner.plan(layout, alpha=round(alpha, 2), gamma=int(round(gamma, -3)))
        for batch in (1, 8, 64, 512, 4096):
            winner = result.choose(batch)
            for chosen in result.plans:
                predicted = float(chosen.cost(batch)) / flop_rate
                measured = fwd_bwd_seconds(chosen, layout, batch, repeat)
                mark = "*" if chosen == winner else " "
                print(
                    f"{name} b={batch:<5} {mark} {str(chosen):32} predicted {predicted * 1e3:8.3f} ms  "
                    f"measured {measured * 1e3:8.3f} ms"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="time CoMERA's envelope plans against predictions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rates, bandwidths, skinny_rates, overheads, bare_overheads = [], [], [], [], []
    for _ in range(args.rounds):  # interleaved, so a burst of other load cannot spoil one figure only
        rates += [gemm_flop_rate(n, args.repeat) for n in (1024, 2048)]
        bandwidths += [copy_bandwidth(n, args.repeat) for n in (256 << 20, 512 << 20)]
        skinny_rates.append(skinny_gemm_rate(4096, 768, 30, args.repeat))
        chained, bare = tiny_gemm_seconds(args.repeat)
        overheads.append(chained)
        bare_overheads.append(bare)
    flop_rate, bandwidth, skinny = max(rates), max(bandwidths), max(skinny_rates)
    alpha = flop_rate / bandwidth
    overhead = min(overheads)
    gamma = overhead * flop_rate

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(
        f"GEMM rate (square 1024/2048, each round): {', '.join(f'{r / 1e9:.1f}' for r in rates)} GFLOP/s "
        f"-> best {flop_rate / 1e9:.1f}"
    )
    print(f"skinny GEMM 4096x768 @ 768x30: {skinny / 1e9:.1f} GFLOP/s (reference only)")
    print(
        f"copy bandwidth (256/512 MiB, each round): {', '.join(f'{b / 1e9:.2f}' for b in bandwidths)} GB/s "
        f"-> best {bandwidth / 1e9:.2f}"
    )
    print(f"alpha = {alpha:.2f} FLOPs per byte")
    print(
        f"tiny GEMM in an autograd chain (each round): {', '.join(f'{o * 1e6:.2f}' for o in overheads)} us per "
        f"GEMM launched -> best {overhead * 1e6:.2f}; bare torch.mm {min(bare_overheads) * 1e6:.2f} us"
    )
    print(f"gamma = {gamma:.3g} FLOP-equivalents per GEMM")
    print()
    print(
        f"# Calibrated by benchmarks/calibrate_plan_cost.py on {datetime.date.today().isoformat()} "
        f"({args.threads} threads, torch {torch.__version__}):"
    )
    print(f"# GEMM {flop_rate / 1e9:.1f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.2f} GB/s.")
    print(f"# Tiny GEMM (fwd + bwd autograd chain) {overhead * 1e6:.2f} us per GEMM launched.")
    print(f"DEFAULT_ALPHA = {alpha:.1f}")
    print(f"DEFAULT_GAMMA = {int(round(gamma, -3))}")
    if args.check:
        check_plans(flop_rate, alpha, gamma, args.repeat)


if __name__ == "__main__":
    main()
