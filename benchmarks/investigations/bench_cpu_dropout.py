"""Dropout on CPU: eager, Inductor with its own RNG, Inductor with aten's (``fallback_random``), and comera_fx's
word dropout (``passes.fast_dropout``) eager and under Inductor with aten's RNG (what the backend runs on CPU).

The two dropout sites of CoMERA's encoder at batch 8 × 128: softmax + dropout over the attention scores
(8 × 12 × 128 × 128) and layer norm + dropout over the activations (8 × 128 × 768), forward + backward, 2 threads,
the variants interleaved, median of 30 rounds. comera_fx's backend sets ``fallback_random=True`` and rewrites
dropout with ``fast_dropout`` on CPU graphs because of this measurement (benchmarks/RESULTS.md, "Issue 14 item 2").

Usage::

    python benchmarks/investigations/bench_cpu_dropout.py    # ~1 minute (two small Inductor compiles per variant)
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
from torch import fx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from comera_fx.passes import fast_dropout  # noqa: E402


def attention(x):
    return F.dropout(torch.softmax(x, -1), 0.1, True)


def norm(x, w, b):
    return F.dropout(F.layer_norm(x, (x.shape[-1],), w, b), 0.1, True)


def word_dropout(fn):
    """``fn`` with its dropout drawn from random words: the pass on the graph Dynamo would capture."""
    return fast_dropout(fx.symbolic_trace(fn))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds after two warm-up rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch._inductor.config.force_disable_caches = True
    scores = torch.randn(8, 12, 128, 128, requires_grad=True)
    acts = torch.randn(8, 128, 768, requires_grad=True)
    w, b = torch.ones(768, requires_grad=True), torch.zeros(768, requires_grad=True)
    variants = {"eager": (attention, norm)}
    for name, fallback in (("inductor, own RNG", False), ("inductor, aten RNG", True)):
        options = {"fallback_random": fallback}
        variants[name] = (torch.compile(attention, options=options), torch.compile(norm, options=options))
    words = (word_dropout(attention), word_dropout(norm))
    assert all(w.meta["comera_fx_dropouts_rewritten"] == 1 for w in words)
    variants["word dropout, eager"] = words
    variants["word dropout, inductor"] = tuple(torch.compile(w, options={"fallback_random": True}) for w in words)
    sites = {"softmax+dropout": lambda f: f[0](scores).sum(), "layernorm+dropout": lambda f: f[1](acts, w, b).sum()}
    times = {(v, s): [] for v in variants for s in sites}
    for rnd in range(args.rounds + 2):
        for v, fns in variants.items():
            for s, run in sites.items():
                start = time.perf_counter()
                run(fns).backward()
                if rnd >= 2:  # the first two rounds compile and warm up
                    times[(v, s)].append(time.perf_counter() - start)
    print(f"load {common.loadavg()}")
    print(f"{'variant':20s} " + " ".join(f"{s + ' ms':>20s}" for s in sites))
    for v in variants:
        print(f"{v:20s} " + " ".join(f"{1000 * statistics.median(times[(v, s)]):20.1f}" for s in sites))


if __name__ == "__main__":
    main()
