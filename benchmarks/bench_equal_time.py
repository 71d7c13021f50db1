"""Equal wall-clock training of the demo's byte-level code LM, five ways side by side.

Same data (the demo's standard-library bytes, split by file), same seed, same batches, same training budget (wall
clock of the training steps; validation outside the clock) for:

* ``dense``     — the demo's GPT (preset "small": 4 layers, d 384, ff 1536, seq 128, batch 16), AdamW;
* ``comera_fx`` — the same initial model, ``tensorize_`` (max rank 16, TT-SVD init) + ``RankAdaptive``, exactly as
                  the demo's comera_fx run (same code: ``prepare_tt_run``);
* ``lowrank``   — every block linear replaced by x·A·B + b with A (in × r), B (r × out), r = the TT max rank (16),
                  initialised from the truncated SVD of the same initial weights; A, B at the TT cores' rate;
* ``narrow``    — a dense GPT with the width chosen so its block linears hold about as many parameters as the
                  comera_fx run's block linears at its end (``--narrow-d auto``; d // 32 heads, at least 1; ff 4·d);
* ``tt_fixed``  — (only with ``--runs ...,tt_fixed``) the comera_fx run's TT layers at fixed rank 16, no
                  RankAdaptive (gates at lr 1e-3): the equal-rank figure to set against public CoMERA's TT layers;
* ``tt_size``   — (only with ``--runs``) TT at the fixed uniform max rank whose TT size is closest to the size
                  target S of the comera_fx run (``--keep-fraction`` of the rank-16 TT size), from the start;
* ``lowrank_size`` — (only with ``--runs``) low-rank x·A·B at the uniform r whose factors are closest to S;
* ``galore``    — the dense model trained with ``galore_torch.GaLoreAdamW`` (rank ``--galore-rank`` projections of
                  the block linears' gradients; benchmark-only dependency ``pip install galore-torch``); skipped with
                  the reason when it cannot be imported.

Every run trains through the demo's ``train``, so ``--compile auto`` (the default) applies to each: after a few eager
steps it compiles the blocks when the budget could repay it, keeps the compiled path only when the measured step
repays compile and recompiles, and counts the compile inside the run's clock (``comera_fx.compile_policy``);
the table says which path each run took and why. ``--compile no`` is the all-eager comparison of earlier runs.

Each run is a separate subprocess (so its peak RSS — VmHWM — is its own; the peak is reset with
/proc/self/clear_refs just before training, so "train peak" excludes data loading and tensorize_). For every run the
load average and the CPU time other processes used (from /proc/stat minus this process's own) are recorded.

After training each child also measures, on its trained model, where a step's time goes: forward / backward /
clipping / optimizer step (hook included), median of ``--profile-steps`` steps, and forward+backward of each
block linear alone at the step's 2048 tokens (which layers cost what).

Usage::

    .venv/bin/python benchmarks/bench_equal_time.py            # 5 × 120 s: ~14 minutes
    .venv/bin/python benchmarks/bench_equal_time.py --runs comera_fx,tt_size,lowrank_size,dense   # issue 11's (a)-(d)
    .venv/bin/python benchmarks/bench_equal_time.py --budget-seconds 420 --json out.json # the issue's 7 minutes
    .venv/bin/python benchmarks/bench_equal_time.py --runs dense,comera_fx --budget-seconds 20   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import common  # noqa: E402  (torch-free; benchmarks/ is this script's sys.path[0])

common.use_this_checkout()
import openmp_policy  # noqa: E402  (torch-free)

# Before torch loads OpenMP, as the demo does; the children inherit the choice (examples/openmp_policy.py).
WAIT_POLICY = openmp_policy.choose_wait_policy()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import train_code_lm as demo  # noqa: E402
from common import OthersMeter, loadavg, proc_status, reset_peak_rss, write_record  # noqa: E402

RUNS = ("dense", "comera_fx", "lowrank", "narrow", "galore")
EXTRA_RUNS = ("tt_fixed", "tt_size", "lowrank_size")  # not run by default: --runs ...,tt_fixed
LINEAR_NAMES = ("qkv", "proj", "fc", "out")

# ------------------------------------------------------------------------------------------------ the baselines


class LowRankLinear(nn.Module):
    """y = (x·A)·B + b, A: in × r, B: r × out (leaf parameters)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.a, self.b = nn.Parameter(a), nn.Parameter(b)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, rank: int) -> "LowRankLinear":
        """Truncated SVD of W (out × in): W ≈ U_r S_r V_rᵀ, A = V_r S_r^½, B = S_r^½ U_rᵀ (the closest rank-r
        factorisation, as the TT run's TT-SVD init is of its weights)."""
        u, s, vh = torch.linalg.svd(linear.weight.detach(), full_matrices=False)
        root = s[:rank].sqrt()
        return cls((vh[:rank].t() * root).contiguous(), (root[:, None] * u[:, :rank].t()).contiguous(), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.a) @ self.b
        return y + self.bias if self.bias is not None else y


def lowrank_(model: nn.Module, rank: int) -> None:
    for block in model.blocks:
        for name in LINEAR_NAMES:
            setattr(block, name, LowRankLinear.from_dense(getattr(block, name), rank))


def narrow_preset(p: demo.Preset, d: int) -> demo.Preset:
    heads = max(1, d // 32)
    while d % heads:
        heads -= 1
    return dataclasses.replace(p, d_model=d, heads=heads, d_ff=4 * d)


def linear_params_at(p: demo.Preset, d: int) -> int:
    """Block-linear parameters of the demo's GPT at width d with ff 4·d: per layer 12·d² + 9·d."""
    return p.layers * (12 * d * d + 9 * d)


def pick_narrow_width(p: demo.Preset, target: float) -> int:
    return min(range(8, p.d_model + 1, 8), key=lambda d: abs(linear_params_at(p, d) - target))


def tt_params_of(model: nn.Module) -> int:
    from comera_fx.tt.inventory import tt_matrices

    return sum(q.numel() for m in tt_matrices(model) for q in m.tt.parameters())


def size_target(model: nn.Module, p: demo.Preset, args, example: torch.Tensor, rank: int) -> tuple[int, float]:
    """(TT size at max rank ``rank``, the comera_fx run's target S = --keep-fraction of it), from a throwaway copy
    (init "random": only the shapes matter)."""
    import copy

    trial = copy.deepcopy(model)
    demo.tensorize(trial, p, argparse.Namespace(**{**vars(args), "init": "random", "max_rank": rank}), example)
    full = tt_params_of(trial)
    return full, args.keep_fraction * full


def rank_for_size(
    model: nn.Module, p: demo.Preset, args, example: torch.Tensor, target: float, top: int
) -> tuple[int, int]:
    """The uniform TT max rank (1..top) whose TT size is closest to ``target`` -> (rank, its TT size)."""
    import copy

    best = None
    for r in range(1, top + 1):
        trial = copy.deepcopy(model)
        demo.tensorize(trial, p, argparse.Namespace(**{**vars(args), "init": "random", "max_rank": r}), example)
        size = tt_params_of(trial)
        if best is None or abs(size - target) < abs(best[1] - target):
            best = (r, size)
        if size > target:  # sizes grow with the rank: nothing larger can be closer
            break
    return best


def lowrank_rank_for_size(model: nn.Module, target: float) -> int:
    """Uniform r whose factors (r·(in + out) over the block linears) are closest to ``target``, at least 1."""
    per_rank = sum(getattr(b, n).in_features + getattr(b, n).out_features for b in model.blocks for n in LINEAR_NAMES)
    return max(1, round(target / per_rank))


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients + optimizer state tensors (GaLore's projection matrices included), counted
    from the tensors themselves: the part of the memory that compression changes (RSS also holds activations,
    the allocator's cache and the interpreter)."""
    seen: set[int] = set()

    def size(t) -> int:
        if not torch.is_tensor(t) or id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    total = sum(size(q) + size(q.grad) for q in model.parameters())
    for state in optimizer.state.values():
        for value in state.values():
            total += size(value)
            total += sum(size(v) for v in getattr(value, "__dict__", {}).values())  # e.g. GaLoreProjector
    return total


# ----------------------------------------------------------------------------------------------- where time goes


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def phase_split(model, optimizer, train_data, p, device, steps: int) -> dict[str, float]:
    """Median ms of forward (incl. loss) / backward / clip / optimizer.step (hooks included) over ``steps``
    training steps after one warm-up (the model keeps training; the results are already recorded)."""
    generator = torch.Generator().manual_seed(99)
    phases = {"forward": [], "backward": [], "clip": [], "optimizer": [], "step": []}
    for i in range(steps + 1):
        x, y = demo.get_batch(train_data, p.batch, p.seq_len, generator, device)
        t0 = time.perf_counter()
        loss = demo.lm_loss(model, x, y)
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t3 = time.perf_counter()
        optimizer.step()
        t4 = time.perf_counter()
        if i:
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[key].append(value)
    return {k: _median_ms(v) for k, v in phases.items()}


def layer_times(model, p, repeats: int) -> dict[str, float]:
    """Median ms of forward + backward of each block linear alone (x: batch·seq × in, dy random), summed over the
    blocks per layer name; "all" is the sum of the four."""
    tokens = p.batch * p.seq_len
    gen = torch.Generator().manual_seed(5)
    out = {}
    for name in LINEAR_NAMES:
        total = 0.0
        for block in model.blocks:
            layer = getattr(block, name)
            x = torch.randn(tokens, p.d_model if name != "out" else p.d_ff, generator=gen, requires_grad=True)
            dy = torch.randn(tokens, layer(x[:1]).shape[-1], generator=gen)
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                layer(x).backward(dy)
                times.append(time.perf_counter() - t0)
            total += statistics.median(times[1:])
        out[name] = 1000 * total
    out["all"] = sum(out[n] for n in LINEAR_NAMES)
    model.zero_grad(set_to_none=True)
    return out


# ----------------------------------------------------------------------------------------------------- one run


def child(opts) -> dict:
    """Build and train one variant; return its measurements (JSON-ready)."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    demo_argv = [
        "--budget-seconds",
        str(opts.budget_seconds),
        "--eval-every",
        str(opts.eval_every),
        "--seed",
        str(opts.seed),
        "--max-rank",
        str(opts.rank),
        "--compile",
        opts.compile,
    ]
    if not opts.progress:
        demo_argv.append("--quiet")
    args, p = demo.parse_args(demo_argv)
    device = torch.device("cpu")
    train_data, val_data, data_info = demo.load_stdlib(p.data_bytes)
    val_gen = torch.Generator().manual_seed(1234)
    val_set = [demo.get_batch(val_data, p.batch, p.seq_len, val_gen, device) for _ in range(p.val_batches)]

    torch.manual_seed(args.seed)
    model = demo.GPT(p).to(device)  # the dense run's initial model (every variant but narrow starts from it)
    result = demo.RunResult(opts.child)
    hook = None
    extra: dict = {}
    run_p = p
    if opts.child == "dense":
        optimizer = demo.make_dense_optimizer(model, args)
    elif opts.child == "comera_fx":
        optimizer, hook, _, step_seconds = demo.prepare_tt_run(model, p, args, train_data, device, result)
        extra.update(
            estimated_step_seconds=step_seconds,
            gate_lr=args.gate_lr_used,
            late_start_step=result.late_start_step,
            target_tt_params=result.target_params,
        )
    elif opts.child == "tt_fixed":  # comera_fx's TT layers at fixed rank: no RankAdaptive (equal-rank figure)
        example = demo.get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), device)[0]
        t0 = time.perf_counter()
        demo.tensorize(model, p, args, example)
        result.setup_seconds = time.perf_counter() - t0
        optimizer = demo.make_tt_optimizer(model, args, lr_gates=1e-3)
        extra.update(rank=opts.rank, lr_gates=1e-3)
    elif opts.child == "tt_size":  # issue 11 (b): fixed uniform rank of size S from the start
        example = demo.get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), device)[0]
        full, target = size_target(model, p, args, example, opts.rank)
        rank, size = rank_for_size(model, p, args, example, target, opts.rank)
        t0 = time.perf_counter()
        demo.tensorize(model, p, argparse.Namespace(**{**vars(args), "max_rank": rank}), example)
        result.setup_seconds = time.perf_counter() - t0
        optimizer = demo.make_tt_optimizer(model, args, lr_gates=1e-3)
        extra.update(rank=rank, tt_params=size, target_tt_params=target, rank16_tt_params=full, lr_gates=1e-3)
    elif opts.child == "lowrank_size":  # issue 11 (c): low-rank of size S
        example = demo.get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), device)[0]
        full, target = size_target(model, p, args, example, opts.rank)
        rank = lowrank_rank_for_size(model, target)
        lowrank_(model, rank)
        factors = [q for m in model.modules() if isinstance(m, LowRankLinear) for q in (m.a, m.b)]
        taken = {id(q) for q in factors}
        optimizer = torch.optim.AdamW(
            [
                {"params": factors, "lr": args.lr_cores},
                {"params": [q for q in model.parameters() if id(q) not in taken], "lr": args.lr},
            ],
            betas=(0.9, 0.95),
            weight_decay=0.0,
        )
        extra.update(
            rank=rank, factor_params=sum(q.numel() for q in factors), target_tt_params=target, lr_factors=args.lr_cores
        )
    elif opts.child == "lowrank":
        lowrank_(model, opts.rank)
        factors = [q for m in model.modules() if isinstance(m, LowRankLinear) for q in (m.a, m.b)]
        taken = {id(q) for q in factors}
        optimizer = torch.optim.AdamW(
            [
                {"params": factors, "lr": args.lr_cores},
                {"params": [q for q in model.parameters() if id(q) not in taken], "lr": args.lr},
            ],
            betas=(0.9, 0.95),
            weight_decay=0.0,
        )
        extra.update(rank=opts.rank, lr_factors=args.lr_cores)
    elif opts.child == "narrow":
        run_p = narrow_preset(p, opts.narrow_d)
        torch.manual_seed(args.seed)
        model = demo.GPT(run_p).to(device)
        optimizer = demo.make_dense_optimizer(model, args)
        extra.update(d_model=run_p.d_model, heads=run_p.heads, d_ff=run_p.d_ff)
    elif opts.child == "galore":
        from galore_torch import GaLoreAdamW  # ImportError is reported by the parent as "skipped"

        projected = [getattr(b, n).weight for b in model.blocks for n in LINEAR_NAMES]
        taken = {id(q) for q in projected}
        optimizer = GaLoreAdamW(
            [
                {"params": [q for q in model.parameters() if id(q) not in taken]},
                {
                    "params": projected,
                    "rank": opts.galore_rank,
                    "update_proj_gap": opts.galore_gap,
                    "scale": opts.galore_scale,
                    "proj_type": "std",
                },
            ],
            lr=args.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            no_deprecation_warning=True,
        )
        extra.update(rank=opts.galore_rank, update_proj_gap=opts.galore_gap, scale=opts.galore_scale)
    else:
        raise SystemExit(f"unknown run {opts.child!r}")

    rss_before = proc_status("VmRSS")
    peak_setup = proc_status("VmHWM")
    reset_ok = reset_peak_rss()
    load_start, meter = loadavg(), OthersMeter().start()
    wall = time.perf_counter()
    demo.train(opts.child, model, optimizer, hook, train_data, val_set, run_p, args, device, result)
    wall = time.perf_counter() - wall
    others, load_end = meter.stop(), loadavg()
    peak_train = proc_status("VmHWM")
    state_bytes = training_state_bytes(model, optimizer)  # after the last step: gradients still there

    if hook is not None:
        extra.update(
            final_tt_params=hook.live_tt_params(),
            initial_tt_params=hook.initial_tt_params,
            final_ranks=result.final_ranks,
            zeroed=dict(getattr(hook, "zeroed", {})),
            prune_steps=[e["step"] for e in result.history if e["shrunk"]],
        )
    profile = {}
    if opts.profile_steps:
        profile["phases_ms"] = phase_split(model, optimizer, train_data, run_p, device, opts.profile_steps)
        profile["layers_ms"] = layer_times(model, run_p, opts.profile_steps)
        if opts.child == "comera_fx":  # the hook's own share of optimizer.step(): the same steps without it
            hook.remove()
            profile["phases_without_hook_ms"] = phase_split(
                model, optimizer, train_data, run_p, device, opts.profile_steps
            )
    if hook is not None:
        hook.remove()
    return {
        "name": opts.child,
        "steps": result.steps,
        "train_seconds": result.train_seconds,
        "steps_per_s": result.steps_per_s,
        "tokens_per_s": result.tokens_per_s,
        "final_val": result.final_val,
        "evals": result.evals,
        "train_losses": result.train_losses,
        "linear_params_start": result.linear_params_start,
        "linear_params_end": result.linear_params_end,
        "total_params_start": result.total_params_start,
        "total_params_end": result.total_params_end,
        "setup_seconds": result.setup_seconds,
        "eval_seconds": result.eval_seconds,
        "rss_before_train": rss_before,
        "peak_rss_setup": peak_setup,
        "peak_rss_train": peak_train if reset_ok else None,
        "peak_rss_process": proc_status("VmHWM"),
        "peak_reset_ok": reset_ok,
        "state_bytes": state_bytes,
        "load_start": load_start,
        "load_end": load_end,
        "others_cores": others,
        "wall_seconds": wall,
        "threads": torch.get_num_threads(),
        "extra": extra,
        "profile": profile,
        "data": data_info,
        "compile": result.compile,
    }


# ------------------------------------------------------------------------------------------------------ parent


def spawn(name: str, opts, narrow_d: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--child-out",
            str(out),
            "--budget-seconds",
            str(opts.budget_seconds),
            "--eval-every",
            str(opts.eval_every),
            "--seed",
            str(opts.seed),
            "--rank",
            str(opts.rank),
            "--profile-steps",
            str(opts.profile_steps),
            "--galore-rank",
            str(opts.galore_rank),
            "--galore-gap",
            str(opts.galore_gap),
            "--galore-scale",
            str(opts.galore_scale),
            "--compile",
            opts.compile,
        ]
        if opts.threads:
            cmd += ["--threads", str(opts.threads)]
        if narrow_d:
            cmd += ["--narrow-d", str(narrow_d)]
        if opts.progress:
            cmd.append("--progress")
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=not opts.progress, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or "")[-1500:] if not opts.progress else "(see above)"
            return {"name": name, "skipped": f"exit code {proc.returncode}: {tail.strip()}"}
        result = json.loads(out.read_text())
        result["process_seconds"] = time.perf_counter() - started
        return result


def mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def tables(results: list[dict]) -> str:
    head = (
        "run",
        "steps",
        "steps/s",
        "tokens/s",
        "val loss (nats/byte)",
        "linear-layer params",
        "whole-model params",
        "params+grads+opt state (MiB)",
        "peak RSS train (MiB)",
        "peak RSS process (MiB)",
        "load start → end",
        "others (cores)",
    )
    rows, skipped = [], []
    for r in results:
        if "skipped" in r:
            skipped.append(f"- {r['name']}: skipped — {r['skipped']}")
            continue
        lin = fmt_params(r["linear_params_end"])
        if r["linear_params_end"] != r["linear_params_start"]:
            lin += f" (start {fmt_params(r['linear_params_start'])})"
        tot = fmt_params(r["total_params_end"])
        if r["total_params_end"] != r["total_params_start"]:
            tot += f" (start {fmt_params(r['total_params_start'])})"
        name = r["name"] + (f" d {r['extra']['d_model']}" if r["name"] == "narrow" else "")
        rows.append(
            (
                name,
                r["steps"],
                f"{r['steps_per_s']:.2f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['final_val']:.4f}",
                lin,
                tot,
                f"{r['state_bytes'] / 2**20:.1f}",
                mb(r["peak_rss_train"]),
                mb(r["peak_rss_process"]),
                f"{r['load_start']} → {r['load_end']}",
                f"{r['others_cores']:.2f}",
            )
        )
    text = demo.markdown_table(head, rows)
    ran = [r for r in results if "skipped" not in r and r.get("train_losses")]
    if len(ran) > 1:  # equal steps: the training loss (mean of 20 steps) where the slowest run stopped
        n = min(len(r["train_losses"]) for r in ran)
        window = min(20, n)
        cells = [f"{r['name']} {statistics.fmean(r['train_losses'][n - window : n]):.4f}" for r in ran]
        text += (
            f"\n\nAt equal steps: training loss, mean of steps {n - window + 1}-{n} (the shortest run's last "
            f"{window}): " + ", ".join(cells) + "."
        )
    prof = [r for r in results if "skipped" not in r and r.get("profile")]
    if prof:
        head2 = (
            "run",
            "step ms",
            "forward",
            "backward",
            "clip",
            "optimizer.step",
            "block linears fwd+bwd alone",
            "qkv",
            "proj",
            "fc",
            "out",
        )
        rows2 = []
        for r in prof:
            ph, ly = r["profile"]["phases_ms"], r["profile"]["layers_ms"]
            rows2.append(
                (
                    r["name"],
                    f"{ph['step']:.0f}",
                    f"{ph['forward']:.0f}",
                    f"{ph['backward']:.0f}",
                    f"{ph['clip']:.1f}",
                    f"{ph['optimizer']:.1f}",
                    f"{ly['all']:.0f}",
                    *(f"{ly[n]:.1f}" for n in LINEAR_NAMES),
                )
            )
        text += (
            "\n\nWhere a step's time goes (ms, median of the profile steps on the trained model; the layer "
            "columns are forward+backward of each block linear alone at 2048 tokens, summed over the 4 "
            "blocks):\n\n" + demo.markdown_table(head2, rows2)
        )
        tt = next((r for r in prof if "phases_without_hook_ms" in r["profile"]), None)
        if tt:
            wo = tt["profile"]["phases_without_hook_ms"]
            text += (
                f"\n\ncomera_fx without the RankAdaptive hook: step {wo['step']:.0f} ms, optimizer.step "
                f"{wo['optimizer']:.1f} ms."
            )
    compiled = [r for r in results if "skipped" not in r and r.get("compile")]
    if compiled:
        text += "\n\nCompiled or eager (`--compile`; compile seconds are inside each run's clock):\n\n" + "\n".join(
            f"- {r['name']}: {demo.compile_line(r['compile'])}" for r in compiled
        )
    if skipped:
        text += "\n\n" + "\n".join(skipped)
    return text


def parent(opts) -> None:
    names = [n.strip() for n in opts.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS + EXTRA_RUNS]
    if bad:
        raise SystemExit(f"unknown runs {bad}; choose from {RUNS + EXTRA_RUNS}")
    print(
        f"{datetime.now():%Y-%m-%d %H:%M:%S}  load {loadavg()}  torch {torch.__version__}  "
        f"budget {opts.budget_seconds:g} s per run  runs {names}  {WAIT_POLICY}",
        flush=True,
    )
    p = demo.PRESETS["small"]
    results = []
    galore_note = None
    if "galore" in names:
        try:
            import galore_torch  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means: cannot run it here
            galore_note = f"galore-torch not importable: {type(exc).__name__}: {exc}"
    for name in names:
        if name == "galore" and galore_note:
            results.append({"name": "galore", "skipped": galore_note})
            print(f"galore: skipped ({galore_note})", flush=True)
            continue
        narrow_d = None
        if name == "narrow":
            if opts.narrow_d != "auto":
                narrow_d = int(opts.narrow_d)
            else:
                tt = next((r for r in results if r["name"] == "comera_fx" and "skipped" not in r), None)
                target = tt["linear_params_end"] if tt else 0.5 * 128_400  # the demo's usual end size
                narrow_d = pick_narrow_width(p, target)
        print(f"{datetime.now():%H:%M:%S}  {name} ... (load {loadavg()})", flush=True)
        r = spawn(name, opts, narrow_d)
        results.append(r)
        if "skipped" in r:
            print(f"  skipped: {r['skipped']}", flush=True)
        else:
            print(
                f"  {r['steps']} steps, {r['steps_per_s']:.2f} steps/s, val {r['final_val']:.4f}, "
                f"linear params {r['linear_params_end']:,}, peak RSS train {mb(r['peak_rss_train'])} MiB, "
                f"load {r['load_start']} → {r['load_end']}, others {r['others_cores']:.2f} cores",
                flush=True,
            )
    text = tables(results)
    print("\n" + text)
    print(f"\nfinished {datetime.now():%Y-%m-%d %H:%M:%S}, load {loadavg()}")
    if opts.json:
        write_record(opts.json, openmp=WAIT_POLICY, results=results)


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--budget-seconds",
        type=float,
        default=120.0,
        help="training wall clock per run (default 120: five runs in ~13 minutes)",
    )
    ap.add_argument(
        "--eval-every", type=float, default=None, help="seconds of training between validations (default: budget / 8)"
    )
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS + EXTRA_RUNS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=16, help="TT max rank and low-rank r")
    ap.add_argument("--narrow-d", default="auto", help="narrow model width, or 'auto' (match comera_fx's end size)")
    ap.add_argument("--galore-rank", type=int, default=16)
    ap.add_argument("--galore-gap", type=int, default=200, help="GaLore update_proj_gap")
    ap.add_argument("--galore-scale", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--compile",
        choices=("auto", "yes", "no"),
        default="auto",
        help="each run: compile its blocks when it pays (auto), always (yes) or never (no); see the demo",
    )
    ap.add_argument("--profile-steps", type=int, default=5, help="steps for the time split after training (0: none)")
    ap.add_argument("--progress", action="store_true", help="show the children's progress bars")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.eval_every is None:
        opts.eval_every = max(opts.budget_seconds / 8, 1.0)
    return opts


def main(argv=None) -> None:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts.child:
        if opts.narrow_d != "auto":
            opts.narrow_d = int(opts.narrow_d)
        result = child(opts)
        Path(opts.child_out).write_text(json.dumps(result))
    else:
        parent(opts)


if __name__ == "__main__":
    main()
