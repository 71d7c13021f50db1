"""Training step of a 6-encoder transformer (d 768, ff 3072, 12 heads, seq 128, batch 8): dense vs comera_fx, compiled.

Side by side in one run, steps interleaved round-robin (the order rotated from step to step) so load on a shared
machine hits every column alike:

* ``dense eager``     — the model as built;
* ``dense inductor``  — ``torch.compile(model)`` (Inductor, the baseline the target ratio is against);
* ``tt eager``        — ``tensorize_`` (max rank 30, comera_fx's automatic modes) of every nn.Linear, no compiler;
* ``tt comera_fx``    — the same TT model compiled with ``backend=comera_fx.backend`` (our passes + Inductor);
* ``tt eager unpadded`` — a copy of ``tt eager`` run with the two-factor bond at its true rank and the bias through
                        addmm (``plan.autograd.PAD_RANKS`` / ``BIAS_IN_GEMM`` off): the A/B of the padding;
* ``tt eager bias addmm`` — padded, only ``BIAS_IN_GEMM`` off: the A/B of the bias in the padded bond;
* ``no linears``      — (with ``--rest``) the model with every linear replaced by a free stand-in (a slice /
                        repeat of x plus the bias), compiled with Inductor: what attention, norms, activations,
                        embeddings and the optimizer cost on their own — the floor any linear-layer speed-up meets;
* ``all-tt eager`` / ``all-tt comera_fx`` — (with ``--all-tt``, CoMERA preset) the word embedding tensorized too.

Two models (``--preset``):

* ``lm`` (default): post-norm encoders with a fused qkv projection and SDPA, a byte vocabulary of 256 and an LM head;
  the loss is cross-entropy over every position.
* ``comera``: CoMERA's six-encoder MNLI classifier (the public code's ``init_Transformer``, rewritten here):
  word embedding 30522 × 768 kept dense (``emb_tensorized=0``), position and token-type embeddings, separate
  q / k / v / output projections, matmul-softmax attention, dropout 0.1, a tanh-pooled 3-class head on the first
  token. No attention mask (every sequence is full length).

A step is forward + loss + backward + AdamW (``--fused-adamw`` for ``AdamW(fused=True)``; the default is torch's
per-parameter loop on CPU). Reported: median step time per column, ratios to ``dense inductor`` and compiled /
eager, the first-step time (compile included) of the compiled columns, and the time comera_fx's own passes took
inside the backend (``backend.stats.pass_seconds``).

Usage::

    python benchmarks/bench_backend.py                 # ~5 minutes on 2 idle cores
    python benchmarks/bench_backend.py --steps 5 --layers 2 --json out.json
    python benchmarks/bench_backend.py --preset comera --all-tt --columns "dense eager,all-tt eager,all-tt comera_fx"

Run it on an idle machine with OpenMP's default wait policy (nothing set): ``OMP_WAIT_POLICY=PASSIVE`` adds ~0.1 ms
to each short parallel region and made the compiled TT step ~1.5x slower, dense ~1.04x (medians of four runs each;
benchmarks/RESULTS.md, "The OpenMP wait policy"). The policy in effect is printed and saved.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import time

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import common  # benchmarks/ is this script's sys.path[0]

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
import comera_fx  # noqa: E402
from common import openmp_setting  # noqa: E402
from comera_fx.tt.plan import autograd as planned_autograd  # noqa: E402


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


class ComeraEncoderLayer(nn.Module):
    """CoMERA's encoder layer (``Tensor_Attention`` + ``Tensor_PFF`` of the public code, rewritten here): separate
    q, k, v and output projections, attention as matmul / softmax / matmul, post-norm (eps 1e-9), dropout 0.1."""

    def __init__(self, d: int, heads: int, ff: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.fc = (nn.Linear(d, d) for _ in range(4))
        self.fc_1, self.fc_2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-9), nn.LayerNorm(d, eps=1e-9)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (proj(x).view(b, t, h, d // h).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = self.drop(torch.softmax(torch.matmul(q / (d // h) ** 0.5, k.transpose(2, 3)), dim=-1))
        a = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.drop(self.fc(a)))
        return self.ln2(x + self.drop(self.fc_2(F.gelu(self.fc_1(x)))))


class ComeraClassifier(nn.Module):
    """CoMERA's six-encoder MNLI classifier (``Transformer_classification``, ``init_Transformer`` of the public
    code): word (30522), position (512) and token-type embeddings, LayerNorm, encoders, then the first token through
    fc1 (d × d) + tanh + fc2 (d × classes)."""

    def __init__(
        self,
        vocab: int,
        d: int,
        heads: int,
        ff: int,
        layers: int,
        classes: int = 3,
        positions: int = 512,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.word_emb, self.position_emb = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.token_type_emb = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d, eps=1e-9)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(ComeraEncoderLayer(d, heads, ff, dropout) for _ in range(layers))
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, ids, seg):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.ln(self.word_emb(ids) + self.position_emb(positions) + self.token_type_emb(seg)))
        for layer in self.layers:
            x = layer(x)
        return self.fc2(self.drop(torch.tanh(self.fc1(x[:, 0]))))


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
    parser.add_argument(
        "--preset",
        choices=("lm", "comera"),
        default="lm",
        help="lm: the byte-vocabulary LM above (default); comera: CoMERA's MNLI classifier "
        "(vocab 30522, dense word embedding, 3-class head; sets --vocab 30522)",
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=None, help="256 for lm, 30522 for comera")
    parser.add_argument("--max-rank", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per column after the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rest", action="store_true", help="add the 'no linears' column (one more compile)")
    parser.add_argument(
        "--all-tt",
        action="store_true",
        help="add 'all-tt eager' / 'all-tt comera_fx': the word embedding tensorized too",
    )
    parser.add_argument(
        "--inductor-rng",
        action="store_true",
        help="add 'tt comera_fx inductor-rng': the backend with Inductor's own CPU RNG "
        "(fallback_random=False), the A/B of the backend's CPU default",
    )
    parser.add_argument(
        "--comera-path",
        default=None,
        help="a checkout of the public CoMERA code (github.com/ziyangjoy/CoMERA, unpacked outside "
        "this repository): adds 'comera tt eager', its own TT model (init_Transformer, dense "
        "word embedding), imported from that path at run time",
    )
    parser.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) for every column")
    parser.add_argument(
        "--columns", default=None, help="comma-separated subset of the columns to run (e.g. 'tt eager,tt comera_fx')"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.vocab is None:
        args.vocab = 30522 if args.preset == "comera" else 256
    return args


def build(args):
    """(dense model, example inputs, loss(model) -> scalar, filter for the TT model, filter for the all-TT one)."""
    if args.preset == "comera":
        dense = ComeraClassifier(args.vocab, args.d_model, args.heads, args.d_ff, args.layers)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        seg = (torch.arange(args.seq) >= args.seq // 2).long().expand(args.batch, -1).contiguous()
        labels = torch.randint(0, 3, (args.batch,))
        inputs = (ids, seg)

        def loss(model):
            return F.cross_entropy(model(*inputs), labels)

        def all_tt(module, fqn):  # the encoders' linears, fc1, and the word embedding (CoMERA's emb_tensorized)
            return isinstance(module, nn.Linear) or fqn == "word_emb"
    else:
        dense = Encoder(args.vocab, args.d_model, args.heads, args.d_ff, args.layers, args.seq)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        targets = torch.randint(0, args.vocab, (args.batch, args.seq))
        inputs = (ids,)

        def loss(model):
            return F.cross_entropy(model(*inputs).reshape(-1, args.vocab), targets.reshape(-1))

        all_tt = None
    return dense, inputs, loss, (lambda module, fqn: isinstance(module, nn.Linear)), all_tt


def comera_model(path: str, args, emb_tensorized: bool) -> nn.Module:
    """The public CoMERA code's TT classifier (``init_Transformer`` in its utils.py, r = --max-rank), imported from
    ``path``; its code is never copied into this repository."""
    import importlib.util
    import sys

    if not os.path.isfile(os.path.join(path, "utils.py")):
        raise SystemExit(f"--comera-path {path}: no utils.py there; unpack github.com/ziyangjoy/CoMERA into it")
    if path not in sys.path:
        sys.path.insert(0, path)  # its utils.py imports the package tensor_layers_CoMERA from there
    spec = importlib.util.spec_from_file_location("comera_peer_utils", os.path.join(path, "utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.init_Transformer(
        emb_tensorized=emb_tensorized, encoder_tensorized=True, r=args.max_rank, num_class=3, n_layers=args.layers
    )
    return PeerModel(model.train())


class PeerModel(nn.Module):
    """The CoMERA classifier called as ours is: ``model(ids, seg)`` (its forward takes ``seg`` by keyword)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, seg):
        return self.model(ids, seg=seg)


def tensorized(dense, args, inputs, filter_fn):
    model = copy.deepcopy(dense)
    started = time.perf_counter()
    summary = comera_fx.tensorize_(
        model,
        comera_fx.TensorizeConfig(max_rank=args.max_rank, init="random", seed=0),
        example_inputs=inputs,
        filter_fn=filter_fn,
    )
    return model, summary, time.perf_counter() - started


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Compile times must be real compiles, not hits in Inductor's on-disk cache from an earlier run.
    torch._inductor.config.force_disable_caches = True
    torch.manual_seed(0)
    dense, inputs, loss_of, tt_filter, all_tt_filter = build(args)
    dense.train()

    tt, summary, tensorize_seconds = tensorized(dense, args, inputs, tt_filter)
    backends = {
        "tt comera_fx": comera_fx.make_backend(),
        "tt comera_fx aten dropout": comera_fx.make_backend(fast_dropout=False),
    }
    columns = {
        "dense eager": lambda: dense,
        "dense inductor": lambda: torch.compile(copy.deepcopy(dense)),
        "tt eager": lambda: tt,
        "tt comera_fx": lambda: torch.compile(copy.deepcopy(tt), backend=backends["tt comera_fx"]),
        # the A/B of the word dropout: aten's per-element dropout in the compiled graph (fast_dropout=False)
        "tt comera_fx aten dropout": lambda: torch.compile(
            copy.deepcopy(tt), backend=backends["tt comera_fx aten dropout"]
        ),
        # the A/B of the padded bond: true ranks, bias through addmm (plan.autograd.PAD_RANKS / BIAS_IN_GEMM off)
        "tt eager unpadded": lambda: copy.deepcopy(tt),
        # the A/B of the bias in the padded bond alone: padded, the bias through addmm (BIAS_IN_GEMM off)
        "tt eager bias addmm": lambda: copy.deepcopy(tt),
    }
    if args.inductor_rng:
        backends["tt comera_fx inductor-rng"] = comera_fx.make_backend(inductor_options={"fallback_random": False})
        columns["tt comera_fx inductor-rng"] = lambda: torch.compile(
            copy.deepcopy(tt), backend=backends["tt comera_fx inductor-rng"]
        )
    if args.rest:
        columns["no linears"] = lambda: torch.compile(without_linears(dense))
    all_tt_summary = None
    if args.all_tt:
        if all_tt_filter is None:
            raise SystemExit("--all-tt needs --preset comera (the lm preset's embeddings are small)")
        all_tt, all_tt_summary, _ = tensorized(dense, args, inputs, all_tt_filter)
        backends["all-tt comera_fx"] = comera_fx.make_backend()
        columns["all-tt eager"] = lambda: all_tt
        columns["all-tt comera_fx"] = lambda: torch.compile(copy.deepcopy(all_tt), backend=backends["all-tt comera_fx"])
        # the A/B of the embedding gradient: Inductor's decomposition instead of aten's kernel (cpu_aten_kernels=())
        backends["all-tt comera_fx decomposed emb bwd"] = comera_fx.make_backend(cpu_aten_kernels=())
        columns["all-tt comera_fx decomposed emb bwd"] = lambda: torch.compile(
            copy.deepcopy(all_tt), backend=backends["all-tt comera_fx decomposed emb bwd"]
        )
    if args.comera_path:
        if args.preset != "comera":
            raise SystemExit("--comera-path needs --preset comera")
        # Only its dense-embedding model: its TT embedding (TensorizedEmbedding_order4) moves an index table to
        # 'cuda' when built, so it cannot run on a CPU-only torch.
        columns["comera tt eager"] = functools.partial(comera_model, args.comera_path, args, False)
    if args.columns:
        wanted = [c.strip() for c in args.columns.split(",")]
        unknown = [c for c in wanted if c not in columns]
        if unknown:
            raise SystemExit(f"unknown column(s) {unknown}; choose from {list(columns)}")
        columns = {name: columns[name] for name in wanted}
    columns = {name: make() for name, make in columns.items()}
    fused = {"fused": True} if args.fused_adamw else {}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, **fused) for name, m in columns.items()}

    phases = {name: [] for name in columns}  # (forward + loss, zero_grad + backward, optimizer) per timed step

    def step(name):
        if name.endswith(" unpadded"):
            planned_autograd.PAD_RANKS = planned_autograd.BIAS_IN_GEMM = False
        elif name.endswith(" bias addmm"):
            planned_autograd.BIAS_IN_GEMM = False
        try:
            return timed_step(name)
        finally:
            planned_autograd.PAD_RANKS = planned_autograd.BIAS_IN_GEMM = True

    def timed_step(name):
        model, optimizer = columns[name], optimizers[name]
        start = time.perf_counter()
        loss = loss_of(model)
        forward = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        phases[name].append((forward - start, backward - forward, end - backward))
        return end - start

    load_start = os.getloadavg()
    first = {name: step(name) for name in columns}  # compiles the compiled columns
    times = {name: [] for name in columns}
    names = list(columns)
    for index in range(args.steps):  # the order rotates: no column always sits after the same one (the memory a
        shift = index % len(names)  # dense step frees comes back slower, benchmarks/RESULTS.md, "seat after dense")
        for name in names[shift:] + names[:shift]:
            times[name].append(step(name))
    load_end = os.getloadavg()

    median = {name: statistics.median(t) for name, t in times.items()}
    phase_median = {name: [statistics.median(p[i] for p in phases[name][1:]) for i in range(3)] for name in columns}
    base_name = "dense inductor" if "dense inductor" in median else next(iter(median))
    base = median[base_name]
    linear_dense = sum(m.weight.numel() for m in dense.modules() if isinstance(m, nn.Linear))
    linear_tt = sum(d.params for d in summary.converted)
    linear_dense_converted = sum(d.dense_params for d in summary.converted)
    ratios = {}
    for slow, fast in (
        ("comera tt eager", "tt comera_fx"),
        ("comera tt eager", "tt eager"),
        ("tt eager", "tt comera_fx"),
        ("tt comera_fx inductor-rng", "tt comera_fx"),
        ("tt eager", "tt comera_fx inductor-rng"),
        ("all-tt eager", "all-tt comera_fx"),
        ("dense eager", "dense inductor"),
        ("tt eager unpadded", "tt eager"),
        ("tt eager bias addmm", "tt eager"),
    ):
        if slow in median and fast in median:
            ratios[f"{fast} vs {slow}"] = median[slow] / median[fast]
    compiled = [name for name in columns if " eager" not in name]
    result = dict(
        command="python benchmarks/bench_backend.py "
        + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v!r}" if isinstance(v, str) else f" {v}")
            for k, v in vars(args).items()
            if v is not None and v is not False
        ),
        date=time.strftime("%Y-%m-%d %H:%M"),
        torch=torch.__version__,
        python=platform.python_version(),
        openmp=openmp_setting(),
        load_start=load_start,
        load_end=load_end,
        median_step_s=median,
        first_step_s=first,
        step_s=times,
        phase_median_s=phase_median,
        speedup_vs=base_name,
        speedup={name: base / t for name, t in median.items()},
        ratios=ratios,
        compile_s={name: first[name] - median[name] for name in compiled},
        comera_fx_pass_s={name: b.stats.pass_seconds for name, b in backends.items() if name in columns},
        backend_graphs={name: b.stats.graphs for name, b in backends.items() if name in columns},
        tensorize_s=tensorize_seconds,
        converted=len(summary.converted),
        linear_params_dense=linear_dense,
        converted_params=(linear_dense_converted, linear_tt),
    )
    if all_tt_summary is not None:
        result["all_tt_converted_params"] = (
            sum(d.dense_params for d in all_tt_summary.converted),
            sum(d.params for d in all_tt_summary.converted),
        )

    print(
        f"load {load_start} -> {load_end}; {result['openmp']}; {len(summary.converted)} weights converted, "
        f"{linear_dense_converted:,} -> {linear_tt:,} params ({linear_dense_converted / linear_tt:.1f}x)"
    )
    print(
        f"{'column':36s} {'median step s':>14s} {'vs ' + base_name:>18s} {'first step s':>13s}  fwd / bwd / optimizer s"
    )
    for name in columns:
        fwd, bwd, opt = phase_median[name]
        print(
            f"{name:36s} {median[name]:14.3f} {base / median[name]:17.2f}x {first[name]:13.1f}  "
            f"{fwd:.3f} / {bwd:.3f} / {opt:.3f}"
        )
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    for name, seconds in result["compile_s"].items():
        passes = result["comera_fx_pass_s"].get(name)
        print(
            f"compile {name} (first step - median): {seconds:.1f} s"
            + ("" if passes is None else f"; comera_fx passes {passes:.2f} s, graphs {result['backend_graphs'][name]}")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
