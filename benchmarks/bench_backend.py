"""Training step of a 6-encoder transformer (d 768, ff 3072, 12 heads, seq 128, batch 8): dense vs comera_fx, compiled.

Side by side in one run, steps interleaved round-robin so load on a shared machine hits every column alike:

* ``dense eager``     — the model as built;
* ``dense inductor``  — ``torch.compile(model)`` (Inductor, the baseline the target ratio is against);
* ``tt eager``        — ``tensorize_`` (max rank 30, comera_fx's automatic modes), no compiler;
* ``tt comera_fx``    — the same TT model compiled with ``backend=comera_fx.backend`` (our passes + Inductor);
* ``no linears``      — (with ``--rest``) the model with every linear replaced by a free stand-in (a slice /
                        repeat of x plus the bias), compiled with Inductor: what attention, norms, activations,
                        embeddings and the optimizer cost on their own — the floor any linear-layer speed-up meets.

A step is forward + cross-entropy over a 256-symbol vocabulary + backward + AdamW. Reported: median step time per
column, ratios to ``dense inductor``, the first-step time (compile included) of the compiled columns, and the time
comera_fx's own passes took inside the backend (``backend.stats.pass_seconds``) as a share of the TT model's compile.

Usage::

    python benchmarks/bench_backend.py                 # ~5 minutes on 2 idle cores
    python benchmarks/bench_backend.py --steps 5 --layers 2 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import comera_fx


class EncoderLayer(nn.Module):
    """Post-norm BERT encoder layer with nn.Linear projections."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, ff), nn.Linear(ff, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(a))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))


class FreeLinear(nn.Module):
    """Stand-in for nn.Linear(in, out) with no GEMM: x repeated / sliced to ``out`` features, plus a bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        reps = -(-self.out_features // x.shape[-1])
        return x.repeat(*([1] * (x.dim() - 1)), reps)[..., : self.out_features] + self.bias


def without_linears(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, FreeLinear(child))
    return model


class Encoder(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, ff: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ff) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--max-rank", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per column after the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rest", action="store_true", help="add the 'no linears' column (one more compile)")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Compile times must be real compiles, not hits in Inductor's on-disk cache from an earlier run.
    torch._inductor.config.force_disable_caches = True
    torch.manual_seed(0)
    dense = Encoder(args.vocab, args.d_model, args.heads, args.d_ff, args.layers, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))

    tt = copy.deepcopy(dense)
    started = time.perf_counter()
    summary = comera_fx.tensorize_(tt, comera_fx.TensorizeConfig(max_rank=args.max_rank, init="random", seed=0),
                                   example_inputs=(ids,), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    tensorize_seconds = time.perf_counter() - started
    backend = comera_fx.make_backend()
    columns = {
        "dense eager": dense,
        "dense inductor": torch.compile(copy.deepcopy(dense)),
        "tt eager": tt,
        "tt comera_fx": torch.compile(copy.deepcopy(tt), backend=backend),
    }
    if args.rest:
        columns["no linears"] = torch.compile(without_linears(dense))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in columns.items()}

    def step(name):
        model, optimizer = columns[name], optimizers[name]
        start = time.perf_counter()
        loss = F.cross_entropy(model(ids).reshape(-1, args.vocab), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    load_start = os.getloadavg()
    first = {name: step(name) for name in columns}  # compiles the compiled columns
    times = {name: [] for name in columns}
    for _ in range(args.steps):
        for name in columns:
            times[name].append(step(name))
    load_end = os.getloadavg()

    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["dense inductor"]
    linear_dense = sum(m.weight.numel() for m in dense.modules() if isinstance(m, nn.Linear))
    linear_tt = sum(d.params for d in summary.converted)
    linear_dense_converted = sum(d.dense_params for d in summary.converted)
    result = dict(
        command="python benchmarks/bench_backend.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                  for k, v in vars(args).items() if v is not None),
        date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, python=platform.python_version(),
        load_start=load_start, load_end=load_end,
        median_step_s=median, first_step_s=first,
        speedup_vs_dense_inductor={name: base / t for name, t in median.items()},
        compile_s={"dense inductor": first["dense inductor"] - median["dense inductor"],
                   "tt comera_fx": first["tt comera_fx"] - median["tt comera_fx"]},
        comera_fx_pass_s=backend.stats.pass_seconds, backend_graphs=backend.stats.graphs,
        tensorize_s=tensorize_seconds,
        converted=len(summary.converted), linear_params_dense=linear_dense,
        converted_params=(linear_dense_converted, linear_tt),
    )
    result["pass_share_of_tt_compile"] = result["comera_fx_pass_s"] / max(result["compile_s"]["tt comera_fx"], 1e-9)

    print(f"load {load_start} -> {load_end}; {len(summary.converted)} linears converted, "
          f"{linear_dense_converted:,} -> {linear_tt:,} params ({linear_dense_converted / linear_tt:.1f}x)")
    print(f"{'column':16s} {'median step s':>14s} {'vs dense inductor':>18s} {'first step s':>13s}")
    for name in columns:
        print(f"{name:16s} {median[name]:14.3f} {base / median[name]:17.2f}x {first[name]:13.1f}")
    print(f"compile (first step - median): dense {result['compile_s']['dense inductor']:.1f} s, "
          f"tt {result['compile_s']['tt comera_fx']:.1f} s; comera_fx passes {result['comera_fx_pass_s']:.2f} s "
          f"= {100 * result['pass_share_of_tt_compile']:.1f}% of the TT compile")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
