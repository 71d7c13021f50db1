"""Embedding gradients on CPU: eager vs Inductor's decomposition vs aten's kernel inside the compiled graph.

Three lookups of CoMERA's configuration at batch 8 × 128, forward + backward, 2 threads, interleaved, median of 22
rounds: a TT-matrix lookup of the 30522 × 768 word embedding as comera_fx computes it (two gathers from the merged
halves, then a batched product; ranks 30), the 512 × 768 position embedding, and the dense 30522 × 768 word
embedding. "inductor" is Inductor's default (``embedding_dense_backward`` decomposed into a scatter-add); "inductor,
aten kernel" leaves that op to aten, which is what comera_fx's backend does on CPU graphs
(``BackendConfig.cpu_aten_kernels``; benchmarks/RESULTS.md, "Issue 14 item 2").

Usage::

    python benchmarks/investigations/bench_embedding_backward.py     # ~1 minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
import comera_fx  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=22, help="timed rounds after three warm-up rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch._inductor.config.force_disable_caches = True
    torch.manual_seed(0)
    ids = torch.randint(0, 30522, (8 * 128,))
    left = torch.randn(180, 24 * 30, requires_grad=True)  # rows 180 · 170 >= 30522, cols 24 · 32 = 768
    right = torch.randn(170, 30 * 32, requires_grad=True)
    positions = torch.randn(512, 768, requires_grad=True)
    word = torch.randn(30522, 768, requires_grad=True)

    def ttm(ids):
        a = F.embedding(torch.div(ids, 170, rounding_mode="floor"), left).reshape(-1, 24, 30)
        b = F.embedding(torch.remainder(ids, 170), right).reshape(-1, 30, 32)
        return (a @ b).reshape(-1, 768)

    def position(ids):
        return F.embedding(torch.arange(128).repeat(8), positions)

    def dense_word(ids):
        return F.embedding(ids, word)

    # warn_dense=False: the dense tables here are the point, not a forgotten tensorize_
    aten_kernel = comera_fx.make_backend(warn_dense=False)
    decomposed = comera_fx.make_backend(warn_dense=False, cpu_aten_kernels=())
    variants = {}
    for site, fn in (("TT-matrix lookup", ttm), ("position 512x768", position), ("word 30522x768", dense_word)):
        variants[(site, "eager")] = fn
        variants[(site, "inductor")] = torch.compile(fn, backend=decomposed)
        variants[(site, "inductor, aten kernel")] = torch.compile(fn, backend=aten_kernel)
    times = {key: [] for key in variants}
    for rnd in range(args.rounds + 3):
        for key, fn in variants.items():
            start = time.perf_counter()
            fn(ids).sum().backward()
            if rnd >= 3:  # the first rounds compile and warm up
                times[key].append(time.perf_counter() - start)
    print(f"load {common.loadavg()}")
    sites = dict.fromkeys(site for site, _ in variants)
    kinds = dict.fromkeys(kind for _, kind in variants)
    print(f"{'site':20s} " + " ".join(f"{kind + ' ms':>24s}" for kind in kinds))
    for site in sites:
        print(f"{site:20s} " + " ".join(f"{1000 * statistics.median(times[(site, kind)]):24.2f}" for kind in kinds))


if __name__ == "__main__":
    main()
