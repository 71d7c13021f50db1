"""Train a small byte-level code LM on the Python standard library: dense vs comera_fx (TT + rank adaptation).

Runs offline on CPU in about 5 minutes (2 cores) with no arguments:

    python examples/train_code_lm.py                      # preset "small": both runs train for the same wall clock
    python examples/train_code_lm.py --preset tiny        # a few seconds (the smoke test)
    python examples/train_code_lm.py --preset comera      # CoMERA's widths: step time and parameters only

Data: the ``.py`` files of the running Python's own standard library (found with ``sysconfig``; site-packages and
test folders skipped, about 8 MB read), split into train/val **by file** with a hash of the relative path, as bytes
(vocabulary 256). Nothing is downloaded.

Model: a GPT-style decoder in plain torch (token + learned position embeddings, pre-LN blocks with causal
``scaled_dot_product_attention`` and a GELU MLP built from ``nn.Linear``, head tied to the token embedding).

The dense run trains the model with AdamW. The comera_fx run starts from a copy of the same initial model, converts
every block ``nn.Linear`` to tensor-train form with ``comera_fx.tensorize_`` (max rank 16) and trains it with
``comera_fx.runtime.RankAdaptive`` (its default budget schedule: the TT size falls on a cubic schedule to half
its start by ``--prune-by`` of the budget, the least important rank directions removed physically;
``--schedule comera``: CoMERA's ℓ1 pull and late stage instead). Each run gets the same training wall-clock budget;
validation (nats/byte on a fixed set of held-out batches) runs every ``--eval-every`` seconds of
training time, outside the budget clock.

Compiled or eager (``--compile auto``, the default; ``comera_fx.compile_policy``): each run takes a few eager
steps, then, if the budget left could repay a compile, compiles its blocks in place (``comera_fx.compile_regions`` for
the TT run, whose ``RankAdaptive`` hook, with ``BudgetConfig``'s defaults, finds its blocks compiled and keeps one
shape through the prunes: one recompile at most; stock ``torch.compile`` per block for the dense run), then alternates
compiled and eager steps in neighbouring pairs until a sign test says whether the compiled step repays the recompiles
to come, and keeps the compiled path only then. The compile is inside the run's training clock; the report says which
path each run took and why. A TT run shrinks its cores to their live ranks after training. On this model the compiled
TT step reads 1.06-1.14x the eager one on a 2-core CPU (GEMMs and attention, the same kernels on both paths, are ~70 %
of the step; benchmarks/history/2026-12-07-session12.md), so the choice can go either way. Run as a script it chooses
OpenMP's wait policy from the machine's load unless the environment sets one (``openmp_policy.py``: libgomp's
spin-then-sleep when idle, ``OMP_WAIT_POLICY=PASSIVE`` when busy; the report says which); ``--threads 1`` can still be
faster on a machine that other jobs keep busy.

Output (``runs/<timestamp>/`` or ``--out DIR``): ``report.md`` (configuration, per-run table, per-layer TT report),
``val_loss.png``, ``compression.png``, ``ranks.png``, ``rank_history.json``, ``metrics.json``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, also when imported from a file path
import openmp_policy  # noqa: E402  (torch-free: outside the package, whose import loads torch)

if __name__ == "__main__":
    # Before torch loads OpenMP. On a shared 2-core machine OpenMP's spin-waiting threads wait for a descheduled
    # partner at every parallel region: measured there, a TT training step took 3-7 s instead of 0.65 s and
    # tensorize_ 40-80 s instead of 6-8 s; on an idle machine passive waiting made the TT step 1.5x slower. So the
    # policy follows the load (an explicit OMP_WAIT_POLICY / GOMP_SPINCOUNT in the environment wins).
    openmp_policy.choose_wait_policy()

import torch  # noqa: E402
import torch.nn.functional as F
from torch import nn

import comera_fx  # noqa: E402
from comera_fx import compile_policy  # noqa: E402
from comera_fx.runtime import BudgetConfig, CoMERAConfig, RankAdaptive, param_groups  # noqa: E402

VOCAB = 256  # bytes

# ------------------------------------------------------------------------------------------------------ presets


@dataclass(frozen=True)
class Preset:
    layers: int
    d_model: int
    heads: int
    d_ff: int
    seq_len: int
    batch: int
    min_numel: int  # TensorizeConfig.min_numel: every block linear of the preset is above it
    data_bytes: int  # cap on the stdlib bytes read
    val_batches: int  # fixed validation set: this many batches of (batch × seq_len) bytes
    budget_seconds: float  # training wall clock per run
    eval_every: float  # seconds of training time between validations
    warmup_steps: int
    threads: int | None = None  # default torch threads (None: torch's own default)
    measure_only: bool = False  # "comera": time a few steps and count parameters, no training to budget


PRESETS = {
    "tiny": Preset(
        layers=2,
        d_model=64,
        heads=2,
        d_ff=256,
        seq_len=32,
        batch=8,
        min_numel=4096,
        data_bytes=1_000_000,
        val_batches=2,
        budget_seconds=3.0,
        eval_every=1.0,
        warmup_steps=5,
        # 64-wide layers: with 2 OpenMP threads on a busy 2-core machine thread hand-offs dominate
        # (measured 50x slower steps), so the smoke preset runs on one thread unless --threads says more.
        threads=1,
    ),
    # The shapes of the reference measurements (dense ≈ 2 steps/s on 2 CPU cores when the machine is idle).
    "small": Preset(
        layers=4,
        d_model=384,
        heads=6,
        d_ff=1536,
        seq_len=128,
        batch=16,
        min_numel=65536,
        data_bytes=8_000_000,
        val_batches=4,
        budget_seconds=120.0,
        eval_every=15.0,
        warmup_steps=20,
    ),
    # CoMERA's BERT-base-like widths: too slow to train on a CPU, so only step time and parameter counts.
    "comera": Preset(
        layers=6,
        d_model=768,
        heads=12,
        d_ff=3072,
        seq_len=128,
        batch=16,
        min_numel=65536,
        data_bytes=2_000_000,
        val_batches=1,
        budget_seconds=0.0,
        eval_every=0.0,
        warmup_steps=0,
        measure_only=True,
    ),
}

# ---------------------------------------------------------------------------------------------------------- data

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _hash(text: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha1((salt + text).encode()).digest()[:8], "big")


def load_stdlib(max_bytes: int, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, val bytes, info) from the standard library's .py files.

    Files are visited in a hash order (so the byte cap samples the whole library, not its first folders) and
    assigned to val when a second, independent hash of the relative path falls below ``val_fraction``: the split
    is by file and the same on every machine with the same Python.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py"):
                paths.append(Path(dirpath, name).relative_to(root).as_posix())
    paths.sort(key=lambda rel: _hash(rel, "order:"))
    train, val, total, n_files = [], [], 0, [0, 0]
    for rel in paths:
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        if total + len(data) > max_bytes:
            continue  # skip big files near the cap, keep filling with smaller ones
        total += len(data)
        is_val = _hash(rel, "split:") % 10_000 < val_fraction * 10_000
        (val if is_val else train).append(data + b"\n")
        n_files[is_val] += 1
    if not train or not val:
        raise RuntimeError(
            f"too little standard-library source under {root} (train {len(train)} files, val {len(val)} files)"
        )

    def as_tensor(chunks):
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    info = {
        "root": str(root),
        "train_files": n_files[0],
        "val_files": n_files[1],
        "train_bytes": sum(map(len, train)),
        "val_bytes": sum(map(len, val)),
    }
    return as_tensor(train), as_tensor(val), info


def get_batch(
    data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(len(data) - seq_len - 1, (batch,), generator=generator)
    chunk = data[start[:, None] + torch.arange(seq_len + 1)].long()
    return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


# --------------------------------------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level decoder. The head is tied to the token embedding (256 × d, small next to the blocks)."""

    def __init__(self, p: Preset):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, p.d_model)
        self.pos_emb = nn.Embedding(p.seq_len, p.d_model)
        self.blocks = nn.ModuleList(Block(p.d_model, p.heads, p.d_ff) for _ in range(p.layers))
        self.ln_f = nn.LayerNorm(p.d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        # Block linears keep nn.Linear's default init (variance 1/(3·fan_in)), which is also the variance that
        # comera_fx's init="random" gives reconstructed TT weights (--init random).

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, val_set: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy in nats per byte over the fixed validation batches. Eager even when the blocks are
    compiled: an eval-mode, no-grad graph would be one more compile, outside the training clock."""
    was_training = model.training
    model.eval()
    with torch.compiler.set_stance("force_eager"):
        loss = sum(float(lm_loss(model, x, y)) for x, y in val_set) / len(val_set)
    model.train(was_training)
    return loss


def linear_params(model: nn.Module) -> int:
    """Parameters held by the blocks' linear layers: weight + bias (dense) or cores + gates + bias (TT)."""
    return sum(
        p.numel()
        for block in model.blocks
        for name, m in block.named_children()
        if name in ("qkv", "proj", "fc", "out")
        for p in m.parameters()
    )


def total_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ comera_fx setup


def tensorize(model: nn.Module, p: Preset, args, example: torch.Tensor):
    """Convert every block nn.Linear to TT in place; the embedding (256 rows, tied to the head) stays dense.

    init: "svd" (default) — TT-SVD of this very model's initial weights, so the comera_fx run starts from the
    closest rank-16 TT of the dense run's starting point. TT-SVD of a random init is a fine start but not the same
    function: a random matrix has a flat spectrum, so rank 16 keeps only 13-23% of each weight's norm (relative
    error ≈ 0.99); the pre-LN residual blocks simply start with smaller weights. "random" instead draws cores whose
    reconstructed entries have nn.Linear's default variance. In a trial on the small preset (150 steps, same
    batches) svd reached 2.418 and random 2.454 nats/byte, so svd is the default; the difference is small.
    """
    config = comera_fx.TensorizeConfig(max_rank=args.max_rank, min_numel=p.min_numel, init=args.init, seed=args.seed)
    return comera_fx.tensorize_(
        model, config, example_inputs=(example,), filter_fn=lambda module, fqn: isinstance(module, nn.Linear)
    )


def make_dense_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)


def make_tt_optimizer(model: nn.Module, args, lr_gates: float) -> torch.optim.Optimizer:
    # CoMERA's public code uses cores 1e-4, gates 1e-3, others 5e-5 (long runs, large batches); those barely move a
    # model in a few hundred steps. Trials on the small preset (100-150 steps, same batches, val nats/byte):
    #   dense AdamW: lr 1e-3 -> 2.424, 2e-3 -> 2.451, 3e-3 -> 2.549 (100 steps)          => --lr 1e-3
    #   TT cores (svd init): 1e-3 / 2e-3 / 3e-3 within 0.01 of each other, 1e-2 clearly worse (2.67 vs 2.45)
    #   => cores 3e-3 (best at 100 steps with other 1e-3); other parameters (embeddings, LayerNorms, biases) get
    #   the dense run's rate, since they are the same parameters. The gates' rate sets how fast ranks can fall:
    #   see gate_lr().
    groups = param_groups(model, lr_cores=args.lr_cores, lr_gates=lr_gates, lr_other=args.lr)
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)


def gate_lr(args, expected_steps: float) -> float:
    """The gates' learning rate (``--lr-gates``, or "auto").

    With Adam an unimportant gate moves by about one learning rate per step whatever its gradient, so a gate that
    starts at 1 needs about 1/lr steps of the late stage to cross the pruning threshold — and many cross together
    (docs/rank_adaptive.md, Limitations). A fixed rate therefore prunes nothing in a short run (1e-3, CoMERA's,
    needs ~1000 late steps; trial: 3e-3 from step 60 pruned nothing in 300 steps) or collapses whole layers early
    in a long one (trial: 1e-2 from step 90 went to 14% of the TT size, target 50%, and lost 0.07 nats/byte).
    "auto" picks lr = 1 / ((``--prune-by`` − ``--late-fraction``) · expected steps), so the size reaches its target
    about ``--prune-by`` of the way through the budget and the model has the rest of it to recover.
    """
    if args.lr_gates != "auto":
        return float(args.lr_gates)
    if args.schedule == "budget":
        return 1e-3  # the budget schedule does not move gates: they are plain parameters (tt_fixed's rate)
    late_steps = max((args.prune_by - args.late_fraction) * expected_steps, 1.0)
    return min(max(1.0 / late_steps, 1e-3), 5e-2)


def make_hook(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    args,
    late_start_step: int | None,
    result: "RunResult",
    expected_steps: float,
) -> RankAdaptive:
    """``--schedule budget`` (default): RankAdaptive's budget schedule towards ``--keep-fraction`` of the TT size,
    reached at ``--prune-by`` of the horizon (final_fraction = 1 − prune_by). The horizon is the run's training
    clock (``result.train_seconds``, validation excluded), or ``--max-steps`` when that ends the run first.

    ``--schedule comera``: CoMERA's two stages: a light ℓ1 pull on the gates, then (from ``late_start_step``) the
    achievement scalarization towards ``--keep-fraction`` of the initial TT size; dead slices removed
    every ``prune_every``.

    The price in a run this short is real. Trial (small preset, 174 steps, same batches, 1 thread): rank-16 TT
    without a late stage reached 2.376 nats/byte; with the late stage from step 44 (gate lr 0.011), 2.567 at 52%
    of the TT size. While λ = 1 every gate is pulled down by about one learning rate per step, which shrinks every
    TT weight, and the training loss lags the fixed-rank run by ~0.2 well before anything is pruned.
    ``--late-fraction 2`` (the late stage never starts) trains at fixed rank.

    late_size_weight=0 (``--late-size-weight``; the library's default too, CoMERA uses 0.01): once the size target
    is met the
    0.01·R term still moves every unimportant gate by ~lr per step under Adam, so the size keeps falling. Trial
    (205 steps, late stage from step 45): 0.01 ended at 32k stored TT params (28.6k live, one bond already empty;
    in the full demo three layers were removed entirely), 0 stopped at 42k and stayed there (target 57k); val
    2.530 vs 2.523 nats/byte.
    """
    if args.schedule == "budget":
        if args.max_steps is not None and args.max_steps <= expected_steps:
            horizon = {"total_steps": args.max_steps}
        else:
            horizon = {"budget_seconds": args.budget_seconds}
        clock = None if "total_steps" in horizon else (lambda: result.train_seconds)
        config = BudgetConfig(keep_fraction=args.keep_fraction, final_fraction=1 - args.prune_by, **horizon)
        return RankAdaptive(model, optimizer, config, clock=clock, history_every=1)
    config = CoMERAConfig(
        l1_weight=args.l1_weight,
        prune_every=args.prune_every,
        keep_fraction=args.keep_fraction,
        late_start_step=late_start_step,
        late_size_weight=args.late_size_weight,
    )
    return RankAdaptive(model, optimizer, config, history_every=1)


def expected_recompiles(hook: RankAdaptive | None, args) -> int:
    """Physical shrinks to come in a run (each recompiles the compiled blocks), counted at the most: under
    the budget schedule of a compiled model one at the last prune point, none where that compaction would leave the
    GEMMs' widths as they are (``RankAdaptive.compaction_keeps_gemm_widths``: the CPU at max rank <= 16, the demo's
    default) or would free too little to pay; none without rank adaptation."""
    if hook is None:
        return 0
    if args.schedule != "budget":
        return compile_policy.UNBOUNDED  # comera: a shrink at every prune point
    return 0 if hook.compaction_keeps_gemm_widths() else 1


def prepare_tt_run(
    model: nn.Module, p: Preset, args, train_data: torch.Tensor, device: torch.device, result: "RunResult"
) -> tuple[torch.optim.Optimizer, RankAdaptive, object, float]:
    """Everything the comera_fx run does before its first step (outside the budget clock): tensorize_ ``model`` in
    place, time a few steps to place the late stage in steps, pick the gate rate, build optimizer and hook.
    Fills ``result.setup_seconds`` / ``late_start_step`` / ``target_params``; returns (optimizer, hook,
    tensorize_ summary, estimated seconds per step). Also used by benchmarks/bench_equal_time.py."""
    start = time.perf_counter()
    example = get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), device)[0]
    summary = tensorize(model, p, args, example)
    result.setup_seconds = time.perf_counter() - start
    step_seconds = calibrate_step_seconds(model, args, train_data, p, device)
    expected_steps = args.budget_seconds / max(step_seconds, 1e-6)
    if args.max_steps is not None:
        expected_steps = min(expected_steps, args.max_steps)
    if args.schedule == "comera":
        result.late_start_step = max(1, int(args.late_fraction * expected_steps))
    args.gate_lr_used = gate_lr(args, expected_steps)
    optimizer = make_tt_optimizer(model, args, args.gate_lr_used)
    hook = make_hook(model, optimizer, args, result.late_start_step, result, expected_steps)
    result.target_params = hook.target_size
    return optimizer, hook, summary, step_seconds


# ------------------------------------------------------------------------------------------------------ training


@dataclass
class RunResult:
    name: str
    steps: int = 0
    train_seconds: float = 0.0
    tokens: int = 0
    evals: list = field(default_factory=list)  # (train seconds, step, val loss)
    train_losses: list = field(default_factory=list)  # per step
    linear_params_start: int = 0
    linear_params_end: int = 0
    total_params_start: int = 0
    total_params_end: int = 0
    setup_seconds: float = 0.0
    eval_seconds: float = 0.0
    late_start_step: int | None = None
    target_params: float | None = None  # RankAdaptive's size target S_t (TT cores + gates)
    history: list = field(default_factory=list)  # RankAdaptive history (dicts)
    final_ranks: dict = field(default_factory=dict)
    compile: dict = field(default_factory=dict)  # compile_policy.CompileProbe.summary(): the path and why
    shrunk_after_training: tuple | None = None  # stored TT params (before, after) the shrink to live ranks

    @property
    def steps_per_s(self) -> float:
        return self.steps / max(self.train_seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_seconds, 1e-9)

    @property
    def final_val(self) -> float:
        return self.evals[-1][2]


def _progress(name: str, budget: float, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=round(budget, 1),
        desc=f"{name:>9}",
        unit="s",
        disable=disable,
        dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s train [{elapsed}{postfix}]",
    )


def train(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hook: RankAdaptive | None,
    train_data: torch.Tensor,
    val_set,
    p: Preset,
    args,
    device: torch.device,
    result: RunResult,
) -> RunResult:
    """Train until ``budget`` seconds of step time (or ``--max-steps``); validate every ``eval_every`` seconds of
    training time with the clock stopped. Both runs draw the same sequence of batches."""
    for _ in training_steps(name, model, optimizer, hook, train_data, val_set, p, args, device, result):
        pass
    return result


def training_steps(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hook: RankAdaptive | None,
    train_data: torch.Tensor,
    val_set,
    p: Preset,
    args,
    device: torch.device,
    result: RunResult,
):
    """``train`` one step at a time: yields ``result`` after every step (its validation included), and fills in
    the run's closing figures when exhausted. Lets a benchmark interleave two runs in one process, so that a shared
    machine's drift in speed falls on both alike (benchmarks/bench_compile_ab.py)."""
    budget = args.budget_seconds
    eval_every = min(args.eval_every, budget / 4) if budget > 0 else args.eval_every
    generator = torch.Generator().manual_seed(args.seed + 1)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    result.total_params_start, result.linear_params_start = total_params(model), linear_params(model)
    tokens_per_step = p.batch * p.seq_len

    t_eval = time.perf_counter()
    result.evals.append((0.0, 0, evaluate(model, val_set)))
    result.eval_seconds += time.perf_counter() - t_eval
    next_eval = eval_every
    smooth = None
    # a run that settles on eager stores every matrix at its own live ranks from then on
    settles_eager = hook.shrink_eagerly if hook is not None else None
    probe = compile_policy.CompileProbe(
        mode=args.compile, budget_s=budget, on_eager=settles_eager, expected_recompiles=expected_recompiles(hook, args)
    )
    bar = _progress(name, budget, args.quiet)
    model.train()
    while result.train_seconds < budget and (args.max_steps is None or result.steps < args.max_steps):
        start = time.perf_counter()
        probe.before_step(model)  # may compile the blocks: the compile is inside this step's time
        warm = min(1.0, (result.steps + 1) / max(p.warmup_steps, 1))
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * warm
        x, y = get_batch(train_data, p.batch, p.seq_len, generator, device)
        loss = lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # read afresh: pruning makes new parameters
        if hook is not None:
            hook.observe(loss)  # reads the loss to the host (one sync), used by the late stage and the history
        optimizer.step()
        loss_value = float(loss.detach())  # synchronises, so the step time below is real on accelerators too
        elapsed = time.perf_counter() - start
        probe.after_step(elapsed, model)  # may decide the compile does not pay and go back to eager
        result.train_seconds += elapsed
        result.steps += 1
        result.tokens += tokens_per_step
        result.train_losses.append(loss_value)
        smooth = loss_value if smooth is None else 0.9 * smooth + 0.1 * loss_value

        last = result.train_seconds >= budget or (args.max_steps is not None and result.steps >= args.max_steps)
        if result.train_seconds >= next_eval or last:
            t_eval = time.perf_counter()
            result.evals.append((result.train_seconds, result.steps, evaluate(model, val_set)))
            result.eval_seconds += time.perf_counter() - t_eval
            while next_eval <= result.train_seconds:
                next_eval += eval_every
        postfix = {"loss": f"{smooth:.3f}", "val": f"{result.evals[-1][2]:.3f}"}
        if hook is not None and hook.history:
            entry = hook.history[-1]
            postfix["ranks"] = sum(sum(r[1:-1]) for r in entry.gate_ranks.values())
            postfix["TT params"] = f"{entry.tt_params:,}"
            postfix["stage"] = entry.stage
        postfix["tok/s"] = f"{result.tokens_per_s:,.0f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(min(elapsed, max(bar.total - bar.n, 0)))
        yield result
    bar.close()
    result.compile = probe.summary()
    print(f"{name}: {compile_line(result.compile)}", flush=True)
    if hook is not None:
        # compiled, the hook held the stored cores wider than the live ranks to save recompiles (one width per
        # matrix role, zero slices past the live ranks); training is over, so each matrix keeps its own live ranks
        stored = hook.stored_tt_params()
        hook.shrink_eagerly()
        result.shrunk_after_training = (stored, hook.stored_tt_params())
    result.total_params_end, result.linear_params_end = total_params(model), linear_params(model)
    if hook is not None:
        result.history = hook.history_as_dicts()
        result.final_ranks = {row.fqn: list(row.live_ranks) for row in comera_fx.report(model).layers}


def calibrate_step_seconds(model: nn.Module, args, train_data, p: Preset, device, steps: int = 3) -> float:
    """Seconds per training step of a throwaway copy (outside the budget): RankAdaptive's schedule counts steps,
    the budget is wall clock, so the late stage's start step is estimated from this."""
    trial = copy.deepcopy(model)
    optimizer = make_tt_optimizer(trial, args, 1e-3)
    # the hook's per-step work (importance or penalty, history entry) is part of a step: count it (no pruning)
    if args.schedule == "budget":
        config = BudgetConfig(keep_fraction=args.keep_fraction, total_steps=10**9)
    else:
        config = CoMERAConfig(l1_weight=args.l1_weight, prune_every=None)
    hook = RankAdaptive(trial, optimizer, config, history_every=1)
    generator = torch.Generator().manual_seed(args.seed + 2)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        x, y = get_batch(train_data, p.batch, p.seq_len, generator, device)
        loss = lm_loss(trial, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trial.parameters(), 1.0)
        hook.observe(loss)
        optimizer.step()
        float(loss.detach())
        times.append(time.perf_counter() - start)
    hook.remove()
    return statistics.median(times[1:] if len(times) > 1 else times)


# ------------------------------------------------------------------------------------------------ reports, plots


def ranks_summary(ranks: dict) -> str:
    bonds = [r for layer in ranks.values() for r in layer[1:-1]]
    if not bonds:
        return "-"
    return f"{sum(bonds)} over {len(bonds)} bonds (mean {sum(bonds) / len(bonds):.1f}, min {min(bonds)})"


def results_table(results: list[RunResult]) -> str:
    header = (
        "run",
        "steps",
        "steps/s",
        "tokens/s",
        "final val loss (nats/byte)",
        "linear-layer params",
        "total params",
        "final ranks (live)",
    )
    rows = []
    for r in results:
        lin = (
            f"{r.linear_params_end:,}"
            if r.linear_params_end == r.linear_params_start
            else f"{r.linear_params_end:,} (start {r.linear_params_start:,})"
        )
        tot = (
            f"{r.total_params_end:,}"
            if r.total_params_end == r.total_params_start
            else f"{r.total_params_end:,} (start {r.total_params_start:,})"
        )
        rows.append(
            (
                r.name,
                str(r.steps),
                f"{r.steps_per_s:.2f}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.final_val:.4f}",
                lin,
                tot,
                ranks_summary(r.final_ranks) if r.final_ranks else "dense",
            )
        )
    return markdown_table(header, rows)


def markdown_table(header, rows) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def plot_val_loss(results: list[RunResult], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = [e[0] for e in r.evals]
        v = [e[2] for e in r.evals]
        ax.plot(t, v, marker="o", markersize=3, label=f"{r.name} ({r.steps} steps)")
    ax.set_xlabel("training wall clock (s, validation excluded)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Byte-level LM on the Python stdlib: same wall-clock budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compression(tt: RunResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in tt.history]
    fig, ax = plt.subplots(figsize=(7, 5.2))
    ax.plot(steps, [h["tt_params"] for h in tt.history], label="TT params at the live ranks (cores + gates)")
    without_dead = [h["tt_params_without_dead"] for h in tt.history]
    ax.plot(steps, without_dead, "--", label="TT params without dead slices (|gate| <= threshold)")
    if tt.late_start_step is not None:
        ax.axvline(tt.late_start_step, color="grey", lw=0.8, ls=":", label="late stage starts")
    if tt.target_params is not None:
        ax.axhline(tt.target_params, color="C2", lw=0.8, ls="-.", label="size target")
    ax.set_xlabel("step")
    ax.set_ylabel("parameters of the TT layers")
    ax.grid(alpha=0.3)
    ratio = ax.twinx()
    ratio.plot(
        steps,
        [h["compression"] or float("nan") for h in tt.history],
        color="C3",
        lw=1,
        label="compression of the linear weights (dense / TT)",
    )
    ratio.set_ylabel("compression (×)", color="C3")
    ax.set_ylim(bottom=0)
    ratio.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = ratio.get_legend_handles_labels()
    ax.legend(
        lines[0] + more[0],
        lines[1] + more[1],
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.13),
        ncol=2,
        frameon=False,
    )
    ax.set_title("comera_fx: size of the tensorized layers during training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ranks(tt: RunResult, path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    layers = list(tt.history[0]["gate_ranks"]) if tt.history else []
    rows, labels, bounds = [], [], []
    for layer in layers:
        n_bonds = len(tt.history[0]["gate_ranks"][layer]) - 2
        for k in range(n_bonds):
            rows.append([h["gate_ranks"][layer][k + 1] for h in tt.history])
            labels.append(layer if k == n_bonds // 2 else "")
        bounds.append(len(rows))
    image = np.array(rows, dtype=float) if rows else np.zeros((1, 1))
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.09 * len(rows) + 1.5)))
    steps = [h["step"] for h in tt.history] or [0]
    im = ax.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5),
    )
    for b in bounds[:-1]:
        ax.axhline(b - 0.5, color="white", lw=0.4)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("step")
    ax.set_title("live rank of every TT bond (rows: layer × internal bond)")
    fig.colorbar(im, ax=ax, label="live rank")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COMPILE_NOTE = (
    "`--compile auto` (the default) runs a few eager steps, then, if the budget left could repay a "
    "compile, compiles the blocks in place (`comera_fx.compile_regions` with comera_fx's backend for the "
    "TT run, stock `torch.compile` per block for the dense one), then alternates compiled and eager "
    "steps in neighbouring pairs (both train the model; 8-48 pairs, at most a tenth of the budget left) "
    "until a sign test over the pairs says whether the compiled step repays the recompiles to come, and "
    "keeps the compiled path only then; otherwise the blocks go back to eager. Steps gained are "
    "estimated at the probe's speed-up. The compile is inside the run's training clock. Embeddings, "
    "head, loss, clipping and the optimizer step stay eager, and validation runs eagerly "
    "(`torch.compiler.set_stance('force_eager')`). The TT run's rank schedule (`BudgetConfig`'s defaults) finds "
    "its blocks compiled, keeps one width per matrix role across blocks and rounds prunes in place, so the "
    "compiled blocks recompile at most once, not once per prune; after training its cores shrink to their "
    "live ranks."
)


def compile_line(summary: dict) -> str:
    """One report line from ``CompileProbe.summary()``: the path that ran, why, and the compile figures."""
    text = f"{summary['path']}: {summary['reason']}"
    if "graphs" in summary:
        text += (
            f". Graphs {summary['graphs']}, recompiles after the first compiled step {summary['recompiles']}, "
            f"{summary['compiled_steps']} compiled steps, {summary['steps_gained']:+.0f} steps gained by "
            f"them, compile and recompiles included"
            + (" (at the probe's speed-up)" if "probe_speedup" in summary else "")
        )
    return text + "."


def write_report(
    out: Path,
    args,
    p: Preset,
    data_info: dict,
    results: list[RunResult],
    table: str,
    tt_report: str,
    summary_text: str,
    extra: str = "",
) -> None:
    config_rows = [
        ("preset", args.preset),
        (
            "model",
            f"{p.layers} layers, d_model {p.d_model}, {p.heads} heads, "
            f"d_ff {p.d_ff}, seq {p.seq_len}, vocab {VOCAB} (bytes), tied head",
        ),
        ("batch", f"{p.batch} × {p.seq_len} = {p.batch * p.seq_len} tokens/step"),
        (
            "budget",
            f"{args.budget_seconds:g} s of training per run (validation every {args.eval_every:g} s of "
            f"training, clock stopped)",
        ),
        (
            "data",
            f"{data_info['train_files']} train / {data_info['val_files']} val files of {data_info['root']} "
            f"({data_info['train_bytes']:,} / {data_info['val_bytes']:,} bytes), split by file",
        ),
        ("validation set", f"{p.val_batches} fixed batches = {p.val_batches * p.batch * p.seq_len:,} bytes"),
        (
            "dense optimizer",
            f"AdamW lr {args.lr:g}, betas (0.9, 0.95), no weight decay, {p.warmup_steps} warm-up steps, grad clip 1.0",
        ),
        (
            "comera_fx tensorize_",
            f"TensorizeConfig(max_rank={args.max_rank}, min_numel={p.min_numel}, "
            f"init={args.init!r}), block nn.Linear layers only",
        ),
        (
            "comera_fx optimizer",
            f"AdamW (param_groups) cores {args.lr_cores:g} / gates {args.gate_lr_used:.2g} "
            f"({'auto' if args.lr_gates == 'auto' else 'fixed'}) / other {args.lr:g}, "
            f"same warm-up and clipping",
        ),
        (
            "RankAdaptive",
            f"budget schedule: keep_fraction={args.keep_fraction:g}, reached at {args.prune_by:.0%} of "
            f"the training clock (warm-up 10%, cubic decay, 10 prunes; compiled: rounded in place, at most one "
            f"recompile)"
            if args.schedule == "budget"
            else f"CoMERAConfig: l1_weight={args.l1_weight:g}, prune_every={args.prune_every}, "
            f"keep_fraction={args.keep_fraction:g}, late_size_weight={args.late_size_weight:g}, "
            f"late stage from ~{args.late_fraction:.0%} of the "
            f"budget (step estimated before training)",
        ),
        ("compile", f"--compile {args.compile} (section 'Compiled or eager')"),
        (
            "seed / device / threads",
            f"{args.seed} / {args.device} / {torch.get_num_threads()} ({openmp_policy.wait_policy_note()})",
        ),
        ("torch", torch.__version__),
    ]
    lines = [
        f"# comera_fx training demo ({datetime.now():%Y-%m-%d %H:%M:%S})",
        "",
        "`python " + " ".join(["examples/train_code_lm.py", *args.argv]).strip() + "`",
        "",
        "## Configuration",
        "",
        markdown_table(("", ""), config_rows),
        "",
        "## Results",
        "",
        table,
        "",
    ]
    if extra:
        lines += [extra, ""]
    lines += [
        "Steps/s and tokens/s count training steps only (validation excluded). Linear-layer params are the "
        "blocks' qkv/proj/fc/out layers (dense weight + bias, or TT cores + gates + bias); the embedding "
        "(tied to the head), position table and LayerNorms stay dense in both runs.",
        "",
        "## Compiled or eager",
        "",
        COMPILE_NOTE,
        "",
    ]
    lines += [f"* **{r.name}**: {compile_line(r.compile)}" for r in results if r.compile]
    lines += [""]
    if tt_report:
        lines += ["## TT layers at the end (`comera_fx.report`)", "", "```", tt_report, "```", ""]
    if summary_text:
        lines += ["## What tensorize_ did", "", "```", summary_text, "```", ""]
    if not p.measure_only:
        lines += [
            "## Plots",
            "",
            "![validation loss](val_loss.png)",
            "",
            "![compression](compression.png)",
            "",
            "![ranks](ranks.png)",
            "",
        ]
    (out / "report.md").write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="training wall clock per run (default: the preset's; small: 120)",
    )
    parser.add_argument(
        "--eval-every",
        type=float,
        default=None,
        help="seconds of training time between validations (default: the preset's; small: 15)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="also stop each run after this many steps")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: runs/<timestamp>)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's default; the tiny preset: 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rank", type=int, default=16)
    parser.add_argument("--init", choices=("random", "svd"), default="svd")
    parser.add_argument("--lr", type=float, default=1e-3, help="dense AdamW lr; also the TT run's non-TT params")
    parser.add_argument("--lr-cores", type=float, default=3e-3)
    parser.add_argument(
        "--lr-gates",
        default="auto",
        help="gate learning rate, or 'auto': reach the size target at --prune-by of the budget",
    )
    parser.add_argument(
        "--schedule",
        choices=("budget", "comera"),
        default="budget",
        help="RankAdaptive's schedule: budget (default; reaches --keep-fraction at --prune-by of the "
        "training clock) or comera (ℓ1 + late stage; --l1-weight, --prune-every, "
        "--late-size-weight, --late-fraction, --lr-gates auto apply to it)",
    )
    parser.add_argument("--l1-weight", type=float, default=0.01)
    parser.add_argument("--prune-every", type=int, default=25)
    parser.add_argument(
        "--late-size-weight",
        type=float,
        default=0.0,
        help="RankAdaptive late_size_weight (library default 0; CoMERA 0.01): the gate pull that "
        "stays on once the size target is met; see make_hook",
    )
    parser.add_argument(
        "--keep-fraction",
        "--target-ratio",
        dest="keep_fraction",
        type=float,
        default=0.5,
        help="size target, as a fraction of the initial TT parameters (BudgetConfig.keep_fraction; "
        "--target-ratio is its old spelling)",
    )
    parser.add_argument(
        "--late-fraction",
        type=float,
        default=0.25,
        help="comera schedule: the late stage starts after about this fraction of the budget",
    )
    parser.add_argument(
        "--prune-by",
        type=float,
        default=0.75,
        help="fraction of the budget by which the size target should be met (budget schedule; "
        "comera: through --lr-gates auto)",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "yes", "no"),
        default="auto",
        help="auto (default): after a few eager steps compile the blocks if the budget could repay "
        "it, keep the compiled path only if its measured step repays compile and recompiles "
        "(compile time counts in the budget); yes: always compile; no: eager",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    p = PRESETS[args.preset]
    if args.budget_seconds is None:
        args.budget_seconds = p.budget_seconds
    if args.eval_every is None:
        args.eval_every = p.eval_every
    if args.threads is None:
        args.threads = p.threads
    return args, p


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, train_data, p: Preset, device, steps: int = 3):
    """Median seconds of a training step (after one warm-up step)."""
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        x, y = get_batch(train_data, p.batch, p.seq_len, generator, device)
        loss = lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        float(loss.detach())
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_measure_only(args, p: Preset, data_info, train_data, dense: nn.Module, device, out: Path) -> str:
    example = get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), device)[0]
    tt_model = copy.deepcopy(dense)
    start = time.perf_counter()
    summary = tensorize(tt_model, p, args, example)
    setup = time.perf_counter() - start
    args.gate_lr_used = gate_lr(args, 1000)  # no training: only the optimizer's per-step cost matters
    rows = []
    for name, model, optimizer in (
        ("dense", dense, make_dense_optimizer(dense, args)),
        ("comera_fx", tt_model, make_tt_optimizer(tt_model, args, args.gate_lr_used)),
    ):
        print(f"timing {name} ...", flush=True)
        seconds = measure(model, optimizer, train_data, p, device)
        rows.append(
            (
                name,
                f"{seconds:.3f}",
                f"{p.batch * p.seq_len / seconds:,.0f}",
                f"{linear_params(model):,}",
                f"{total_params(model):,}",
            )
        )
    speed = float(rows[0][1]) / float(rows[1][1])
    table = markdown_table(("run", "s/step (median of 3)", "tokens/s", "linear-layer params", "total params"), rows)
    extra = (
        f"comera_fx step time vs dense: {speed:.2f}× faster"
        if speed >= 1
        else f"comera_fx step time vs dense: {1 / speed:.2f}× slower"
    ) + f" (eager). tensorize_ took {setup:.1f} s. Measure-only preset: no training, no plots."
    write_report(out, args, p, data_info, [], table, str(comera_fx.report(tt_model)), str(summary), extra)
    return table + "\n\n" + extra


def main(argv: list[str] | None = None) -> dict:
    """Run the demo; returns {"out": folder, "results": [RunResult, ...], "table": markdown}. Restores torch's
    thread count afterwards (so it can run in-process, e.g. from a test)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, p = parse_args(argv)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, p)
    finally:
        torch.set_num_threads(threads_before)


def _run(args, p: Preset) -> dict:
    device = torch.device(args.device)
    out = args.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()

    train_data, val_data, data_info = load_stdlib(p.data_bytes)
    print(
        f"data: {data_info['train_files']} train / {data_info['val_files']} val files from {data_info['root']} "
        f"({data_info['train_bytes']:,} / {data_info['val_bytes']:,} bytes)",
        flush=True,
    )
    val_gen = torch.Generator().manual_seed(1234)
    val_set = [get_batch(val_data, p.batch, p.seq_len, val_gen, device) for _ in range(p.val_batches)]

    torch.manual_seed(args.seed)
    dense = GPT(p).to(device)
    initial = copy.deepcopy(dense)

    if p.measure_only:
        text = run_measure_only(args, p, data_info, train_data, dense, device, out)
        print(text)
        print(f"\nreport: {out / 'report.md'}  ({time.perf_counter() - wall_start:.0f} s in all)")
        return {"out": str(out)}

    # -- dense --------------------------------------------------------------------------------------------------
    dense_result = RunResult("dense")
    train("dense", dense, make_dense_optimizer(dense, args), None, train_data, val_set, p, args, device, dense_result)

    # -- comera_fx ----------------------------------------------------------------------------------------------
    tt_result = RunResult("comera_fx")
    tt_model = copy.deepcopy(initial)
    optimizer, hook, summary, step_seconds = prepare_tt_run(tt_model, p, args, train_data, device, tt_result)
    train("comera_fx", tt_model, optimizer, hook, train_data, val_set, p, args, device, tt_result)
    hook.remove()

    # -- outputs ------------------------------------------------------------------------------------------------
    results = [dense_result, tt_result]
    table = results_table(results)
    gap = tt_result.final_val - dense_result.final_val
    extra = (
        f"comera_fx − dense final val loss: {gap:+.4f} nats/byte ({gap / dense_result.final_val:+.1%}); "
        f"linear layers {dense_result.linear_params_end / max(tt_result.linear_params_end, 1):.1f}× smaller, "
        f"whole model {dense_result.total_params_end / max(tt_result.total_params_end, 1):.1f}× smaller. "
        f"tensorize_ took {tt_result.setup_seconds:.1f} s (outside the budget)"
    )
    if tt_result.late_start_step is not None:
        extra += (
            f"; the late stage started at step {tt_result.late_start_step} (estimated {step_seconds:.3f} "
            f"s/step before training)"
        )
    extra += "."
    if tt_result.history:
        last = tt_result.history[-1]
        extra += (
            f" Rank adaptation: size target {tt_result.target_params:,.0f} TT params "
            f"({args.keep_fraction:.0%} of {hook.initial_tt_params:,}); at the end {last['tt_params']:,} at the live "
            f"ranks, {last['tt_params_without_dead']:,} without the dead slices."
        )
    if tt_result.shrunk_after_training and tt_result.shrunk_after_training[0] != tt_result.shrunk_after_training[1]:
        before, after = tt_result.shrunk_after_training
        extra += (
            f" After training the cores held wider for compiling shrank to their live ranks: {before:,} → "
            f"{after:,} stored TT params (the table's end sizes are after this)."
        )
    import matplotlib

    matplotlib.use("Agg")
    plot_val_loss(results, out / "val_loss.png")
    plot_compression(tt_result, out / "compression.png")
    plot_ranks(tt_result, out / "ranks.png")
    (out / "rank_history.json").write_text(json.dumps(tt_result.history))
    metrics = {
        r.name: {k: v for k, v in asdict(r).items() if k != "history"}
        | {"steps_per_s": r.steps_per_s, "tokens_per_s": r.tokens_per_s, "final_val": r.final_val}
        for r in results
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_report(out, args, p, data_info, results, table, str(comera_fx.report(tt_model)), str(summary), extra)

    print("\n" + table + "\n\n" + extra)
    print(f"\nreport: {out / 'report.md'}  ({time.perf_counter() - wall_start:.0f} s in all)")
    return {"out": str(out), "results": results, "table": table}


if __name__ == "__main__":
    main()
