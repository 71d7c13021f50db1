"""What a TT layer's fresh outputs cost on this machine: first-touch page faults, and huge pages after a free.

A TT layer's y = t·R and dx = dt·Lᵀ are GEMMs with K = rank: little arithmetic, a large b × n output. Three tables:

0. The rate of the six b-dependent GEMMs of a two-factor plan (x·L, t·R, dY·Rᵀ, tᵀ·dY, dt·Lᵀ, xᵀ·dt; b × n × rank,
   n × n layer), each into a warm output, as a share of the layer's dense GEMM's rate (b × n × n): what is left
   without faults (``bench_rank_widths.py`` times the same six across bond widths).
1. ``torch.mm(t, R)`` (b × rank times rank × n) into a fresh output against the same GEMM into a warm one
   (``out=``), with the minor page faults per call: the allocator's share of the layer's time.
2. First touch of a fresh 64 MiB tensor right after freeing 1 GiB and again ``--wait`` seconds later, with 4 KiB
   pages and with the tensor's 2 MiB-aligned interior advised ``MADV_HUGEPAGE`` (Linux). On a VM whose balloon
   reports free pages to the host, blocks freed a while ago come back only through host faults, and a huge-page
   fault touches 512 of them at once (benchmarks/RESULTS.md, "why huge pages lose on this VM").

Usage::

    python benchmarks/investigations/bench_first_touch.py              # all three tables, ~1 minute
    python benchmarks/investigations/bench_first_touch.py --no-advise  # tables 0 and 1
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from common import loadavg, median_ms  # noqa: E402

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gemm_output_cost(tokens: int, n_out: int, rank: int, calls: int) -> dict:
    """Median ms of ``t @ R`` into a fresh output and into a warm ``out=``, and the faults per fresh call."""
    t, right = torch.randn(tokens, rank), torch.randn(rank, n_out)
    warm = torch.empty(tokens, n_out)
    fresh_ms, warm_ms, faults = [], [], []
    for _ in range(3):  # warm-up of both paths
        torch.mm(t, right)
        torch.mm(t, right, out=warm)
    for _ in range(calls):
        before, start = _minor_faults(), time.perf_counter()
        y = torch.mm(t, right)
        fresh_ms.append((time.perf_counter() - start) * 1e3)
        faults.append(_minor_faults() - before)
        del y
        start = time.perf_counter()
        torch.mm(t, right, out=warm)
        warm_ms.append((time.perf_counter() - start) * 1e3)
    return dict(
        fresh_ms=statistics.median(fresh_ms),
        warm_ms=statistics.median(warm_ms),
        faults=statistics.median(faults),
        pages=tokens * n_out * 4 // 4096,
    )


def gemm_rates(tokens: int, n: int, rank: int, calls: int) -> dict[str, float]:
    """GFLOP/s of the two-factor plan's six GEMMs (warm ``out=``) and of the dense b × n × n GEMM."""
    x, dy, t, dt = torch.randn(tokens, n), torch.randn(tokens, n), torch.randn(tokens, rank), torch.randn(tokens, rank)
    left, right, weight = torch.randn(n, rank), torch.randn(rank, n), torch.randn(n, n)
    wide, narrow, square = torch.empty(tokens, n), torch.empty(tokens, rank), torch.empty(rank, n)
    grad_left = torch.empty(n, rank)
    skinny = 2 * tokens * n * rank / 1e6  # MFLOP per GEMM, so MFLOP / ms = GFLOP/s
    cases = {
        "x·L": (lambda: torch.mm(x, left, out=narrow), skinny),
        "t·R (y)": (lambda: torch.mm(t, right, out=wide), skinny),
        "dY·Rᵀ": (lambda: torch.mm(dy, right.t(), out=narrow), skinny),
        "tᵀ·dY": (lambda: torch.mm(t.t(), dy, out=square), skinny),
        "dt·Lᵀ (dx)": (lambda: torch.mm(dt, left.t(), out=wide), skinny),
        "xᵀ·dt": (lambda: torch.mm(x.t(), dt, out=grad_left), skinny),
        "dense x·W": (lambda: torch.mm(x, weight, out=wide), 2 * tokens * n * n / 1e6),
    }
    return {name: mflop / median_ms(fn, calls) for name, (fn, mflop) in cases.items()}


def _advise_huge(tensor: torch.Tensor) -> None:
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def first_touch_after_free(wait_s: float, huge: bool) -> float:
    """ms to fill a fresh 64 MiB tensor after touching and freeing 1 GiB and sleeping ``wait_s``."""
    freed = torch.ones(256 << 20)
    del freed
    time.sleep(wait_s)
    fresh = torch.empty(16 << 20)
    if huge:
        _advise_huge(fresh)
    start = time.perf_counter()
    fresh.fill_(1.0)
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--widths", default="768,3072,4096", help="n of the b × n outputs")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wait", type=float, default=3.0, help="seconds between the free and the touch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-advise", action="store_true", help="skip the huge-page table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load {loadavg()}")
    widths = [int(w) for w in args.widths.split(",")]
    rates = {n: gemm_rates(args.tokens, n, args.rank, args.calls) for n in widths}
    names = list(rates[widths[0]])
    print(f"\n| GFLOP/s, warm outputs (b {args.tokens}, rank {args.rank}) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for n, row in rates.items():
        dense = row["dense x·W"]
        print(f"| n = {n} | " + " | ".join(f"{v:.0f} ({v / dense:.0%})" for v in row.values()) + " |", flush=True)
    print(
        f"\n| output ({args.tokens} × n, K = {args.rank}) | fresh ms | warm out= ms | fresh / warm "
        "| minor faults per fresh call | 4 KiB pages in it |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for n_out in widths:
        r = gemm_output_cost(args.tokens, n_out, args.rank, args.calls)
        print(
            f"| {args.tokens} × {n_out} | {r['fresh_ms']:.2f} | {r['warm_ms']:.2f} | "
            f"{r['fresh_ms'] / r['warm_ms']:.2f}× | {r['faults']:.0f} | {r['pages']} |",
            flush=True,
        )
    if args.no_advise or not sys.platform.startswith("linux"):
        return
    torch.set_num_threads(1)
    print(f"\n| first touch of 64 MiB, 1 thread | right after freeing 1 GiB, ms | {args.wait:g} s after, ms |")
    print("|---|---|---|")
    for huge in (False, True):
        now = [first_touch_after_free(0.0, huge) for _ in range(args.repeats)]
        later = [first_touch_after_free(args.wait, huge) for _ in range(args.repeats)]
        print(
            f"| {'MADV_HUGEPAGE' if huge else '4 KiB pages'} | {' / '.join(f'{v:.1f}' for v in now)} | "
            f"{' / '.join(f'{v:.1f}' for v in later)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
