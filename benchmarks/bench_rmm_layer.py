"""One linear layer, forward + backward, exact vs randomized backward (comera_fx's RMM and the public fewbit code).

For each shape (default 768→3072 and 3072→768) at ``--tokens`` tokens (default 2048), fp32, ``--threads`` threads
(default 2): x (tokens × in, requires grad), W, b leaf parameters, dy random; one measurement is
``f(x, W, b).backward(dy)`` with the gradients dropped after it. Methods, all timed round-robin in one process (one
round = every method once, in a fixed order; ``--repeats`` rounds after ``--warmup``), median per method, and the
ratio to the exact layer's median from the same run:

* ``exact``                 — ``F.linear`` with autograd;
* ``comera_fx <sketch>``    — ``comera_fx.rmm.rmm_linear(x, W, b, rho=ρ, sketch=...)`` for gaussian, rademacher, srht
                              (skipped, with the reason, where this checkout has no RMM);
* ``fewbit <matmul>``       — skolai/fewbit's ``linear_randomized`` (gaussian, rademacher, dct) from ``--fewbit PATH``,
                              its pure-Python module only (its native extension is not needed for it).

Also reported: bytes saved for backward per method (unique storages through ``saved_tensors_hooks``, parameters
apart), as a ratio to the exact layer's saved input.

Usage (timing only under the shared lock)::

    flock /tmp/comera_timing.lock python benchmarks/bench_rmm_layer.py --fewbit /tmp/fewbit --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import common  # noqa: E402  (benchmarks/ is this script's sys.path[0])

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from common import (
    comera_rmm_linear,
    exact_linear,
    fewbit_linear,
    load_fewbit,
    loadavg,
    rmm_missing,  # noqa: E402
    saved_bytes_by_op,
    write_record,
)

COMERA_SKETCHES = ("gaussian", "rademacher", "srht")
FEWBIT_MATMULS = ("gaussian", "rademacher", "dct")


def methods(rhos, fewbit_path) -> tuple[dict, list[str]]:
    """name -> f(x, w, b) for every method that can run here, and the skipped ones with reasons."""
    out, skipped = {"exact": exact_linear}, []
    why = rmm_missing()
    for rho in rhos:
        for sketch in COMERA_SKETCHES:
            name = f"comera_fx {sketch} ρ={rho}"
            if why:
                skipped.append(f"{name}: {why}")
            else:
                out[name] = (lambda s, r: lambda x, w, b: comera_rmm_linear(x, w, b, rho=r, sketch=s))(sketch, rho)
    if fewbit_path:
        try:
            fn = load_fewbit(fewbit_path)
        except Exception as exc:  # noqa: BLE001 - any failure to load is reported as the reason
            skipped.append(f"fewbit: {type(exc).__name__}: {exc}")
        else:
            for rho in rhos:
                for matmul in FEWBIT_MATMULS:
                    call = fewbit_linear(fn, matmul)
                    out[f"fewbit {matmul} ρ={rho}"] = (lambda c, r: lambda x, w, b: c(x, w, b, r))(call, rho)
    else:
        skipped.append("fewbit: no --fewbit PATH given")
    return out, skipped


def run_shape(n_in: int, n_out: int, opts, fns: dict) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(opts.tokens, n_in, generator=gen).requires_grad_(True)
    w = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).requires_grad_(True)
    b = torch.zeros(n_out).requires_grad_(True)
    dy = torch.randn(opts.tokens, n_out, generator=gen)

    def once(fn) -> float:
        t0 = time.perf_counter()
        fn(x, w, b).backward(dy)
        t = time.perf_counter() - t0
        x.grad = w.grad = b.grad = None
        return t

    times = {name: [] for name in fns}
    for i in range(opts.warmup + opts.repeats):
        for name, fn in fns.items():
            t = once(fn)
            if i >= opts.warmup:
                times[name].append(t)
    median = {name: statistics.median(t) for name, t in times.items()}
    saved = {}
    exact_input = x.numel() * x.element_size()
    for name, fn in fns.items():
        s = saved_bytes_by_op(lambda: fn(x, w, b).sum(), [w, b])  # sum saves nothing
        saved[name] = s["total"] / exact_input
    x.grad = w.grad = b.grad = None
    return {
        "shape": f"{n_in}→{n_out}",
        "median_s": median,
        "ratio": {k: v / median["exact"] for k, v in median.items()},
        "spread": {k: (min(v), max(v)) for k, v in times.items()},
        "saved_vs_exact_input": saved,
    }


def table(results: list[dict], fns: dict) -> str:
    shapes = [r["shape"] for r in results]
    head = "| method | " + " | ".join(f"{s} time vs exact" for s in shapes) + " | saved bytes vs exact input |"
    lines = [head, "|---|" + "---:|" * (len(shapes) + 1)]
    for name in fns:
        cells = [f"{r['ratio'][name]:.2f}× ({1000 * r['median_s'][name]:.0f} ms)" for r in results]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {results[0]['saved_vs_exact_input'][name]:.3f} |")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shapes", default="768x3072,3072x768", help="in x out, comma-separated")
    ap.add_argument("--rhos", default="0.5,0.2,0.1")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fewbit", default=None, help="path of a copy of github.com/skolai/fewbit (its root)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None):
    opts = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(opts.threads)
    rhos = [float(r) for r in opts.rhos.split(",")]
    fns, skipped = methods(rhos, opts.fewbit)
    load_start = loadavg()
    import comera_fx

    print(
        f"{datetime.now():%Y-%m-%d %H:%M:%S} load {load_start} torch {torch.__version__} comera_fx "
        f"{Path(comera_fx.__file__).parent} threads "
        f"{torch.get_num_threads()} tokens {opts.tokens} repeats {opts.repeats}",
        flush=True,
    )
    results = []
    for shape in opts.shapes.split(","):
        n_in, n_out = (int(v) for v in shape.split("x"))
        results.append(run_shape(n_in, n_out, opts, fns))
        print(f"{datetime.now():%H:%M:%S} {shape} done, load {loadavg()}", flush=True)
    load_end = loadavg()
    text = table(results, fns)
    print(text)
    for s in skipped:
        print("skipped:", s)
    print(f"load {load_start} → {load_end}")
    if opts.json:
        write_record(opts.json, load=[load_start, load_end], results=results, skipped=skipped)


if __name__ == "__main__":
    main()
