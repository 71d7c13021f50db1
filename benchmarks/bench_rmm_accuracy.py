"""Accuracy of randomized backward: the demo's code LM trained the same number of steps, exact vs RMM vs baselines.

The model, data, batches, optimizer (AdamW, lr 1e-3, warm-up) and training loop are the demo's
(``examples/train_code_lm.py``, imported): preset ``--preset`` (default small: 4 layers, d 384, ff 1536, seq 128,
batch 16), seed 0, ``--steps`` steps, validation loss (nats/byte) on the demo's fixed held-out batches at the end.
Only the backward of the block linears (qkv, proj, fc, out) changes:

* ``exact``          — plain autograd;
* ``rmm<ρ>``         — ``comera_fx.randomize_backward_(model, rho=ρ, sketch=--sketch)`` on the block linears;
* ``topk<ρ>``        — DropIT-style: keep the top ρ/2 of |x| (values + int32 indices: ρ × the exact saved bytes);
* ``int8``           — per-token int8 saved inputs (≈ 0.25 × the exact saved bytes).

Methods run one after another in this process (``--methods``), each from the same initial weights.

Usage::

    python benchmarks/bench_rmm_accuracy.py --steps 300 --json out.json
    python benchmarks/bench_rmm_accuracy.py --preset tiny --steps 50      # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402  (benchmarks/ is this script's sys.path[0])

common.use_this_checkout()
import train_code_lm as demo  # noqa: E402
from common import comera_randomize_backward_, loadavg, rmm_missing, write_record  # noqa: E402

DEFAULT_METHODS = "exact,rmm0.5,rmm0.2,rmm0.1,topk0.5,topk0.2,topk0.1,int8"

# ----------------------------------------------------------------------------------------------------
# The reviewers' baselines for RMM, for benchmarks only: other ways to shrink what a linear layer saves for backward.
#
# Both keep the forward exact and the input gradient exact (dX = dY·W); only the weight gradient uses the compressed
# copy of the input x (tokens × features, leading dims flattened):
#
# * ``TopKLinearFunction`` (DropIT-style): keep the k largest |x| entries of the whole input (values fp32 + int32 flat
#   indices, 8 bytes per kept entry), zeros elsewhere; dW = dYᵀ·x̃ (biased: small entries are dropped, not
#   rescaled).
#   At a saved-bytes budget of ρ × the exact input, k = ρ/2 × numel.
# * ``Int8LinearFunction``: x quantized per token (row) to int8 with an absmax scale (round to nearest), 1 byte per
#   entry + 4 per row, ≈ 0.25 × the exact input; dW = dYᵀ·dequant(x).
#
# ``CompressedLinear`` wraps an existing ``nn.Linear`` (same parameters) with one of them; ``compress_linears_``
# swaps the modules a filter picks.


class TopKLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, keep_fraction: float):
        x2 = x.reshape(-1, x.shape[-1])
        k = max(1, int(keep_fraction * x2.numel()))
        flat = x2.reshape(-1)
        idx = flat.abs().topk(k, sorted=False).indices
        ctx.save_for_backward(flat[idx].contiguous(), idx.to(torch.int32), weight)
        ctx.x_shape = tuple(x2.shape)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        values, idx, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).reshape(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            sparse = torch.zeros(ctx.x_shape[0] * ctx.x_shape[1], dtype=values.dtype, device=values.device)
            sparse[idx.long()] = values
            dw = dy2.t() @ sparse.view(ctx.x_shape)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class Int8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        scale = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(x2 / scale).clamp_(-127, 127).to(torch.int8)
        ctx.save_for_backward(q, scale.to(torch.float32), weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        q, scale, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).reshape(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ (q.to(dy2.dtype) * scale.to(dy2.dtype)) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class CompressedLinear(nn.Module):
    """An ``nn.Linear``'s parameters with a compressed saved input: ``method`` "topk" (``budget`` = saved bytes as a
    fraction of the exact input's) or "int8"."""

    def __init__(self, linear: nn.Linear, method: str, budget: float | None = None):
        super().__init__()
        if method not in ("topk", "int8"):
            raise ValueError(f"method must be 'topk' or 'int8', got {method!r}")
        if method == "topk" and not (budget and 0 < budget <= 1):
            raise ValueError(f"topk needs budget in (0, 1] (saved bytes / exact input bytes), got {budget!r}")
        self.weight, self.bias = linear.weight, linear.bias
        self.method, self.budget = method, budget

    def forward(self, x):
        if not (torch.is_grad_enabled() and self.training):
            return F.linear(x, self.weight, self.bias)
        if self.method == "topk":
            return TopKLinearFunction.apply(x, self.weight, self.bias, self.budget / 2)  # 8 bytes per kept entry
        return Int8LinearFunction.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, method={self.method}, budget={self.budget}"


def compress_linears_(model: nn.Module, method: str, budget: float | None, filter_fn) -> list[str]:
    """Replace every ``nn.Linear`` that ``filter_fn(module, fqn)`` accepts; returns their FQNs."""
    targets = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and filter_fn(m, fqn)]
    for fqn, module in targets:
        parent_name, _, child = fqn.rpartition(".")
        setattr(
            model.get_submodule(parent_name) if parent_name else model, child, CompressedLinear(module, method, budget)
        )
    return [fqn for fqn, _ in targets]


def in_blocks(module, fqn: str) -> bool:
    return fqn.startswith("blocks.") and fqn.rsplit(".", 1)[-1] in ("qkv", "proj", "fc", "out")


def run(method: str, opts, data) -> dict:
    train_data, val_set, p = data
    args, _ = demo.parse_args(
        [
            "--preset",
            opts.preset,
            "--max-steps",
            str(opts.steps),
            "--budget-seconds",
            "1e9",
            "--eval-every",
            "1e9",
            "--seed",
            "0",
            "--quiet",
        ]
    )
    torch.manual_seed(args.seed)
    model = demo.GPT(p)
    info = {}
    if method.startswith("rmm"):
        why = rmm_missing()
        if why:
            return {"method": method, "skipped": why}
        example = demo.get_batch(train_data, p.batch, p.seq_len, torch.Generator().manual_seed(0), torch.device("cpu"))[
            0
        ]
        summary = comera_randomize_backward_(
            model,
            rho=float(method[3:]),
            sketch=opts.sketch,
            example_inputs=(example,),
            filter_fn=in_blocks,
            min_numel=p.min_numel,
        )  # the tiny preset's 64-wide layers too
        info["summary"] = str(summary)[:1500]
    elif method.startswith("topk"):
        info["replaced"] = compress_linears_(model, "topk", float(method[4:]), in_blocks)
    elif method == "int8":
        info["replaced"] = compress_linears_(model, "int8", None, in_blocks)
    elif method != "exact":
        raise SystemExit(f"unknown method {method!r}: exact, rmm<rho>, topk<rho>, int8")
    torch.manual_seed(opts.rng_seed)  # RMM's sketch seeds come from the global generator: one stream per method
    optimizer = demo.make_dense_optimizer(model, args)
    result = demo.RunResult(method)
    load_start = loadavg()
    demo.train(method, model, optimizer, None, train_data, val_set, p, args, torch.device("cpu"), result)
    return {
        "method": method,
        "steps": result.steps,
        "val": result.evals[-1][2],
        "val_start": result.evals[0][2],
        "train_loss_last50": sum(result.train_losses[-50:]) / len(result.train_losses[-50:]),
        "train_seconds": result.train_seconds,
        "load_start": load_start,
        "load_end": loadavg(),
        **info,
    }


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--sketch", default="gaussian")
    ap.add_argument("--rng-seed", type=int, default=1234, help="global RNG seed set before training (RMM's seeds)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the preset's, else 2)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None):
    opts = parse(sys.argv[1:] if argv is None else argv)
    p = demo.PRESETS[opts.preset]
    torch.set_num_threads(opts.threads or p.threads or 2)
    train_data, val_data, _ = demo.load_stdlib(p.data_bytes)
    val_gen = torch.Generator().manual_seed(1234)
    val_set = [demo.get_batch(val_data, p.batch, p.seq_len, val_gen, torch.device("cpu")) for _ in range(p.val_batches)]
    print(
        f"{datetime.now():%Y-%m-%d %H:%M:%S} load {loadavg()} torch {torch.__version__} preset {opts.preset} "
        f"steps {opts.steps}",
        flush=True,
    )
    results = []
    for method in [m.strip() for m in opts.methods.split(",") if m.strip()]:
        t0 = time.perf_counter()
        r = run(method, opts, (train_data, val_set, p))
        results.append(r)
        msg = r.get("skipped") or f"val {r['val']:.4f} (start {r['val_start']:.4f}), {r['train_seconds']:.0f} s"
        print(f"{datetime.now():%H:%M:%S} {method}: {msg} [{time.perf_counter() - t0:.0f} s]", flush=True)
        if opts.json:
            write_record(opts.json, results=results)
    exact = next((r["val"] for r in results if r["method"] == "exact"), None)
    print("\n| method | val loss (nats/byte) | vs exact |\n|---|---:|---:|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['method']} | skipped: {r['skipped']} | |")
        else:
            rel = f"{100 * (r['val'] / exact - 1):+.2f}%" if exact else "-"
            print(f"| {r['method']} | {r['val']:.4f} | {rel} |")


if __name__ == "__main__":
    main()
