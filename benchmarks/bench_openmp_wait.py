"""What OpenMP's wait policy costs per parallel region: short ops of a TT step against a dense layer's GEMM.

libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it, so each policy runs in its own child process (same ops,
same sizes, 2 threads, median of 7 blocks of 200 calls). The ops: a core-merge GEMM of a TT layer (12 × 12 × 240),
the TT layer's skinny b-dependent GEMM at 1024 tokens (1024 × 768 × 32), a pointwise add over 1M floats (a fused
kernel's size), and the dense 1024 × 768 × 768 GEMM the TT layer replaces. A TT step runs hundreds of the short ones
(benchmarks/RESULTS.md, "The OpenMP wait policy").

Usage::

    python benchmarks/bench_openmp_wait.py            # ~30 s; on an idle machine
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
# The policy line of the speed benchmarks' reports (they import it from here); torch-free.
from openmp_policy import current_setting as openmp_setting  # noqa: E402

POLICIES = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "default": {}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}


def child() -> None:
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(12, 12), torch.randn(12, 240)
    x, w_tt, w = torch.randn(1024, 768), torch.randn(768, 32), torch.randn(768, 768)
    v = torch.randn(1 << 20)
    ops = {"12x12x240 mm": lambda: a @ b, "1024x768x32 mm": lambda: x @ w_tt, "add 1M": lambda: v + 1,
           "1024x768x768 mm": lambda: x @ w}
    for name, op in ops.items():
        for _ in range(50):
            op()
        blocks = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(200):
                op()
            blocks.append((time.perf_counter() - start) / 200)
        print(f"{name}\t{statistics.median(blocks) * 1e6:.1f}")


def main() -> None:
    print(f"load {os.getloadavg()}")
    results = {}
    for policy, env in POLICIES.items():
        environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run([sys.executable, __file__, "--child"], env={**environ, **env}, check=True,
                             capture_output=True, text=True).stdout
        results[policy] = dict(line.split("\t") for line in out.strip().splitlines())
    ops = list(next(iter(results.values())))
    print("| op | " + " | ".join(f"{p} µs" for p in POLICIES) + " |")
    print("|---|" + "---:|" * len(POLICIES))
    for op in ops:
        print(f"| {op} | " + " | ".join(results[p][op] for p in POLICIES) + " |")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()
