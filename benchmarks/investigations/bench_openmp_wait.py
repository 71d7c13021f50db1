"""What OpenMP's wait policy costs per parallel region: short ops of a TT step against a dense layer's GEMM.

libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it, so each policy runs in its own child process (same ops,
same sizes, 2 threads, median of 7 blocks of ``--calls`` calls, 200 by default). The ops: a core-merge GEMM of a TT
layer (12 × 12 × 240), the TT layer's skinny b-dependent GEMM at 1024 tokens (1024 × 768 × 32), a pointwise add over
1M floats (a fused kernel's size), and the dense 1024 × 768 × 768 GEMM the TT layer replaces. A TT step runs hundreds
of the short ones (benchmarks/RESULTS.md, "The OpenMP wait policy"). On a busy machine the spinning policies can take
minutes: run it on an idle one (``--calls 5`` for a smoke run).

Usage::

    python benchmarks/investigations/bench_openmp_wait.py            # ~30 s; on an idle machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

POLICIES = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "default": {}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}


def child(calls: int) -> None:
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(12, 12), torch.randn(12, 240)
    x, w_tt, w = torch.randn(1024, 768), torch.randn(768, 32), torch.randn(768, 768)
    v = torch.randn(1 << 20)
    ops = {
        "12x12x240 mm": lambda: a @ b,
        "1024x768x32 mm": lambda: x @ w_tt,
        "add 1M": lambda: v + 1,
        "1024x768x768 mm": lambda: x @ w,
    }
    for name, op in ops.items():
        for _ in range(min(50, calls)):
            op()
        blocks = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(calls):
                op()
            blocks.append((time.perf_counter() - start) / calls)
        print(f"{name}\t{statistics.median(blocks) * 1e6:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block (7 blocks per op)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one policy's timings
    args = parser.parse_args(argv)
    if args.child:
        child(args.calls)
        return
    print(f"load {os.getloadavg()}")
    results = {}
    for policy, env in POLICIES.items():
        environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--calls", str(args.calls)],
            env={**environ, **env},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[policy] = dict(line.split("\t") for line in out.strip().splitlines())
    ops = list(next(iter(results.values())))
    print("| op | " + " | ".join(f"{p} µs" for p in POLICIES) + " |")
    print("|---|" + "---:|" * len(POLICIES))
    for op in ops:
        print(f"| {op} | " + " | ".join(results[p][op] for p in POLICIES) + " |")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
