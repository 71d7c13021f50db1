"""Issue 30 item 3: is a pruned TT model's compiled training step as cheap as its FLOPs say?

bench_recompile's byte-level causal LM (2 pre-LN blocks, d 128 or ``--width``, 4 heads, ff 4 d, seq 64, tied
256-token head) in three layouts: dense, every block linear tensorized at ``--ranks`` (default 16, the unpruned
model of issue 30, then 6: the layout a physical shrink to ~0.3 of the TT parameters leaves, with uniform ranks
instead of the schedule's uneven ones). Each is timed at each ``--batches`` (sequences of 64 tokens per step)
eagerly and compiled (regional: each block compiled on its own, ``comera_fx.compile_regions`` for TT,
``block.compile()`` for dense, a fresh Dynamo state per layout), the eager and compiled copies interleaved round by
round. Per cell: forward + backward FLOPs (``torch.utils.flop_counter``; again with attention's products, which
it does not see in the CPU's flash kernels), the whole step (forward, backward,
AdamW) and its parts (forward + backward alone, the optimizer step alone), eager and compiled. ``--hook``: the TT
layouts train under a ``RankAdaptive`` schedule that does not prune while timed (what a rank-adaptive run pays
every step).

Item 3 asks: compiled step at the pruned ranks / at the unpruned ranks <= the FLOPs ratio, and the pruned model's
compiled step below its eager step. The parts say where a step that does not scale with FLOPs spends its time.

    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_pruned_step.py               # 512 and 4096 tokens
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_pruned_step.py --width 512 --ranks 32 8 --hook
    .venv/bin/python benchmarks/bench_pruned_step.py --no-inductor --batches 2 --rounds 2   # smoke: eager backend
    python benchmarks/bench_pruned_step.py --device cuda --width 1024 --ranks 32 8 --batches 256   # a GPU (TF32)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

import common  # benchmarks/common.py: this checkout first on sys.path

common.use_this_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import comera_fx  # noqa: E402
from bench_recompile import VOCAB, CausalLM, step_flops  # noqa: E402
from comera_fx.backend import make_backend  # noqa: E402
from comera_fx.runtime import BudgetConfig, RankAdaptive  # noqa: E402


def build(rank: int | None, width: int = 128) -> nn.Module:
    """The LM (d ``width``, ff 4 · width), seeded; ``rank``: every block linear tensorized at that max rank (None:
    dense)."""
    torch.manual_seed(0)
    model = CausalLM(2, width, 4, 4 * width, 64)
    if rank is not None:
        comera_fx.tensorize_(
            model,
            comera_fx.TensorizeConfig(max_rank=rank, min_numel=4096),
            filter_fn=lambda module, fqn: isinstance(module, nn.Linear),
        )
    return model


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def step_flops_with_attention(model: nn.Module, batch) -> int:
    """``step_flops`` with attention's products counted: torch's FLOP counter has no formula for the CPU's flash
    attention kernels, so the step is counted once more under the math backend, whose matmuls it sees. The
    rank-independent work item 3's ratio should include, as far as it is FLOPs (norms and AdamW are not counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return step_flops(model, loss_fn, batch)


def step_parts(model: nn.Module, batch, hook: bool = False) -> dict:
    """Closures of one training step and of its parts, on ``model`` with its own AdamW (``hook``: and a
    ``RankAdaptive`` budget schedule whose first prune lies far beyond the timed steps: its per-step cost only)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if hook:
        RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.3, total_steps=10**7, prunes=5))

    def forward_backward():
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model, *batch).backward()

    def step():
        forward_backward()
        optimizer.step()

    forward_backward()  # every parameter has a .grad from here on, so the optimizer step can be timed alone
    return {"step": step, "fwd+bwd": forward_backward, "optimizer": optimizer.step}


def time_layout(name: str, rank: int | None, tokens_per_row: int, batch_rows: int, args, backend) -> dict:
    device = torch.device(args.device)
    data = torch.randint(0, VOCAB, (batch_rows, tokens_per_row + 1), generator=torch.Generator().manual_seed(1))
    batch = (data[:, :-1].to(device), data[:, 1:].to(device))
    eager = build(rank, args.width).to(device)
    flops = step_flops(eager, loss_fn, batch)
    flops_attention = step_flops_with_attention(eager, batch)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    start = time.perf_counter()
    if rank is None:
        for block in compiled.blocks:
            block.compile(backend="aot_eager" if args.no_inductor else "inductor")
    else:
        comera_fx.compile_regions(compiled, backend=backend)
    hook = args.hook and rank is not None
    parts = {"eager": step_parts(eager, batch, hook), "compiled": step_parts(compiled, batch, hook)}  # compiles
    compile_s = time.perf_counter() - start
    columns = {f"{path} {part}": common.synced(fn, device) for path, fns in parts.items() for part, fn in fns.items()}
    seconds = common.time_rotated(columns, repeats=args.rounds, inner=args.inner)
    if args.profile and rank is not None:
        print_profile(f"{name}, {batch_rows * tokens_per_row} tokens, compiled step", parts["compiled"]["step"])
    expected = eager(batch[0]).detach()  # grad on in both: the compiled training graph, no new compile
    rel = ((compiled(batch[0]).detach() - expected).norm() / expected.norm()).item()
    row = {
        "layout": name,
        "rank": rank,
        "rows": batch_rows,
        "tokens": batch_rows * tokens_per_row,
        "flops": flops,
        "flops_with_attention": flops_attention,
        "compile_s": compile_s,
        "compiled_vs_eager_rel": rel,
        **seconds,
    }
    print(
        f"{name:10s} {row['tokens']:5d} tokens: FLOPs {flops:.3g} ({flops_attention:.3g} with attention); step "
        f"eager {seconds['eager step']:.4f} s, compiled {seconds['compiled step']:.4f} s (fwd+bwd "
        f"{seconds['compiled fwd+bwd']:.4f}, optimizer {seconds['compiled optimizer']:.4f}); "
        f"compile {compile_s:.0f} s; "
        f"compiled vs eager {rel:.1e}",
        flush=True,
    )
    return row


def print_profile(title: str, step, steps: int = 5, top: int = 12) -> None:
    """Where a step's time goes: torch.profiler's ops by self CPU time over ``steps`` steps, and the GEMMs' count,
    FLOPs (from their recorded shapes) and time, which say whether the compiled graph runs the planned products."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    print(f"\n{title}, {steps} steps:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    for op, (calls, flops, ms) in gemm_totals(prof.events()).items():
        print(f"{op}: {calls / steps:.0f} calls, {flops / steps:.3g} FLOPs, {ms / steps:.1f} ms per step")


def gemm_totals(events) -> dict[str, tuple[int, int, float]]:
    """(calls, FLOPs, self CPU ms) of each GEMM op among profiler events recorded with their shapes."""
    totals: dict[str, tuple[int, int, float]] = {}
    for event in events:
        shapes = event.input_shapes
        if event.name in ("aten::mm", "aten::bmm"):
            a, b = shapes[0], shapes[1]
        elif event.name in ("aten::addmm", "aten::baddbmm"):
            a, b = shapes[1], shapes[2]
        else:
            continue
        flops = 2 * math.prod(a) * b[-1]  # (…, m, k) @ (…, k, n): 2·batch·m·k·n
        calls, total, ms = totals.get(event.name, (0, 0, 0.0))
        totals[event.name] = (calls + 1, total + flops, ms + event.self_cpu_time_total / 1e3)
    return totals


def summary(rows: list[dict], unpruned: int, pruned: int) -> list[str]:
    """Item 3's ratios per batch size."""
    lines = []
    for tokens in dict.fromkeys(r["tokens"] for r in rows):
        by = {r["rank"]: r for r in rows if r["tokens"] == tokens}
        big, small, dense = by[unpruned], by[pruned], by.get(None)
        flops = small["flops"] / big["flops"]
        with_attention = small["flops_with_attention"] / big["flops_with_attention"]
        lines.append(
            f"{tokens} tokens: FLOPs rank {pruned} / rank {unpruned} {flops:.2f} ({with_attention:.2f} with "
            f"attention); compiled step "
            f"{small['compiled step'] / big['compiled step']:.2f} (fwd+bwd "
            f"{small['compiled fwd+bwd'] / big['compiled fwd+bwd']:.2f}); eager step "
            f"{small['eager step'] / big['eager step']:.2f}; compiled / eager at rank {unpruned} "
            f"{big['compiled step'] / big['eager step']:.2f}, at rank {pruned} "
            f"{small['compiled step'] / small['eager step']:.2f}"
            + (
                f"; dense compiled / TT rank {pruned} compiled {dense['compiled step'] / small['compiled step']:.2f}"
                if dense
                else ""
            )
        )
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs=2, default=(16, 6), metavar=("UNPRUNED", "PRUNED"))
    ap.add_argument("--batches", type=int, nargs="+", default=(8, 64), help="sequences of 64 tokens per step")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=128, help="d_model (ff 4x): wider puts more FLOPs in the TT layers")
    ap.add_argument("--profile", action="store_true", help="also print a profile of each TT layout's compiled step")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--hook", action="store_true", help="TT layouts train under RankAdaptive (no prune while timed)")
    ap.add_argument("--no-inductor", action="store_true", help="the backend's eager mode (a smoke run)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda, float32 matmuls may use TF32)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = common.temporary_inductor_cache("bench_pruned_step_inductor_")
    torch.set_num_threads(args.threads)
    backend = make_backend(inductor=not args.no_inductor)
    layouts = [(f"TT r{r}", r) for r in args.ranks] + ([] if args.no_dense else [("dense", None)])
    load = common.loadavg()
    rows = [time_layout(name, rank, 64, b, args, backend) for b in args.batches for name, rank in layouts]
    print(
        f"\ndevice {args.device}, threads {args.threads}, load before {load}, after {common.loadavg()}, "
        f"{common.openmp_setting()}"
    )
    lines = summary(rows, *args.ranks)
    print("\n".join(lines))
    if args.out:
        common.write_record(args.out, rows=rows, summary=lines, argv=argv, load_before=load)


if __name__ == "__main__":
    main()
