"""One-shot GPU check of comera_fx.tt.kernels: correctness on CUDA against the aten path, then timings.

Run on a CUDA machine (the CUDA build of torch brings triton)::

    python benchmarks/gpu_check.py                 # 75 s on one H200 (2026-12-04)
    OUT=/some/dir python benchmarks/gpu_check.py   # also writes $OUT/gpu_check.json, after every part
    python benchmarks/gpu_check.py --skip-compile-once --emb 50257x1024 --emb-rank 64   # the kernels at another size

What it does (each part catches its own exception, records it and goes on; part 6 runs first, so that a run cut
short by its time limit still has issue 30's figure):

1. correctness on CUDA: ``kernels.take_rows`` (raw cores + gates, and pre-gated cores; with and without dedup)
   and ``kernels.gated_ttm_merge`` against the aten code of ``comera_fx.tt.ops`` in float64, forward and gradients
   of every core and gate, in float32 and bfloat16; plus ``torch.compile(fullgraph=True)`` (Inductor) of a lookup
   + backward, which must run the Triton ops and match eager;
2. embedding 32000×768 (TTM, rows 16·20·10·10, cols 4·4·8·6, ranks 32, CoMERA's layout), 16384 tokens, bf16:
   dense ``nn.Embedding`` vs TTM through the kernels vs TTM through aten, forward and forward + backward, uniform
   ids and Zipf-distributed ids (repeats; with and without dedup);
3. gate fusion: ``gated_ttm_merge`` (gate applied inside the merge GEMM, permuted store) vs aten
   ``ttm_merge(gate_cores(...))`` on the embedding's two halves;
4. linear 4096×4096 (TT, r = 32, planner's order, ``TTLinear``) vs dense ``nn.Linear``, bf16, 16384 tokens,
   forward + backward, eager and ``torch.compile``d;
5. the fused low-rank chain (issue 44 item 5): TT linears 4096² r 32 at ``--tokens``, 768² and 768×3072 r 16 at
   2048 tokens, bf16, forward + backward with ``kernels.FUSED_CHAIN`` off and on, eager and compiled; outputs must
   agree (decides whether FUSED_CHAIN may be on by default on CUDA);
5b. rank padding on the GPU: a 768×3072 ``TTLinear`` with bias at r = 30, bf16, forward + backward with the bond
   padded to ``kernel_rank`` (32) and the bias in its spare slice, against unpadded (padding is CPU-only until this
   says it pays on CUDA: ``comera_fx.tt.plan.autograd.PAD_DEVICES``); outputs must agree;
6. compile once (issue 30): ``bench_recompile.py``'s 2-block TT LM on the device under
   ``torch.compile(backend=comera_fx backend)`` with ``RankAdaptive`` (5 prunes in 30 steps,
   ``BudgetConfig(shrink_slack=4)``): first step, post-prune overhead as a multiple of it, recompiles (at most 3),
   compiled ≡ eager after the last prune (relative error < 1e-4), the TT size shrinking. ``--smoke`` runs it on the
   backend's eager mode (no Inductor), 12 steps.

Ratios are dense time / other time (> 1: the other is faster). ``--smoke`` runs tiny sizes on any device (on CPU
with TRITON_INTERPRET=1 the kernels run in the interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import common  # benchmarks/common.py: this checkout first on sys.path (no install needed on the GPU machine)

common.use_this_checkout()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from comera_fx.tt import kernels  # noqa: E402
from comera_fx.tt import ops  # noqa: E402
from comera_fx.tt.decompose import random_tt_cores  # noqa: E402
from comera_fx.tt.layers import TTLinear, TTMatrix, choose_layout_modes  # noqa: E402
from comera_fx.tt.layout import TTFormat, TTLayout  # noqa: E402

RESULTS: dict = {"checks": {}, "timings": {}, "ratios": {}, "errors": {}}
SMOKE = False  # --smoke: one timed run per measurement


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, device: torch.device, *, warmup: int = 3, repeats: int = 15, budget_s: float = 8.0) -> float:
    """Median milliseconds of fn() over up to ``repeats`` runs (fewer if the budget runs out)."""
    if SMOKE:
        warmup, repeats = 0, 1
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def part(name: str):
    """Run a section, recording an exception instead of stopping the script."""

    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            log(f"\n== {name}")
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # keep going: one failed section must not hide the others
                RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}"
                log(f"!! {name} failed: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            log(f"   ({time.perf_counter() - t0:.1f} s)")
            save()  # after every part: a run stopped at its time limit still returns what it measured

        return run

    return wrap


def save() -> None:
    """Write RESULTS to $OUT/gpu_check.json (when OUT is set)."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=2, default=str)


def record_check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    log(f"   [{'ok' if ok else 'FAIL'}] {name}: {detail}")


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    actual = actual.detach().double().cpu()
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / (1.0 + expected.abs().max())).item()


# ------------------------------------------------------------------------------------------------ correctness


def _leaves(tensors, device, dtype):
    return [t.detach().to(device, dtype).requires_grad_() for t in tensors]


def check_take_rows(name, layout, device, dtype, tol, *, tokens=64, pre_gated=False, dedup=False):
    gen = torch.Generator().manual_seed(0)
    # float64 references of the values the kernels see (rounded to ``dtype`` first)
    cores64 = [
        c.to(dtype).double() for c in random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64, generator=gen)
    ]
    gates64 = [
        (torch.rand(r, generator=gen, dtype=torch.float64) + 0.5).to(dtype).double() for r in layout.internal_ranks
    ]
    index = torch.randint(0, layout.rows, (tokens,), generator=gen)
    index[: tokens // 4] = index[0]  # repeated ids
    ref_cores = [c.clone().requires_grad_() for c in cores64]
    ref_gates = [g.clone().requires_grad_() for g in gates64]
    ref = ops.take_rows(index, ops.gate_cores(ref_cores, ref_gates, layout), layout)
    cores, gates = _leaves(cores64, device, dtype), _leaves(gates64, device, dtype)
    if pre_gated:
        out = kernels.take_rows(index.to(device), ops.gate_cores(cores, gates, layout), layout, dedup=dedup)
    else:
        out = kernels.take_rows(index.to(device), cores, layout, gates, dedup=dedup)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(ref, ref_cores + ref_gates, grad)
    actual = torch.autograd.grad(out, cores + gates, grad.to(device, dtype))
    errs = [max_rel_err(out, ref)] + [max_rel_err(a, e) for a, e in zip(actual, expected)]
    record_check(
        name,
        max(errs) < tol and kernels.kernel_path(*cores) == "triton",
        f"path={kernels.kernel_path(*cores)} max rel err fwd {errs[0]:.2e}, grads {max(errs[1:]):.2e}",
    )


def check_merge(name, layout, device, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    # float64 references of the values the kernels see (rounded to ``dtype`` first)
    cores64 = [
        c.to(dtype).double() for c in random_tt_cores(layout.core_shapes, 1.0, dtype=torch.float64, generator=gen)
    ]
    gates64 = [
        (torch.rand(r, generator=gen, dtype=torch.float64) + 0.5).to(dtype).double() for r in layout.internal_ranks
    ]
    ref_cores = [c.clone().requires_grad_() for c in cores64]
    ref_gates = [g.clone().requires_grad_() for g in gates64]
    args = (layout.row_modes, layout.col_modes, layout.ranks)
    ref = ops.ttm_merge(ops.gate_cores(ref_cores, ref_gates, layout), *args)
    cores, gates = _leaves(cores64, device, dtype), _leaves(gates64, device, dtype)
    out = kernels.gated_ttm_merge(cores, gates, *args, fused=True)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(ref, ref_cores + ref_gates, grad)
    actual = torch.autograd.grad(out, cores + gates, grad.to(device, dtype))
    errs = [max_rel_err(out, ref)] + [max_rel_err(a, e) for a, e in zip(actual, expected)]
    record_check(name, max(errs) < tol, f"max rel err fwd {errs[0]:.2e}, grads {max(errs[1:]):.2e}")


def check_compiled(layout, device):
    gen = torch.Generator().manual_seed(2)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=gen), device, torch.float32)
    gates = _leaves([torch.rand(r, generator=gen) + 0.5 for r in layout.internal_ranks], device, torch.float32)
    index = torch.randint(0, layout.rows, (4, 32), generator=gen).to(device)

    def step(i, c, g):
        return kernels.take_rows(i, c, layout, g)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    if device.type == "cpu":  # interpreter: the ops cannot be decomposed into kernel launches (see docs/kernels.md)
        ctx = torch._functorch.config.patch(decompose_custom_triton_ops=False)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        out = compiled(index, cores, gates)
        grads = torch.autograd.grad(out.square().sum(), cores + gates)
    ref = step(index, cores, gates)
    ref_grads = torch.autograd.grad(ref.square().sum(), cores + gates)
    errs = [max_rel_err(out, ref)] + [max_rel_err(a, e) for a, e in zip(grads, ref_grads)]
    record_check("compile fullgraph lookup fwd+bwd", max(errs) < 1e-4, f"max rel err vs eager kernels {max(errs):.2e}")


@part("correctness")
def correctness(device, emb_layout, small_layouts):
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        tag = str(dtype).removeprefix("torch.")
        for k, layout in enumerate(small_layouts):
            check_take_rows(f"take_rows small{k} {tag}", layout, device, dtype, tol)
            check_merge(f"gated_merge small{k} {tag}", layout, device, dtype, tol)
        check_take_rows(f"take_rows emb {tag}", emb_layout, device, dtype, tol, tokens=256)
        check_take_rows(f"take_rows emb pre-gated {tag}", emb_layout, device, dtype, tol, tokens=256, pre_gated=True)
        check_take_rows(f"take_rows emb dedup {tag}", emb_layout, device, dtype, tol, tokens=256, dedup=True)
        check_merge(f"gated_merge emb {tag}", emb_layout, device, dtype, tol)
    check_compiled(small_layouts[-1], device)


# ---------------------------------------------------------------------------------------------------- timings


def timing(name: str, ms: float) -> float:
    RESULTS["timings"][name] = ms
    log(f"   {name:48s} {ms:9.3f} ms")
    return ms


def ratio(name: str, base_ms: float, other_ms: float, base: str = "dense") -> None:
    RESULTS["ratios"][name] = base_ms / other_ms
    log(f"   ratio {name:42s} {base_ms / other_ms:7.2f}x  ({base} / this; > 1 = faster than {base})")


def zipf_ids(n_tokens: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    ranks = torch.multinomial(weights, n_tokens, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks]


@part("embedding lookup")
def embedding(device, layout, tokens, dtype):
    gen = torch.Generator().manual_seed(3)
    dense = nn.Embedding(layout.rows, layout.cols).to(device, dtype)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=gen), device, dtype)
    gates = _leaves([torch.ones(r) for r in layout.internal_ranks], device, dtype)
    params = list(cores) + list(gates)
    grad = torch.randn(tokens, layout.cols, generator=gen).to(device, dtype)
    log(
        f"   {layout.rows}x{layout.cols} {layout.describe_modes()} ranks {layout.ranks}, {tokens} tokens, {dtype}, "
        f"TT params {layout.num_params} vs dense {layout.dense_params}"
    )
    for dist in ("uniform", "zipf"):
        ids = (
            torch.randint(0, layout.rows, (tokens,), generator=gen)
            if dist == "uniform"
            else zipf_ids(tokens, layout.rows, gen)
        ).to(device)
        RESULTS["timings"][f"emb {dist} distinct ids"] = int(ids.unique().numel())
        variants = {
            "dense": lambda: dense(ids),
            "ttm kernels": lambda: kernels.take_rows(ids, cores, layout, gates),
            "ttm kernels dedup": lambda: kernels.take_rows(ids, cores, layout, gates, dedup=True),
            "ttm aten": lambda: ops.take_rows(ids, ops.gate_cores(cores, gates, layout), layout),
        }
        for tag, fn in variants.items():
            with torch.no_grad():
                fwd = timing(f"emb {dist} fwd {tag}", bench(fn, device))

            def fwd_bwd(fn=fn, tag=tag):
                out = fn()
                out.backward(grad)

            both = timing(f"emb {dist} fwd+bwd {tag}", bench(fwd_bwd, device))
            if tag == "dense":
                dense_fwd, dense_both = fwd, both
            else:
                ratio(f"emb {dist} fwd {tag}", dense_fwd, fwd)
                ratio(f"emb {dist} fwd+bwd {tag}", dense_both, both)
        dense.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None


@part("gate fusion in core merges")
def gate_fusion(device, layout, dtype):
    gen = torch.Generator().manual_seed(4)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=gen), device, dtype)
    gates = _leaves([torch.rand(r, generator=gen) + 0.5 for r in layout.internal_ranks], device, dtype)
    d = len(layout.row_modes)
    h = (d + 1) // 2
    rows, cols, ranks = layout.row_modes, layout.col_modes, layout.ranks
    halves = {
        "left": (cores[:h], gates[: h - 1], rows[:h], cols[:h], ranks[: h + 1]),
        "right": (cores[h:], gates[h:], rows[h:], cols[h:], ranks[h:]),
    }
    for side, (cs, gs, rm, cm, rk) in halves.items():
        if len(cs) < 2:
            continue

        def fused(cs=cs, gs=gs, rm=rm, cm=cm, rk=rk):
            return kernels.gated_ttm_merge(cs, gs, rm, cm, rk, fused=True)

        def unfused(cs=cs, gs=gs, rm=rm, cm=cm, rk=rk):
            gated = [c * g for c, g in zip(cs, gs)] + list(cs[len(gs) :])
            return ops.ttm_merge(gated, rm, cm, rk)

        with torch.no_grad():
            f = timing(f"merge {side} fused kernel fwd", bench(fused, device, repeats=50))
            u = timing(f"merge {side} aten gate+merge fwd", bench(unfused, device, repeats=50))
        ratio(f"merge {side} fwd fused vs aten", u, f, "aten")
        grad = torch.randn(fused().shape, generator=gen).to(device, dtype)
        f = timing(f"merge {side} fused kernel fwd+bwd", bench(lambda: fused().backward(grad), device, repeats=50))
        u = timing(f"merge {side} aten gate+merge fwd+bwd", bench(lambda: unfused().backward(grad), device, repeats=50))
        ratio(f"merge {side} fwd+bwd fused vs aten", u, f, "aten")


@part("TT linear vs dense")
def linear(device, size, tokens, rank, dtype, compile_too):
    gen = torch.Generator().manual_seed(5)
    row_modes, col_modes = choose_layout_modes(size, size, TTFormat.TT)
    tt = TTMatrix.random(
        size,
        size,
        format=TTFormat.TT,
        row_modes=row_modes,
        col_modes=col_modes,
        max_rank=rank,
        std=1.0 / math.sqrt(3 * size),
        dtype=dtype,
        device=device,
    )
    tt_layer = TTLinear(tt)
    dense = nn.Linear(size, size, bias=False).to(device, dtype)
    log(f"   {size}x{size} {tt.layout.describe_modes()} ranks {tt.layout.ranks}, {tokens} tokens, {dtype}")
    x = torch.randn(tokens, size, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, size, generator=gen).to(device, dtype)
    layers = {"dense": dense, "tt": tt_layer}
    if compile_too:
        tt.prepare_plans()
        layers["dense compiled"] = torch.compile(dense)
        layers["tt compiled"] = torch.compile(tt_layer)
    for tag, layer in layers.items():

        def fwd_bwd(layer=layer):
            layer(x).backward(grad)

        with torch.no_grad():
            fwd = timing(f"linear fwd {tag}", bench(lambda layer=layer: layer(x), device))
        both = timing(f"linear fwd+bwd {tag}", bench(fwd_bwd, device))
        base = "dense compiled" if "compiled" in tag else "dense"
        if tag != base:
            ratio(f"linear fwd {tag}", RESULTS["timings"][f"linear fwd {base}"], fwd, base)
            ratio(f"linear fwd+bwd {tag}", RESULTS["timings"][f"linear fwd+bwd {base}"], both, base)


@part("TT linear: the fused low-rank chain (issue 44 item 5)")
def fused_chain(device, shapes, dtype, compile_too):
    """TT linears with ``kernels.FUSED_CHAIN`` off (the planner's aten GEMMs) and on (x·L·R in one Triton kernel
    forward, the same kernel + two GEMMs backward): outputs must agree; ratio = planned time / fused time."""
    gen = torch.Generator().manual_seed(7)
    x64 = torch.randn(37, 200, generator=gen, dtype=torch.float64)
    left64, right64 = torch.randn(200, 24, generator=gen, dtype=torch.float64), torch.randn(24, 300, generator=gen)
    out = kernels.lowrank_product(*(t.to(device, torch.float32) for t in (x64, left64, right64)))
    err = max_rel_err(out, x64 @ left64 @ right64.double())
    record_check("fused chain fp32 vs float64", err < 1e-5, f"max rel err {err:.2e}")
    previous = kernels.FUSED_CHAIN
    try:
        for n_in, n_out, rank, tokens in shapes:
            tag = f"{n_in}x{n_out} r{rank} {tokens} tok"
            dense = nn.Linear(n_in, n_out)
            layer = TTLinear.from_dense(dense, init="random", max_rank=rank).to(device, dtype)
            x = torch.randn(tokens, n_in, generator=gen).to(device, dtype).requires_grad_()
            grad = torch.randn(tokens, n_out, generator=gen).to(device, dtype)
            variants = {"planned": (False, layer), "fused": (True, layer)}
            if compile_too:
                layer.tt.prepare_plans()
                variants["planned compiled"] = (False, torch.compile(layer))
                variants["fused compiled"] = (True, torch.compile(layer))
            outputs, times = {}, {}
            for name, (fused, module) in variants.items():
                kernels.FUSED_CHAIN = fused
                with torch.no_grad():
                    outputs[name] = module(x).float()

                def fwd_bwd(module=module):
                    module(x).backward(grad)

                times[name] = timing(f"chain {tag} fwd+bwd {name}", bench(fwd_bwd, device))
            for name in outputs:
                if name.startswith("fused"):
                    base = name.replace("fused", "planned")
                    err = max_rel_err(outputs[name], outputs[base])
                    record_check(f"chain {tag} {name}", err < (3e-2 if dtype == torch.bfloat16 else 1e-4), f"{err:.2e}")
                    ratio(f"chain {tag} fwd+bwd {name}", times[base], times[name], base)
    finally:
        kernels.FUSED_CHAIN = previous


@part("TT linear: rank padding on the device")
def rank_padding(device, n_in, n_out, tokens, rank, dtype):
    from comera_fx.tt.plan import autograd as planned

    gen = torch.Generator().manual_seed(6)
    dense = nn.Linear(n_in, n_out)
    layer = TTLinear.from_dense(dense, init="random", max_rank=rank).to(device, dtype)
    x = torch.randn(tokens, n_in, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, n_out, generator=gen).to(device, dtype)
    devices = planned.PAD_DEVICES
    outputs, times = {}, {}
    try:
        for tag, padded in (("unpadded", devices - {device.type}), ("padded", devices | {device.type})):
            planned.PAD_DEVICES = frozenset(padded)
            with torch.no_grad():
                outputs[tag] = layer(x).float()

            def fwd_bwd():
                layer(x).backward(grad)

            times[tag] = timing(f"rank padding r{rank} fwd+bwd {tag}", bench(fwd_bwd, device))
    finally:
        planned.PAD_DEVICES = devices
    err = max_rel_err(outputs["padded"], outputs["unpadded"])
    record_check(
        f"rank padding r{rank} output", err < (3e-2 if dtype == torch.bfloat16 else 1e-4), f"max rel err {err:.2e}"
    )
    ratio(f"rank padding r{rank} fwd+bwd padded", times["unpadded"], times["padded"], "unpadded")


@part("compile once: rank adaptation under torch.compile (issue 30)")
def compile_once(device, smoke: bool):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_recompile  # the same model as the CPU figures in RESULTS.md
    from comera_fx.backend import make_backend
    from comera_fx.runtime import BudgetConfig, RankAdaptive

    torch.manual_seed(0)
    model, (x, y), loss_fn = bench_recompile.build(argparse.Namespace(model="lm", layers=2, dense=False))
    model, x, y = model.to(device), x.to(device), y.to(device)
    steps = 12 if smoke else 30
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = RankAdaptive(
        model, optimizer, BudgetConfig(keep_fraction=0.3, total_steps=steps, prunes=5, shrink_slack=4.0)
    )
    backend = make_backend(inductor=not smoke)
    compiled = torch.compile(model, backend=backend)
    times, graphs = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = loss_fn(compiled, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        graphs.append(backend.stats.graphs)
    median = statistics.median(times[1:])
    overhead = sum(t - median for t in times[1:])
    recompiles = graphs[-1] - graphs[0]
    with torch.no_grad():
        expected = model(x)  # the module itself runs eagerly
        got = compiled(x)
    rel = float((got.float() - expected.float()).norm() / expected.float().norm())
    timing("compile once: first step (compile)", 1e3 * times[0])
    timing("compile once: median step", 1e3 * median)
    RESULTS["ratios"]["compile once: post-prune overhead / first step"] = overhead / times[0]
    log(
        f"   post-prune overhead {overhead:.2f} s = {overhead / times[0]:.2f}x the first step; recompiles "
        f"{recompiles}; TT params {hook.initial_tt_params} -> {hook.live_tt_params()} live / {hook.stored_tt_params()} "
        f"stored"
    )
    record_check("compile once: at most 3 recompiles", recompiles <= 3, f"{recompiles} after the first step")
    record_check("compile once: compiled == eager after the last prune", rel < 1e-4, f"relative error {rel:.2e}")
    record_check(
        "compile once: the TT size shrank",
        hook.live_tt_params() < hook.initial_tt_params,
        f"{hook.initial_tt_params} -> {hook.live_tt_params()}",
    )
    hook.remove()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rank", type=int, default=32, help="TT linear max rank")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the linear layers")
    parser.add_argument(
        "--emb",
        metavar="ROWSxCOLS",
        help="another embedding table for the lookup and gate-fusion "
        "timings (TTM, 4 modes a side chosen by the library; default 32000x768 with CoMERA's modes)",
    )
    parser.add_argument("--emb-rank", type=int, default=32, help="internal ranks of --emb's table")
    parser.add_argument("--skip-compile-once", action="store_true", help="skip part 6 (a second run of the kernels)")
    args = parser.parse_args()
    global SMOKE
    SMOKE = args.smoke

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        log("no CUDA device: this script is for a GPU machine (use --smoke to check the script on CPU)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks compare IEEE kernels with IEEE aten
    RESULTS["env"] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "triton": _version("triton"),
        "kernels": kernels.kernel_path(torch.zeros(1, device=device)),
        "smoke": args.smoke,
    }
    log(f"env: {RESULTS['env']}")
    if RESULTS["env"]["kernels"] != "triton":
        log(f"!! kernels unavailable here ({kernels._impl_error}); timings below use the aten path")

    small = [
        TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1)),
        TTLayout(TTFormat.TTM, 37, 250, (2, 5, 4), (3, 11, 12), (1, 3, 70, 1)),
        TTLayout(TTFormat.TTM, 500, 60, (5, 4, 5, 5), (2, 3, 2, 5), (1, 6, 12, 7, 1)),
    ]
    if args.smoke:
        emb = TTLayout(TTFormat.TTM, 300, 48, (5, 6, 10), (2, 4, 6), (1, 4, 8, 1))
        tokens, lin_size, lin_tokens = 64, 64, 32
    elif args.emb:
        rows, cols = (int(v) for v in args.emb.lower().split("x"))
        row_modes, col_modes = choose_layout_modes(rows, cols, TTFormat.TTM, num_modes=4)
        emb = TTLayout(TTFormat.TTM, rows, cols, row_modes, col_modes, (1,) + (args.emb_rank,) * 3 + (1,))
        tokens, lin_size, lin_tokens = args.tokens, 4096, args.tokens
    else:
        emb = TTLayout(TTFormat.TTM, 32000, 768, (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1))
        tokens, lin_size, lin_tokens = args.tokens, 4096, args.tokens

    if not args.skip_compile_once:
        compile_once(device, args.smoke)  # first: issue 30's figure, the one a short lease must not lose
    correctness(device, emb, small)
    embedding(device, emb, tokens, torch.bfloat16 if device.type == "cuda" else torch.float32)
    gate_fusion(device, emb, torch.bfloat16 if device.type == "cuda" else torch.float32)
    linear(
        device,
        lin_size,
        lin_tokens,
        args.rank,
        torch.bfloat16 if device.type == "cuda" else torch.float32,
        compile_too=not args.no_compile and not args.smoke,
    )
    fused_chain(
        device,
        [(64, 96, 8, 32)]
        if args.smoke
        else [(4096, 4096, 32, args.tokens), (768, 768, 16, 2048), (768, 3072, 16, 2048)],
        torch.bfloat16 if device.type == "cuda" else torch.float32,
        compile_too=not args.no_compile and not args.smoke,
    )
    rank_padding(
        device,
        *((64, 96, 32, 5) if args.smoke else (768, 3072, args.tokens, 30)),
        torch.bfloat16 if device.type == "cuda" else torch.float32,
    )

    RESULTS["seconds"] = time.perf_counter() - t0
    failed = [k for k, v in RESULTS["checks"].items() if not v["ok"]]
    log(
        f"\nchecks: {len(RESULTS['checks']) - len(failed)} ok, {len(failed)} failed {failed or ''}; "
        f"errors: {list(RESULTS['errors']) or 'none'}; {RESULTS['seconds']:.0f} s"
    )
    save()
    return 1 if failed or RESULTS["errors"] else 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
