"""The six b-dependent GEMMs of a two-factor TT layer at each bond width (why ``kernel_rank`` pads the bond).

At large batches the planner's order for a TT linear is CoMERA's merged halves, y = (x·L)·R with L (in × r) and
R (r × out); its backward adds dt = dy·Rᵀ, dR = tᵀ·dy, dx = dt·Lᵀ and dL = xᵀ·dt. Those six GEMMs are all the
b-dependent work. This times each alone with plain ``torch.mm`` at every width ``r`` (no comera_fx code), outputs
of dx and y written into reused buffers (so first-touch page faults, which are the same at every width, stay out),
the two weight gradients in the faster of their two orientations, as the planned backward runs them.
``comera_fx.tt.plan.autograd.kernel_rank`` reads this table: on CPU a width that is a multiple of 8 and at least
16 runs the six faster than most smaller or odd widths.

Usage::

    .venv/bin/python benchmarks/investigations/bench_rank_widths.py        # 4096 × 768 -> 768, r = 4..40
    .venv/bin/python benchmarks/investigations/bench_rank_widths.py --shape 4096x768x3072 --ranks 16,30,32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# No OpenMP wait policy is set here: libgomp's default (spin briefly, then sleep) is what users run, and
# OMP_WAIT_POLICY=PASSIVE adds ~0.1 ms to every short parallel region, which a TT layer has many more of than
# a dense one (benchmarks/RESULTS.md, "The OpenMP wait policy"). Time on a quiet machine.

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from common import loadavg, median_ms, openmp_setting  # noqa: E402


RANKS = "4,7,8,11,12,13,16,20,24,28,30,32,40"


def six_gemms(tokens: int, n_in: int, n_out: int, rank: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(rank)
    x, dy = torch.randn(tokens, n_in, generator=gen), torch.randn(tokens, n_out, generator=gen)
    left, right = torch.randn(n_in, rank, generator=gen), torch.randn(rank, n_out, generator=gen)
    t, dt = x @ left, dy @ right.t()
    y_buffer, dx_buffer = torch.empty(tokens, n_out), torch.empty(tokens, n_in)
    times = {
        "t = x·L": median_ms(lambda: x @ left, repeats),
        "y = t·R": median_ms(lambda: torch.mm(t, right, out=y_buffer), repeats),
        "dt = dy·Rᵀ": median_ms(lambda: dy @ right.t(), repeats),
        "dR = tᵀ·dy": min(median_ms(lambda: t.t() @ dy, repeats), median_ms(lambda: (dy.t() @ t).t(), repeats)),
        "dx = dt·Lᵀ": median_ms(lambda: torch.mm(dt, left.t(), out=dx_buffer), repeats),
        "dL = xᵀ·dt": min(median_ms(lambda: x.t() @ dt, repeats), median_ms(lambda: (dt.t() @ x).t(), repeats)),
    }
    times["sum"] = sum(times.values())
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x768x768", help="TOKENSxINxOUT")
    parser.add_argument("--ranks", default=RANKS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens, n_in, n_out = (int(v) for v in args.shape.split("x"))
    print(
        f"torch {torch.__version__}, {args.threads} threads, {tokens} tokens, {n_in} -> {n_out}, "
        f"{openmp_setting()}, load "
        f"{loadavg()}"
    )
    rows = [(rank, six_gemms(tokens, n_in, n_out, int(rank), args.repeats)) for rank in args.ranks.split(",")]
    names = list(rows[0][1])
    print("| r | " + " | ".join(names) + " | per unit of r |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for rank, times in rows:
        cells = " | ".join(f"{times[name]:.2f}" for name in names)
        print(f"| {rank} | {cells} | {times['sum'] / int(rank):.3f} |", flush=True)
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
