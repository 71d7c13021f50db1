"""Benchmark one TT linear layer, forward + backward, against dense ``nn.Linear`` and other contraction orders.

Every grid point (shape, tokens, rank) times, side by side in one run and interleaved round-robin (so a burst of
load on a shared machine hits every column alike), forward + backward in fp32 on the CPU of:

* ``dense``    — ``nn.Linear(in, out, bias=False)``: the baseline every other column is a ratio to;
* ``tltorch``  — tensorly-torch ``FactorizedLinear(factorization="blocktt", implementation="factorized")`` (TTM
                 format over the same modes, uniform rank chosen so its parameter count is the closest to the TT
                 layer's); skipped with a note when tensorly-torch is not installed;
* ``naive``    — the left-deep tree x·G1·G2·…·Gn (``Plan.from_tree`` on ``build_network``'s network);
* ``greedy``   — opt_einsum's ``greedy`` path on the concrete shapes (b = tokens), converted to a ``Plan`` tree;
* ``comera``   — CoMERA's (x·L)·R with L = (G1·G2)·…, R = …·(G5·G6) merged from the cores;
* ``best``     — the fastest measured plan among: every plan on the planner's envelope (all batch sizes), naive,
                 greedy, comera, and up to 20 random connected trees (each pairwise step shares an index; trees
                 predicted to cost > ``--random-cap`` × the planner's choice are not timed and counted as skipped);
* ``planner``  — ``choose_plan(planned_envelope(layout, "matmul"), tokens)`` run with ``plan.execute``;
* ``module``   — the eager ``TTLinear`` module (``TTLinear.from_dense(..., init="random")``; its forward folds the
                 rank gates into the cores on every call and also trains the gates);
* ``LR``       — reference, not a TT layer: plain low-rank (x·L)·R with L (in × r) and R (r × out) as leaf
                 parameters, r = the TT layer's middle bond — what the TT layer costs when merging is free.

Loss: ``y.backward(dy)`` with a fixed random ``dy`` (a fixed random projection of y); gradients for x and every
parameter (cores, and the module's gates). No bias anywhere. All plan columns run on the raw cores (gates = 1).

Also printed per point: the planner's predicted time (cost / measured GEMM rate) next to the measured one, and the
"floor": max(FLOPs / GEMM rate, minimum bytes / copy bandwidth), with FLOPs = the fewest fwd+bwd FLOPs of any
timed plan and minimum bytes = 4·(3·b·in + 2·b·out + 2·params) (read x, write y, read dy, read x again, write dx;
read the parameters, write their gradients); shown as measured / floor for the planner's choice.

Noise handling: each column's median over ``--repeats`` interleaved rounds (cheap groups get more, see
``--group-seconds``); where the planner's choice is not the fastest plan, the two are re-timed head to head
(``--confirm``), because the fastest of ~10-25 noisy medians is biased low; the GEMM rate and bandwidth are measured
at the start, before each group when waiting for quiet, and at the end, and the best seen is used. On a shared
machine other busy processes wreck 2-thread OpenMP timings of many small GEMMs (a TT step goes from ~25 ms to
~300 ms), so the CPU time other processes used during each group is recorded (``others``, in cores, from
/proc/stat) and ``--retries`` / ``--wait-quiet`` measure a disturbed group again / wait for quiet first.

Usage::

    python benchmarks/bench_tt_linear.py --quick                # the default subset, ~10 minutes on 2 idle cores
    python benchmarks/bench_tt_linear.py --quick --profile --retries 2 --wait-quiet 90   # on a shared machine
    python benchmarks/bench_tt_linear.py --shapes 768x768 --tokens 64,4096 --ranks 16,30 --repeats 7
    python benchmarks/bench_tt_linear.py                        # the full grid (hours: dense 4096² at 16384 tokens)

``--profile`` adds, at 4096 tokens, the split of the planner's plan into the b-independent core merge and the
b-dependent GEMMs. ``--json PATH`` keeps every measurement (all plans with their predicted costs, min times).

Optional baseline: ``pip install tensorly tensorly-torch`` (benchmark only, not a dependency of comera_fx).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import opt_einsum as oe
import torch
from torch import nn

from comera_fx.tt import TTFormat, TTLayout, TTLinear
from comera_fx.tt import plan as planner
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.plan_cache import choose_plan, planned_envelope
from comera_fx.tt.shapes import capped_ranks

try:  # optional baseline
    import tltorch
except ImportError:  # pragma: no cover - depends on the environment
    tltorch = None

# name -> (in, out, row modes, col modes). 768 ones are CoMERA's; 4096 uses comera_fx's automatic modes (8^4).
SHAPES = {
    "768x768": (768, 768, (12, 8, 8), (8, 8, 12)),
    "768x3072": (768, 3072, (12, 8, 8), (12, 16, 16)),
    "4096x4096": (4096, 4096, (8, 8, 8, 8), (8, 8, 8, 8)),
}
FULL_TOKENS = (1, 64, 512, 4096, 16384)
FULL_RANKS = (8, 16, 32, 64, 128)
QUICK_TOKENS = (64, 512, 4096)
QUICK_RANKS = {"768x768": (16, 30, 32), "768x3072": (16, 30, 32), "4096x4096": (16, 32)}

# Targets: (shape, rank) -> required dense / TT speed-up at 4096 tokens.
SPEEDUP_TARGETS = {("4096x4096", 32): 25.0, ("768x768", 30): 7.0, ("768x3072", 30): 5.5}
REFERENCE_NOTES = {("4096x4096", 32): (15.4, 15.6), ("768x768", 30): (5.0, 4.7), ("768x3072", 30): (3.7, 3.9)}


# -------------------------------------------------------------------------------------------- machine figures


def _best_seconds(fn, repeat: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_rates(rounds: int = 3, repeat: int = 5) -> tuple[float, float]:
    """(best square fp32 GEMM FLOP/s, best large-copy bytes/s counting read + write), interleaved rounds."""
    a, b, out = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.empty(1024, 1024)
    src = torch.randn((256 << 20) // 4)
    dst = torch.empty_like(src)
    rates, bws = [], []
    for _ in range(rounds):
        rates.append(2.0 * 1024**3 / _best_seconds(lambda: torch.mm(a, b, out=out), repeat))
        bws.append(2.0 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeat))
    return max(rates), max(bws)


# ------------------------------------------------------------------------------------------- other load


class OtherLoad:
    """CPU time used by *other* processes between two calls, in cores (Linux /proc/stat; None elsewhere).

    With 2 OpenMP threads on a 2-core machine, any other busy process makes each parallel region wait for a
    descheduled thread: a TT layer runs ~40 small GEMMs per step and suffers far more than dense (3 large ones), so
    a disturbed group is detected (others' busy cores during it) and, with --retries, measured again.
    """

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / hz
        own = sum(os.times()[:2])
        return busy, own, time.perf_counter()

    def cores(self) -> float | None:
        end = self._read()
        if end is None or self.start is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / wall) if wall > 0 else None


def wait_for_quiet(max_wait: float, threshold: float, log) -> float | None:
    """Sleep (up to max_wait seconds) until other processes use less than ``threshold`` cores over 2 s."""
    deadline = time.perf_counter() + max_wait
    while True:
        probe = OtherLoad()
        time.sleep(2.0)
        others = probe.cores()
        if others is None or others < threshold or time.perf_counter() >= deadline:
            return others
        log(f"#   waiting: other processes use {others:.2f} cores")
        time.sleep(8.0)


# ----------------------------------------------------------------------------------------------------- trees


def chain(ids) -> planner.Tree:
    node = ids[0]
    for t in ids[1:]:
        node = (node, t)
    return node


def naive_tree(net: planner.TTNetwork) -> planner.Tree:
    return chain(list(range(net.n_tensors)))


def comera_tree(net: planner.TTNetwork) -> planner.Tree:
    """(x·L)·R: L = ((G1·G2)·G3)… merged left to right, R = …(G5·G6) merged right to left (as in ops.py)."""
    d = len(net.in_modes)
    n = net.n_tensors - 1
    left = chain(list(range(1, d + 1)))
    right = n
    for k in range(n - 1, d, -1):
        right = (k, right)
    return ((0, left), right)


def einsum_of(net: planner.TTNetwork, batch: int) -> tuple[str, list[tuple[int, ...]]]:
    sym = {i: oe.get_symbol(i) for i in range(len(net.sizes))}
    size = lambda i: batch if i == 0 else net.sizes[i]  # noqa: E731
    terms = ["".join(sym[i] for i in idx) for idx in net.tensor_indices]
    eq = ",".join(terms) + "->" + "".join(sym[i] for i in net.output)
    return eq, [tuple(size(i) for i in idx) for idx in net.tensor_indices]


def greedy_tree(net: planner.TTNetwork, batch: int) -> planner.Tree:
    """opt_einsum's greedy path on concrete shapes (linear format: pop i < j, append the result) as a tree."""
    eq, shapes = einsum_of(net, batch)
    path, _ = oe.contract_path(eq, *shapes, shapes=True, optimize="greedy")
    nodes: list = list(range(net.n_tensors))
    for step in path:
        if len(step) != 2:
            raise ValueError(f"greedy path has a non-pairwise step {step}")
        i, j = sorted(step)
        right, left = nodes.pop(j), nodes.pop(i)
        nodes.append((left, right))
    (tree,) = nodes
    return tree


def random_connected_trees(net: planner.TTNetwork, count: int, seed: int, exclude: set) -> list[planner.Tree]:
    """Up to ``count`` distinct random trees in which every pairwise step shares at least one index."""
    rng = random.Random(seed)
    found, seen = [], set(exclude)
    for _ in range(count * 50):
        if len(found) >= count:
            break
        nodes = [(t, 1 << t) for t in range(net.n_tensors)]
        while len(nodes) > 1:
            pairs = [
                (i, j)
                for i in range(len(nodes))
                for j in range(i + 1, len(nodes))
                if net.open_indices(nodes[i][1]) & net.open_indices(nodes[j][1])
            ]
            i, j = rng.choice(pairs)
            (tj, mj), (ti, mi) = nodes.pop(j), nodes.pop(i)
            nodes.append(((ti, tj), mi | mj))
        tree = planner.Plan.from_tree(net, nodes[0][0]).tree  # canonical form
        if tree not in seen:
            seen.add(tree)
            found.append(tree)
    return found


# ---------------------------------------------------------------------------------------------- runnables


@dataclass
class Column:
    """One timed thing: ``run()`` does forward + backward once."""

    key: str
    run: object
    times: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _fresh_grads(tensors) -> None:
    for t in tensors:
        t.grad = None


def plan_runner(chosen: planner.Plan, x, cores, layout, dy):
    leaves = [x, *cores]

    def run():
        _fresh_grads(leaves)
        planner.execute(chosen, x, cores, layout).backward(dy)

    return run


def module_runner(module: nn.Module, x, dy):
    params = [x, *module.parameters()]

    def run():
        _fresh_grads(params)
        module(x).backward(dy)

    return run


def lowrank_runner(x, left, right, dy):
    leaves = [x, left, right]

    def run():
        _fresh_grads(leaves)
        ((x @ left) @ right).backward(dy)

    return run


def blocktt_rank(in_modes, out_modes, target_params: int) -> tuple[int, int]:
    """Uniform BlockTT rank whose parameter count is closest to ``target_params`` -> (rank, params)."""
    sizes = [a * b for a, b in zip(in_modes, out_modes)]

    def params(r: int) -> int:
        ranks = [1] + [r] * (len(sizes) - 1) + [1]
        return sum(ranks[k] * s * ranks[k + 1] for k, s in enumerate(sizes))

    best = min(range(1, 1025), key=lambda r: (abs(params(r) - target_params), r))
    return best, params(best)


# -------------------------------------------------------------------------------------------------- one group


@dataclass
class RankCase:
    rank: int
    layout: TTLayout
    net: planner.TTNetwork
    envelope: planner.PlanEnvelope
    cores: list
    module: TTLinear
    lr: tuple
    tl_layer: object
    tl_rank: int | None
    tl_params: int | None
    random_trees: list


def build_rank_case(shape: str, rank: int, seed: int) -> RankCase:
    n_in, n_out, rows, cols = SHAPES[shape]
    ranks = capped_ranks(rows + cols, rank)
    layout = TTLayout(TTFormat.TT, n_in, n_out, rows, cols, ranks)
    net = planner.build_network(layout, "matmul")
    envelope = planned_envelope(layout, "matmul", device="cpu")
    gen = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(3.0 * n_in)
    cores = [c.requires_grad_() for c in random_tt_cores(layout.core_shapes, std, generator=gen)]
    torch.manual_seed(seed)
    module = TTLinear.from_dense(
        nn.Linear(n_in, n_out, bias=False), init="random", max_rank=rank, row_modes=rows, col_modes=cols
    )
    if module.tt.layout != layout:
        raise RuntimeError(f"module layout {module.tt.layout} != {layout}")
    r_mid = ranks[len(rows)]
    lr = (
        torch.randn(n_in, r_mid).mul_(n_in**-0.5).requires_grad_(),
        torch.randn(r_mid, n_out).mul_(r_mid**-0.5).requires_grad_(),
    )
    tl_layer, tl_rank, tl_params = None, None, None
    if tltorch is not None and len(rows) == len(cols):
        tl_rank, tl_params = blocktt_rank(rows, cols, layout.num_params)
        tl_layer = tltorch.FactorizedLinear(
            rows, cols, bias=False, factorization="blocktt", rank=tl_rank, implementation="factorized"
        )
        got = sum(p.numel() for p in tl_layer.parameters())
        if got != tl_params:
            raise RuntimeError(f"tltorch layer has {got} parameters, expected {tl_params}")
    known = {p.tree for p in envelope.plans} | {
        planner.Plan.from_tree(net, naive_tree(net)).tree,
        planner.Plan.from_tree(net, comera_tree(net)).tree,
    }
    trees = random_connected_trees(net, 20, seed, known)
    return RankCase(rank, layout, net, envelope, cores, module, lr, tl_layer, tl_rank, tl_params, trees)


def measure_group(
    shape: str,
    tokens: int,
    cases: list[RankCase],
    repeats: int,
    warmup: int,
    random_cap: float,
    seed: int,
    log,
    group_seconds: float = 0.0,
    confirm_factor: int = 3,
) -> list[dict]:
    """Time dense + every rank's columns for one (shape, tokens), interleaved; one result dict per rank."""
    n_in, n_out, _, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, n_in, generator=gen).requires_grad_()
    dy = torch.randn(tokens, n_out, generator=gen)
    torch.manual_seed(seed)
    dense = nn.Linear(n_in, n_out, bias=False)
    columns: list[Column] = [Column("dense", module_runner(dense, x, dy))]
    per_case = []
    for case in cases:
        net, model = case.net, case.envelope.model
        chosen = choose_plan(case.envelope, tokens)
        named = {"naive": naive_tree(net), "comera": comera_tree(net), "greedy": greedy_tree(net, tokens)}
        plans: dict = {}  # canonical tree -> (Plan, labels)

        def add(tree, label):
            p = planner.Plan.from_tree(net, tree, model)
            plans.setdefault(p.tree, [p, []])[1].append(label)

        for k, p in enumerate(case.envelope.plans):
            add(p.tree, f"env{k + 1}")
        for label, tree in named.items():
            add(tree, label)
        chosen_cost = float(chosen.cost(tokens))
        skipped = 0
        for k, tree in enumerate(case.random_trees):
            p = planner.Plan.from_tree(net, tree, model)
            if p.tree in plans:
                continue
            if float(p.cost(tokens)) > random_cap * chosen_cost:
                skipped += 1
                continue
            add(tree, f"rnd{k + 1}")
        tag = f"r{case.rank}"
        for tree, (p, labels) in plans.items():
            columns.append(Column(f"{tag}:plan:{'/'.join(labels)}", plan_runner(p, x, case.cores, case.layout, dy)))
        columns.append(Column(f"{tag}:module", module_runner(case.module, x, dy)))
        columns.append(Column(f"{tag}:LR", lowrank_runner(x, *case.lr, dy)))
        if case.tl_layer is not None:
            columns.append(Column(f"{tag}:tltorch", module_runner(case.tl_layer, x, dy)))
        per_case.append((case, chosen, named, plans, skipped))

    round_start = time.perf_counter()
    for _ in range(warmup):
        for col in columns:
            col.run()
    round_s = (time.perf_counter() - round_start) / max(warmup, 1)
    # Cheap groups (few tokens) get more repeats, up to 10x, so that each is timed for about group_seconds.
    repeats = max(repeats, min(10 * repeats, math.ceil(group_seconds / max(round_s, 1e-6))))
    confirm_repeats = confirm_factor * repeats
    for rep in range(repeats):
        order = columns if rep % 2 == 0 else columns[::-1]  # alternate direction: no column always runs first
        for col in order:
            start = time.perf_counter()
            col.run()
            col.times.append(time.perf_counter() - start)

    by_key = {c.key: c for c in columns}
    dense_t = by_key["dense"].median
    results = []
    for case, chosen, named, plans, skipped in per_case:
        tag = f"r{case.rank}"
        plan_times = {}
        for tree, (p, labels) in plans.items():
            plan_times[tree] = (by_key[f"{tag}:plan:{'/'.join(labels)}"].median, p, labels)

        def t_of(tree):
            return plan_times[planner.Plan.from_tree(case.net, tree).tree][0]

        best_tree = min(plan_times, key=lambda t: plan_times[t][0])
        best_t, best_plan, best_labels = plan_times[best_tree]
        chosen_t = plan_times[chosen.tree][0]
        confirm = None
        if best_tree != chosen.tree and confirm_repeats > 0:
            # The best of ~25 noisy medians is biased low (winner's curse): re-time the planner's choice against
            # the measured best head to head, interleaved, with more repeats, and judge the 10% target on that.
            pair = [
                Column("planner", by_key[f"{tag}:plan:{'/'.join(plan_times[chosen.tree][2])}"].run),
                Column("best", by_key[f"{tag}:plan:{'/'.join(best_labels)}"].run),
            ]
            for rep in range(confirm_repeats):
                for col in pair if rep % 2 == 0 else pair[::-1]:
                    start = time.perf_counter()
                    col.run()
                    col.times.append(time.perf_counter() - start)
            confirm = {"planner_s": pair[0].median, "best_s": pair[1].median, "n": confirm_repeats}
        min_flops = min(float(p.flops(tokens)) for _, p, _ in plan_times.values())
        min_bytes = 4 * (3 * tokens * n_in + 2 * tokens * n_out + 2 * case.layout.num_params)
        res = {
            "shape": shape,
            "tokens": tokens,
            "rank": case.rank,
            "ranks": list(case.layout.ranks),
            "repeats": repeats,
            "load1": os.getloadavg()[0],
            "params_tt": case.layout.num_params,
            "params_dense": n_in * n_out,
            "dense_s": dense_t,
            "naive_s": t_of(named["naive"]),
            "greedy_s": t_of(named["greedy"]),
            "comera_s": t_of(named["comera"]),
            "best_s": best_t,
            "best_plan": str(best_plan),
            "best_labels": best_labels,
            "planner_s": chosen_t,
            "planner_plan": str(chosen),
            "greedy_plan": str(plans[planner.Plan.from_tree(case.net, named["greedy"]).tree][0]),
            "module_s": by_key[f"{tag}:module"].median,
            "LR_s": by_key[f"{tag}:LR"].median,
            "tltorch_s": by_key[f"{tag}:tltorch"].median if case.tl_layer is not None else None,
            "tltorch_rank": case.tl_rank,
            "tltorch_params": case.tl_params,
            "n_plans_timed": len(plans),
            "n_random_skipped": skipped,
            "confirm": confirm,
            "ratio_raw": chosen_t / best_t,
            "ratio": confirm["planner_s"] / confirm["best_s"] if confirm else chosen_t / best_t,
            "planner_cost": float(chosen.cost(tokens)),
            "dense_flops": 6.0 * tokens * n_in * n_out,
            "dense_bytes": 4 * (3 * tokens * n_in + 2 * tokens * n_out + 2 * n_in * n_out),
            "planner_pred_s": float(chosen.cost(tokens)) / RATES["gemm"],
            "planner_flops": float(chosen.flops(tokens)),
            "min_flops": min_flops,
            "min_bytes": min_bytes,
            "floor_s": max(min_flops / RATES["gemm"], min_bytes / RATES["bw"]),
            "dense_floor_s": max(
                6.0 * tokens * n_in * n_out / RATES["gemm"],
                4 * (3 * tokens * n_in + 2 * tokens * n_out + 2 * n_in * n_out) / RATES["bw"],
            ),
            "min_s": {
                k.split(":", 1)[-1] if k.startswith(tag) else k: min(c.times)
                for k, c in by_key.items()
                if k == "dense" or k.startswith(tag + ":")
            },
            "best_min_s": min(
                min(by_key[f"{tag}:plan:{'/'.join(labels)}"].times) for _, _, labels in plan_times.values()
            ),
            "planner_min_s": min(by_key[f"{tag}:plan:{'/'.join(plan_times[chosen.tree][2])}"].times),
            "all_plans": {str(p): [t, labels, float(p.cost(tokens))] for t, p, labels in plan_times.values()},
        }
        results.append(res)
        log(format_row(res))
    return results


RATES: dict = {}


def update_rates(rounds: int, log) -> None:
    """Measure the GEMM rate and bandwidth again and keep the best seen (load only ever slows them down)."""
    probe = OtherLoad()
    gemm, bw = machine_rates(rounds)
    others = probe.cores()
    RATES["gemm"], RATES["bw"] = max(RATES.get("gemm", 0.0), gemm), max(RATES.get("bw", 0.0), bw)
    log(
        f"# GEMM rate (1024² fp32 mm) {gemm / 1e9:.1f} GFLOP/s, copy bandwidth (256 MiB, read+write) "
        f"{bw / 1e9:.2f} GB/s, other processes {'?' if others is None else f'{others:.2f}'} cores; best so far "
        f"{RATES['gemm'] / 1e9:.1f} GFLOP/s, {RATES['bw'] / 1e9:.2f} GB/s"
    )


def finalize(results: list[dict]) -> None:
    """Predicted times and floors from the best GEMM rate and bandwidth seen during the whole run."""
    for r in results:
        r["planner_pred_s"] = r["planner_cost"] / RATES["gemm"]
        r["floor_s"] = max(r["min_flops"] / RATES["gemm"], r["min_bytes"] / RATES["bw"])
        r["dense_floor_s"] = max(r["dense_flops"] / RATES["gemm"], r["dense_bytes"] / RATES["bw"])


# ---------------------------------------------------------------------------------------------------- output


HEADER = (
    f"{'shape':>9} {'tok':>5} {'r':>3} {'dense ms':>9} | {'tltorch':>7} {'naive':>6} {'greedy':>6} "
    f"{'comera':>6} {'best':>6} {'planner':>7} {'module':>6} {'LR':>6} | {'pl/best':>7} "
    f"{'pred ms':>8} {'meas ms':>8} {'/floor':>6} | repeats, 1-min load | best plan"
)


def _ratio(dense: float, t) -> str:
    return f"{dense / t:.2f}" if t else "-"


def format_row(r: dict) -> str:
    d = r["dense_s"]
    return (
        f"{r['shape']:>9} {r['tokens']:>5} {r['rank']:>3} {d * 1e3:>9.2f} | {_ratio(d, r['tltorch_s']):>7} "
        f"{_ratio(d, r['naive_s']):>6} {_ratio(d, r['greedy_s']):>6} {_ratio(d, r['comera_s']):>6} "
        f"{_ratio(d, r['best_s']):>6} {_ratio(d, r['planner_s']):>7} {_ratio(d, r['module_s']):>6} "
        f"{_ratio(d, r['LR_s']):>6} | {r['ratio']:>7.3f} {r['planner_pred_s'] * 1e3:>8.3f} "
        f"{r['planner_s'] * 1e3:>8.3f} {r['planner_s'] / r['floor_s']:>6.1f} | n={r['repeats']} "
        f"load={r['load1']:.1f} | {r['best_plan']}"
        + ("" if r["best_plan"] == r["planner_plan"] else f"  (planner: {r['planner_plan']})")
    )


def _others(r: dict) -> str:
    others = r.get("others_cores")
    return "-" if others is None else f"{others:.2f}"


def _pl_best(r: dict) -> str:
    """planner / best: the head-to-head re-timing where there was one (raw ratio in brackets)."""
    if r["confirm"] is None:
        return f"{r['ratio']:.3f}"
    return f"{r['ratio']:.3f} ({r['ratio_raw']:.3f})"


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| shape | tokens | rank | dense ms | tltorch | naive | greedy | comera | best | planner | module | "
        "LR | planner/best (raw) | pred ms | planner ms | planner/floor | dense/floor | n | load | others |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d = r["dense_s"]
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['rank']} | {d * 1e3:.1f} | {_ratio(d, r['tltorch_s'])} | "
            f"{_ratio(d, r['naive_s'])} | {_ratio(d, r['greedy_s'])} | {_ratio(d, r['comera_s'])} | "
            f"{_ratio(d, r['best_s'])} | {_ratio(d, r['planner_s'])} | {_ratio(d, r['module_s'])} | "
            f"{_ratio(d, r['LR_s'])} | {_pl_best(r)} | {r['planner_pred_s'] * 1e3:.3f} | "
            f"{r['planner_s'] * 1e3:.3f} | {r['planner_s'] / r['floor_s']:.1f} | {d / r['dense_floor_s']:.1f} | "
            f"{r['repeats']} | {r['load1']:.1f} | {_others(r)} |"
        )
    return "\n".join(lines)


def min_table(results: list[dict]) -> str:
    """The same ratios from each column's fastest repeat (the least disturbed run on a shared machine)."""
    lines = [
        "| shape | tokens | rank | dense ms (min) | tltorch | planner | module | LR | planner/best |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["min_s"]
        d = m["dense"]
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['rank']} | {d * 1e3:.1f} | {_ratio(d, m.get('tltorch'))} | "
            f"{_ratio(d, r['planner_min_s'])} | {_ratio(d, m['module'])} | {_ratio(d, m['LR'])} | "
            f"{r['planner_min_s'] / r['best_min_s']:.3f} |"
        )
    return "\n".join(lines)


def target_report(results: list[dict]) -> str:
    out = []
    within = [r for r in results if r["ratio"] <= 1.10]
    raw_within = [r for r in results if r["ratio_raw"] <= 1.10]
    frac = len(within) / len(results) if results else 0.0
    worst = max(results, key=lambda r: r["ratio"])
    out.append(
        f"planner within 10% of measured best: {len(within)}/{len(results)} points = {frac:.0%} "
        f"(target >= 90%: {'MET' if frac >= 0.9 else 'MISSED'}; before the head-to-head re-timing "
        f"{len(raw_within)}/{len(results)}); worst {worst['ratio']:.3f} at {worst['shape']} "
        f"tokens={worst['tokens']} r={worst['rank']}"
    )
    for r in results:
        if r["ratio"] > 1.10 or r["ratio_raw"] > 1.10:
            c = r["confirm"] or {}
            out.append(
                f"  {'miss' if r['ratio'] > 1.10 else 'raw miss only'}: {r['shape']} tokens={r['tokens']} "
                f"r={r['rank']}: planner {r['planner_plan']} {r['planner_s'] * 1e3:.3f} ms vs best "
                f"{r['best_plan']} {r['best_s'] * 1e3:.3f} ms; head to head "
                f"{c.get('planner_s', 0) * 1e3:.3f} vs {c.get('best_s', 0) * 1e3:.3f} ms (n={c.get('n')})"
            )
    for (shape, rank), need in SPEEDUP_TARGETS.items():
        row = next((r for r in results if r["shape"] == shape and r["rank"] == rank and r["tokens"] == 4096), None)
        if row is None:
            out.append(f"speed-up {shape} r={rank} @4096 tokens: not in this run")
            continue
        got = row["dense_s"] / row["planner_s"]
        mod = row["dense_s"] / row["module_s"]
        lr = row["dense_s"] / row["LR_s"]
        public, plain = REFERENCE_NOTES[(shape, rank)]
        out.append(
            f"speed-up {shape} r={rank} @4096 tokens: planner {got:.2f}x, module {mod:.2f}x, LR leaves "
            f"{lr:.2f}x (target >= {need}x: {'MET' if got >= need else f'MISSED by {need / got:.2f}x'}; "
            f"team notes: CoMERA {public}x, LR {plain}x)"
        )
    tl = [r for r in results if r["tltorch_s"]]
    if tl:
        ratios = sorted((r["tltorch_s"] / r["planner_s"], r) for r in tl)
        met = sum(1 for q, _ in ratios if q >= 10)
        lo, lo_r = ratios[0]
        out.append(
            f"vs tensorly-torch (equal params): planner faster by {lo:.1f}x .. {ratios[-1][0]:.1f}x, median "
            f"{statistics.median(q for q, _ in ratios):.1f}x; >= 10x at {met}/{len(ratios)} points "
            f"(target: {'MET' if met == len(ratios) else 'MISSED'}); lowest at {lo_r['shape']} "
            f"tokens={lo_r['tokens']} r={lo_r['rank']}"
        )
    else:
        out.append("vs tensorly-torch: not measured (package not installed)")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------- profile


def profile_split(shape: str, rank: int, tokens: int, repeats: int, log) -> dict:
    """Time the planner's plan, and separately its b-independent part (the core-only subtrees hanging off the
    path of x, fwd + bwd with fixed random gradients of their outputs) and its b-dependent part (the steps holding
    x, with those subtrees' results as leaves), all pairwise in the plan's own order, interleaved. total - (merge
    + gemms) is what neither part alone shows (autograd bookkeeping across the join)."""
    case = build_rank_case(shape, rank, 0)
    net, layout = case.net, case.layout
    chosen = choose_plan(case.envelope, tokens)
    n_in, n_out, _, _ = SHAPES[shape]
    x = torch.randn(tokens, n_in).requires_grad_()
    dy = torch.randn(tokens, n_out)
    cores = case.cores
    sym = {i: oe.get_symbol(i) for i in range(len(net.sizes))}

    path = []  # core-only subtrees met walking from the root down the path of x
    node = chosen.tree
    while not isinstance(node, int):
        left, right = node
        inner, other = (left, right) if _holds_x(left) else (right, left)
        path.append(other)
        node = inner

    def evaluate(tree, leaf):
        """Pairwise evaluation in the tree's order -> (tensor, its indices)."""
        if isinstance(tree, int):
            return leaf(tree)
        (a, ia), (b, ib) = evaluate(tree[0], leaf), evaluate(tree[1], leaf)
        shared = set(ia) & set(ib)
        out = tuple(i for i in ia if i not in shared) + tuple(i for i in ib if i not in shared)
        eq = "".join(sym[i] for i in ia) + "," + "".join(sym[i] for i in ib) + "->" + "".join(sym[i] for i in out)
        return oe.contract(eq, a, b), out

    def core_leaf(t):  # the stored core without its size-1 end bonds, as the network lists it
        idx = net.tensor_indices[t]
        return cores[t - 1].reshape(tuple(net.sizes[i] for i in idx)), idx

    merged0 = [evaluate(sub, core_leaf) for sub in path]
    grads0 = [torch.randn_like(m) for m, _ in merged0]
    merged_leaves = [(m.detach().clone().requires_grad_(), idx) for m, idx in merged0]
    x_idx = net.tensor_indices[0]

    def run_merge():
        _fresh_grads(cores)
        outs = [evaluate(sub, core_leaf)[0] for sub in path]
        torch.autograd.backward(outs, grads0)

    def run_gemms():
        _fresh_grads([x] + [m for m, _ in merged_leaves])
        acc, idx = x.reshape((tokens,) + net.in_modes), x_idx
        for m, m_idx in reversed(merged_leaves):
            shared = set(idx) & set(m_idx)
            out = tuple(i for i in idx if i not in shared) + tuple(i for i in m_idx if i not in shared)
            eq = (
                "".join(sym[i] for i in idx)
                + ","
                + "".join(sym[i] for i in m_idx)
                + "->"
                + "".join(sym[i] for i in out)
            )
            acc, idx = oe.contract(eq, acc, m), out
        perm = [idx.index(i) for i in net.output]
        acc.permute(perm).reshape(tokens, n_out).backward(dy)

    cols = [
        Column("total", plan_runner(chosen, x, cores, layout, dy)),
        Column("merge", run_merge),
        Column("gemms", run_gemms),
    ]
    for col in cols:
        col.run()
    for _ in range(repeats):
        for col in cols:
            start = time.perf_counter()
            col.run()
            col.times.append(time.perf_counter() - start)
    res = {c.key: c.median for c in cols}
    merge_flops = sum(float(s.flops[0]) for s in chosen.steps if not s.batched) * 3
    log(
        f"profile {shape} r={rank} tokens={tokens} plan {chosen}: total {res['total'] * 1e3:.2f} ms; core merge "
        f"(b-independent, {merge_flops / 1e6:.1f} MFLOP fwd+bwd) {res['merge'] * 1e3:.2f} ms; b-dependent GEMMs "
        f"{res['gemms'] * 1e3:.2f} ms ({float(chosen.flops(tokens)) / 1e9 - merge_flops / 1e9:.3f} GFLOP, "
        f"{(float(chosen.flops(tokens)) - merge_flops) / res['gemms'] / 1e9:.1f} GFLOP/s); rest "
        f"{(res['total'] - res['merge'] - res['gemms']) * 1e3:.2f} ms"
    )
    return {"shape": shape, "rank": rank, "tokens": tokens, "plan": str(chosen), **res}


def _holds_x(node) -> bool:
    return 0 in _leaf_list(node)


def _leaf_list(node) -> list[int]:
    return [node] if isinstance(node, int) else _leaf_list(node[0]) + _leaf_list(node[1])


# ------------------------------------------------------------------------------------------------------ main


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="default subset: all shapes, tokens 64/512/4096, ranks 16/32 (+30 on 768 shapes)",
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--tokens", default=None, help=f"comma list (default {FULL_TOKENS})")
    parser.add_argument("--ranks", default=None, help=f"comma list (default {FULL_RANKS}); clamped to feasible")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per column (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds over all columns first")
    parser.add_argument(
        "--group-seconds",
        type=float,
        default=4.0,
        help="time cheap (shape, tokens) groups for about this long: up to 10x --repeats",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--random-cap",
        type=float,
        default=8.0,
        help="skip random trees predicted to cost more than this × the planner's choice",
    )
    parser.add_argument(
        "--confirm",
        type=int,
        default=3,
        help="where the planner's choice is not the fastest plan, re-time it head to head against "
        "the fastest with this many times the group's repeats (0: off)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="measure a (shape, tokens) group again (up to this many times) when other processes "
        "used more than --busy-cores during it",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each group wait up to this many seconds for other processes to go quiet",
    )
    parser.add_argument(
        "--busy-cores",
        type=float,
        default=0.3,
        help="other processes' CPU use (in cores) above which a group counts as disturbed",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split the planner's plan into core merge vs b-dependent GEMMs at 4096 tokens",
    )
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"unknown shape {s!r}; known: {list(SHAPES)}")
    tokens = _ints(args.tokens) if args.tokens else (QUICK_TOKENS if args.quick else FULL_TOKENS)

    def ranks_for(shape: str) -> tuple[int, ...]:
        if args.ranks:
            return _ints(args.ranks)
        return QUICK_RANKS[shape] if args.quick else FULL_RANKS

    def log(line: str) -> None:
        print(line, flush=True)

    started = time.time()
    load = os.getloadavg()
    log(f"# bench_tt_linear {datetime.datetime.now().isoformat(timespec='seconds')}  {' '.join(sys.argv[1:])}")
    log(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {platform.processor() or 'cpu'}; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    if tltorch is None:
        log("# NOTE: tensorly-torch not installed: the tltorch column is skipped (pip install tensorly tensorly-torch)")
    else:
        log(
            f"# tensorly-torch {getattr(tltorch, '__version__', '?')}: FactorizedLinear(factorization='blocktt', "
            f"implementation='factorized'), uniform rank closest to the TT layer's parameter count"
        )
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet, args.busy_cores, log)
    update_rates(3, log)
    log(
        "# columns: dense / column time (higher = faster); pl/best = planner / best measured plan; pred = planner "
        "cost / GEMM rate; /floor = planner time / floor"
    )
    log(HEADER)

    results, profiles = [], []
    for shape in shapes:
        cases = []
        for rank in ranks_for(shape):
            n_in, n_out, rows, cols = SHAPES[shape]
            ranks = capped_ranks(rows + cols, rank)
            if any(c.layout.ranks == ranks for c in cases):
                log(f"# {shape} r={rank}: ranks {ranks} clamp to an earlier rank's, skipped")
                continue
            case = build_rank_case(shape, rank, args.seed)
            cases.append(case)
            tl = (
                f"tltorch BlockTT rank {case.tl_rank}, {case.tl_params} params"
                if case.tl_layer is not None
                else "no tltorch column"
            )
            log(
                f"# {shape} r={rank}: ranks {case.layout.ranks}, {case.layout.num_params} TT params "
                f"({case.layout.compression:.0f}x compression); {tl}; envelope {len(case.envelope.plans)} plans, "
                f"breakpoints {', '.join(f'{float(b):.1f}' for b in case.envelope.breakpoints)}; "
                f"{len(case.random_trees)} random trees"
            )
        for t in tokens:
            for attempt in range(args.retries + 1):
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet, args.busy_cores, log)
                    update_rates(1, log)
                probe = OtherLoad()
                group = measure_group(
                    shape,
                    t,
                    cases,
                    args.repeats,
                    args.warmup,
                    args.random_cap,
                    args.seed,
                    log,
                    args.group_seconds,
                    args.confirm,
                )
                others = probe.cores()
                for r in group:
                    r["others_cores"], r["attempt"] = others, attempt
                disturbed = others is not None and others > args.busy_cores
                log(
                    f"#   {shape} tokens={t}: other processes used "
                    f"{'?' if others is None else f'{others:.2f}'} cores during this group"
                )
                if disturbed and attempt < args.retries:
                    log(
                        f"#   {shape} tokens={t}: other processes used {others:.2f} cores during the group "
                        f"(> {args.busy_cores}); measuring it again"
                    )
                    continue
                if disturbed:
                    log(f"#   {shape} tokens={t}: DISTURBED, other processes used {others:.2f} cores; kept")
                break
            results += group
    if args.profile:
        log("\n# profile: median of interleaved repeats")
        for shape, rank in SPEEDUP_TARGETS:
            if shape in shapes:
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet, args.busy_cores, log)
                probe = OtherLoad()
                profiles.append(profile_split(shape, rank, 4096, args.repeats, log))
                others = probe.cores()
                profiles[-1]["others_cores"] = others
                log(f"#   other processes used {'?' if others is None else f'{others:.2f}'} cores meanwhile")
    update_rates(3, log)
    finalize(results)
    log(
        f"# predicted times and floors below use the best rates seen: {RATES['gemm'] / 1e9:.1f} GFLOP/s, "
        f"{RATES['bw'] / 1e9:.2f} GB/s"
    )
    load_end = os.getloadavg()
    log(
        f"\n# done in {time.time() - started:.0f} s; load average at end {load_end[0]:.2f} {load_end[1]:.2f} "
        f"{load_end[2]:.2f}"
    )
    log("\n" + markdown_table(results))
    log("\n# the same from each column's fastest repeat (min instead of median)\n" + min_table(results))
    log("\n" + target_report(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "argv": sys.argv[1:],
                    "load_start": load,
                    "load_end": load_end,
                    "gemm_flops": RATES["gemm"],
                    "bandwidth": RATES["bw"],
                    "results": results,
                    "profiles": profiles,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
