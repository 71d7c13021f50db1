"""Rank-adaptive training under ``torch.compile(model, backend=comera_fx backend)``: recompiles across prunes.

A model trains for ``--steps`` steps while RankAdaptive's budget schedule prunes at ``--prunes`` points, compiled
with comera_fx's backend from a fresh Inductor cache (a temporary ``TORCHINDUCTOR_CACHE_DIR`` unless ``--cache-dir``).

* ``--model lm`` (default): a byte-level pre-LN causal LM (``--layers`` 2 blocks, d 128, 4 heads, ff 512, seq 64,
  batch 8, tied 256-token head), every block linear tensorized at ``--max-rank`` (16) — the case of issue 30.
* ``--model mlp``: two 512-wide TT linears (the first version of this benchmark).
* ``--dense``: the LM left dense under stock ``torch.compile`` (Inductor), no pruning: its first step and Dynamo's
  compile-time table, the reference for where a TT model's cold compile time goes.

``--regional``: ``comera_fx.compile_regions(model)`` instead of compiling the whole model: each block compiled on
its own, one graph shared by every block of one shape (with ``--dense``: ``block.compile()`` per block, stock
Inductor); embeddings, head and loss run eagerly.

By default the hook runs with ``BudgetConfig``'s defaults: it finds the model compiled (comera_fx's backend saw its
cores; ``compile_regions`` marked the blocks), rounds in place at every prune point but the last, which shrinks
physically (one recompile in the run), and gives the blocks one shape per matrix role at that shrink (regional: one
graph for all blocks; whole model: one kernel code per role, compiled once by Inductor). On the
CPU at ``--max-rank`` ≤ 16 (the default) that last shrink is skipped: the stored cores already run the padded
16-wide GEMMs at any live rank (``RankAdaptive.compaction_keeps_gemm_widths``), so nothing recompiles; ``--max-rank
32`` measures the one-recompile path.

``--same-shape-blocks`` / ``--own-shape-blocks``: ``BudgetConfig(same_shape_blocks=True / False)``: at a physical
shrink the same matrix of every block is stored at one width (the widest live rank), so a regionally compiled model
recompiles one graph, not one per block / each block at its own ranks (the default for regional blocks before issue
44, for a whole-model compile before session 13).

``--slack S`` runs ``BudgetConfig(shrink_slack=S)``: a prune writes the rounded cores into the stored ones in place
while the stored TT size stays within S × the live size, so no shape changes and nothing recompiles. ``--slack 1``
shrinks physically at every prune (one recompile per prune: the default before issue 44).

Printed: per step the time, the backend's graph count and whether it pruned; then the first step (compile
included), the post-prune overhead (sum over the steps after the first of step time − median step) as a multiple
of the first step, the recompiles (graphs compiled after the first step), compiled vs eager after the last prune
(relative error of the logits), the TT size before / after (live and stored), the median compiled step before the
first prune and after the last one against their FLOPs (fwd + bwd, ``torch.utils.flop_counter``) and the eager step
at the same ranks, and Dynamo's compile-time table (``torch._dynamo.utils.compile_times``).

    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_recompile.py                  # LM, the defaults
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_recompile.py --max-rank 32    # one recompile at the end
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_recompile.py --slack 1        # one recompile per prune
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_recompile.py --layers 6 --regional   # one block's compile
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_recompile.py --layers 6 --regional --slack 1 \
        --own-shape-blocks                                                                     # before issue 44
    .venv/bin/python benchmarks/bench_recompile.py --no-inductor                            # AOTAutograd graphs eagerly
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import common  # benchmarks/common.py: this checkout first on sys.path, the example loader

common.use_this_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import comera_fx
from comera_fx.backend import make_backend
from comera_fx.runtime import BudgetConfig, RankAdaptive

VOCAB = 256


Block = common.load_example("train_code_lm").Block  # the demo's pre-LN block: one definition of it


class CausalLM(nn.Module):
    """Byte-level decoder; the head is tied to the (dense, 256-row) token embedding."""

    def __init__(self, layers: int, d_model: int, heads: int, d_ff: int, seq_len: int):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, d_ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def build(opts) -> tuple[nn.Module, tuple, callable]:
    """(tensorized model, (input, target), loss function of (model, input, target)); dense with ``--dense``."""
    if opts.model == "lm":
        model = CausalLM(opts.layers, 128, 4, 512, 64)
        if not opts.dense:
            comera_fx.tensorize_(
                model,
                comera_fx.TensorizeConfig(max_rank=opts.max_rank, min_numel=4096),
                filter_fn=lambda module, fqn: isinstance(module, nn.Linear),
            )
        data = torch.randint(0, VOCAB, (8, 65))
        batch = (data[:, :-1], data[:, 1:])

        def loss_fn(m, x, y):
            return F.cross_entropy(m(x).reshape(-1, VOCAB), y.reshape(-1))
    else:
        d = opts.width
        model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=opts.max_rank, min_numel=1, min_dim=1))
        batch = (torch.randn(opts.batch, d), torch.randn(opts.batch, d))

        def loss_fn(m, x, y):
            return ((m(x) - y) ** 2).mean()

    return model, batch, loss_fn


def train_step(model, optimizer, loss_fn, batch) -> float:
    t0 = time.perf_counter()
    loss = loss_fn(model, *batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def step_flops(model, loss_fn, batch) -> int:
    """Forward + backward FLOPs of one step, counted by torch's FLOP counter on the eager model."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model, *batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def eager_step_seconds(model, loss_fn, batch, steps: int = 5) -> float:
    """Median training step of an eager copy of ``model`` with its own AdamW (the run itself is left alone)."""
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    times = [train_step(twin, optimizer, loss_fn, batch) for _ in range(steps + 1)]
    return statistics.median(times[1:])


def dense_first_steps(model, batch, loss_fn, regional: bool, steps: int = 5) -> None:
    """The dense model under stock torch.compile: first step (the cold compile) and median step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    if regional:
        for block in model.blocks:
            block.compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    times = [train_step(compiled, optimizer, loss_fn, batch) for _ in range(steps)]
    label = "stock torch.compile" + (" per block" if regional else "")
    print(
        f"dense, {label}: first step (compile) {times[0]:.1f} s; median step "
        f"{statistics.median(times[1:]):.4f} s; Inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}"
    )
    print("\nDynamo compile times:\n" + str(torch._dynamo.utils.compile_times(repr="str")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("lm", "mlp"), default="lm")
    ap.add_argument("--layers", type=int, default=2, help="LM blocks")
    ap.add_argument("--width", type=int, default=512, help="MLP width")
    ap.add_argument("--batch", type=int, default=256, help="MLP batch")
    ap.add_argument("--max-rank", type=int, default=16, help="TensorizeConfig.max_rank")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prunes", type=int, default=5)
    ap.add_argument("--target-ratio", type=float, default=0.3)
    ap.add_argument("--slack", type=float, default=None, help="BudgetConfig.shrink_slack (default: the hook's choice)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--cache-dir", help="Inductor cache directory (default: a fresh temporary one)")
    ap.add_argument("--dense", action="store_true", help="the dense LM under stock torch.compile, first steps only")
    ap.add_argument("--regional", action="store_true", help="compile each LM block on its own (compile_regions)")
    ap.add_argument(
        "--same-shape-blocks",
        action="store_const",
        const=True,
        default=None,
        help="BudgetConfig(same_shape_blocks=True): one stored width per matrix role across blocks",
    )
    ap.add_argument(
        "--own-shape-blocks",
        dest="same_shape_blocks",
        action="store_const",
        const=False,
        help="BudgetConfig(same_shape_blocks=False): each block stored at its own live ranks",
    )
    opts = ap.parse_args(argv)
    # A cold compile: Inductor's caches start empty. (Importing torch's Inductor sets TORCHINDUCTOR_CACHE_DIR to
    # its shared default, so the variable is always set by now: override it unless --cache-dir names one.)
    fresh = opts.cache_dir or common.temporary_inductor_cache("bench_recompile_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    model, batch, loss_fn = build(opts)
    if opts.dense:
        dense_first_steps(model, batch, loss_fn, opts.regional)
        return
    flops_before = step_flops(model, loss_fn, batch)
    eager_before = eager_step_seconds(model, loss_fn, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    slack = opts.slack
    hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(
            keep_fraction=opts.target_ratio,
            total_steps=opts.steps,
            prunes=opts.prunes,
            shrink_slack=slack,
            same_shape_blocks=opts.same_shape_blocks,
        ),
    )
    backend = make_backend(inductor=not opts.no_inductor)
    torch._dynamo.reset()
    if opts.regional:
        regions = comera_fx.compile_regions(model, backend=backend)
        print(f"compiled regions: {', '.join(regions)}")
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    rows = []
    for step in range(1, opts.steps + 1):
        seconds = train_step(compiled, optimizer, loss_fn, batch)
        print(f"step {step}: {seconds:.3f} s, graphs {backend.stats.graphs}", flush=True)
        rows.append((step, seconds, backend.stats.graphs, bool(hook.history[-1].shrunk), hook.stored_tt_params()))
    first = rows[0][1]
    median = statistics.median(t for _, t, _, _, _ in rows[1:])
    overhead = sum(t - median for _, t, _, _, _ in rows[1:])
    recompiles = backend.stats.graphs - rows[0][2]
    prune_steps = [s for s, _, _, p, _ in rows if p]
    print(f"{'step':>4} {'s':>8} graphs pruned stored-TT-params")
    for step, t, graphs, pruned, stored in rows:
        print(f"{step:4d} {t:8.3f} {graphs:6d} {'yes' if pruned else '':6s} {stored}")
    print(
        f"\nmodel {opts.model}, {opts.layers} blocks{', regional' if opts.regional else ''}"
        f", same_shape_blocks {opts.same_shape_blocks}, slack {slack}, hook saw {hook.compiled_as}, "
        f"inductor {not opts.no_inductor}, threads {opts.threads}, Inductor "
        f"cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}"
    )
    print(f"first step (compile) {first:.1f} s; median step {median:.4f} s; prunes at {prune_steps}")
    print(
        f"post-prune overhead {overhead:.1f} s = {overhead / first:.2f}x the first step; graphs compiled "
        f"{backend.stats.graphs} (first step {rows[0][2]}, recompiles after it {recompiles}); backend "
        f"compile_seconds {backend.stats.compile_seconds:.1f}, pass_seconds {backend.stats.pass_seconds:.1f}, "
        f"AOTAutograd cache hits {backend.stats.cache_hits}"
    )
    x, _ = batch
    # Regional: the model's own blocks are compiled in place; a deep copy drops the compiled calls (eager).
    eager_model = copy.deepcopy(model) if opts.regional else model
    with torch.no_grad():
        expected = eager_model(x)
    got = compiled(x).detach()  # grad on: the training graph, no new compile
    rel = ((got - expected).norm() / expected.norm()).item()
    print(f"compiled vs eager after the last prune: relative error {rel:.2e}; graphs {backend.stats.graphs}")
    print(
        f"TT params: before {hook.initial_tt_params}, after {hook.live_tt_params()} live / {hook.stored_tt_params()} "
        f"stored (target {hook.target_size:.0f})"
    )
    hook.remove()
    flops_after = step_flops(eager_model, loss_fn, batch)
    eager_after = eager_step_seconds(model, loss_fn, batch)
    unpruned = statistics.median(t for s, t, _, _, _ in rows[1:] if s < prune_steps[0]) if prune_steps else median
    pruned = (
        statistics.median(t for s, t, _, _, _ in rows if prune_steps and s > prune_steps[-1] + 1)
        if prune_steps and prune_steps[-1] + 1 < opts.steps
        else median
    )
    print(
        f"compiled step: unpruned {unpruned:.4f} s, after the last prune {pruned:.4f} s (ratio "
        f"{pruned / unpruned:.2f}); fwd+bwd FLOPs {flops_before:.3g} -> {flops_after:.3g} (ratio "
        f"{flops_after / flops_before:.2f}); eager step {eager_before:.4f} -> {eager_after:.4f} s "
        f"(compiled / eager: {unpruned / eager_before:.2f} unpruned, {pruned / eager_after:.2f} pruned)"
    )
    print("\nDynamo compile times:\n" + str(torch._dynamo.utils.compile_times(repr="str")))


if __name__ == "__main__":
    main()
