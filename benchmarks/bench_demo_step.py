"""Issue 44 item 4: where does the demo's compiled TT step lose to its eager one?

Builds examples/train_code_lm.py's comera_fx run at the small preset's shapes (4 blocks, d 384, batch 16 × 128,
every block linear TT at max rank 16, AdamW with the demo's groups and its ``RankAdaptive`` hook), compiles the
blocks as ``CompileProbe`` does, and times the demo's whole step and its parts with the blocks compiled and eager,
interleaved and rotated in one process (``common.time_rotated``: drift falls on both). ``--profile``: the torch
profiler's top ops of both paths' steps. After the timing it prints each path's minor page faults a step: glibc maps
large freed blocks afresh depending on the process's history, and those first touches (~0.75 µs a page here, up to
~11 k pages a step) fall mostly on the eager step (benchmarks/history/2026-12-07-session12.md). Random bytes stand
in for the stdlib text: only the shapes matter here. ``--autocast bf16``: the forward under CPU autocast (on an AMD
Zen 4 slower than fp32 on both paths: 201 / 203 ms against 158 / 177 ms, 2026-12-07).

    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_demo_step.py --profile [--kernel-profile]
"""

from __future__ import annotations

import argparse

import common

common.use_this_checkout()
import openmp_policy

WAIT_POLICY = openmp_policy.choose_wait_policy()

import torch
import train_code_lm as demo

import comera_fx
from comera_fx import compile_policy
from comera_fx.backend import make_backend


def build(args):
    """The demo's comera_fx run: (model, optimizer, hook, batch)."""
    dargs, p = demo.parse_args(["--compile", "yes", "--quiet", "--seed", str(args.seed)])
    torch.manual_seed(dargs.seed)
    data = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    model = demo.GPT(p)
    result = demo.RunResult("bench")
    optimizer, hook, _, _ = demo.prepare_tt_run(model, p, dargs, data, torch.device("cpu"), result)
    batch = demo.get_batch(data, p.batch, p.seq_len, torch.Generator().manual_seed(4), torch.device("cpu"))
    return model, optimizer, hook, batch


def parts(model, optimizer, hook, batch, autocast=None) -> dict:
    """The demo's step (training_steps' body) and its parts; ``autocast``: the forward under CPU autocast to
    that dtype."""
    x, y = batch

    def fwd_bwd():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = demo.lm_loss(model, x, y)
        loss.backward()
        return loss

    def rest(loss):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        hook.observe(loss)
        optimizer.step()
        float(loss.detach())

    def step():
        rest(fwd_bwd())

    return {"step": step, "fwd+bwd": fwd_bwd}


def on_path(model, calls, path, fn):
    """``fn`` with the blocks compiled (``path`` "compiled") or eager, as the probe switches them."""

    def call():
        if path == "eager":
            compile_policy.uncompile_blocks(model)
        else:
            compile_policy.resume_blocks(model, calls)
        return fn()

    return call


def profile(title, fn, steps=4, top=25):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    fn()
    with prof_ctx(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
    print(f"\n=== {title}, {steps} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--inner", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="top ops of both paths' whole steps")
    ap.add_argument(
        "--kernel-profile",
        action="store_true",
        help="top ops of both paths' forward + backward, Inductor's kernels named one by one",
    )
    ap.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an Inductor config patch for the blocks' backend (BackendConfig.inductor_options); repeatable",
    )
    ap.add_argument("--autocast", choices=("bf16",), default=None, help="the forward under CPU autocast")
    args = ap.parse_args(argv)
    if args.kernel_profile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # before the compile: a generated kernel records itself
    model, optimizer, hook, batch = build(args)
    if args.inductor_option:
        options = dict(_option(text) for text in args.inductor_option)
        comera_fx.compile_regions(model, backend=make_backend(inductor_options=options))
        print(f"inductor options {options}")
    else:
        compile_policy.compile_blocks(model)
    fns = parts(model, optimizer, hook, batch, torch.bfloat16 if args.autocast else None)
    fns["step"]()  # compiles
    calls = [b._compiled_call_impl for b in model.blocks]
    columns = {
        f"{path} {name}": on_path(model, calls, path, fn) for path in ("compiled", "eager") for name, fn in fns.items()
    }
    seconds = common.time_rotated(columns, repeats=args.rounds, inner=args.inner)
    for name, s in seconds.items():
        print(f"{name:20s} {s * 1e3:8.1f} ms")
    print(
        f"eager/compiled: step {seconds['eager step'] / seconds['compiled step']:.3f}x, fwd+bwd "
        f"{seconds['eager fwd+bwd'] / seconds['compiled fwd+bwd']:.3f}x; threads {torch.get_num_threads()}, "
        f"{WAIT_POLICY}, load {common.loadavg()}"
    )
    faults = {}
    for path in ("compiled", "eager"):  # after the timing: the allocator's state as the timed steps left it
        step = on_path(model, calls, path, fns["step"])
        step()
        before = common.minor_faults()
        for _ in range(4):
            step()
        faults[path] = (common.minor_faults() - before) / 4
    print(
        f"page faults a step: compiled {faults['compiled']:.0f}, eager {faults['eager']:.0f} (glibc's thresholds move "
        "with the run's history; MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 "
        "MALLOC_TOP_PAD_=268435456 in the environment hold them at none)"
    )
    if args.profile:
        for path in ("eager", "compiled"):
            profile(f"{path} step", on_path(model, calls, path, fns["step"]))
    if args.kernel_profile:
        for path in ("eager", "compiled"):
            profile(f"{path} fwd+bwd", on_path(model, calls, path, fns["fwd+bwd"]))
    compile_policy.resume_blocks(model, calls)


if __name__ == "__main__":
    main()
