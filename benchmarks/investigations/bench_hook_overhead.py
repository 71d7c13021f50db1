"""What does ``RankAdaptive``'s per-step bookkeeping cost next to the optimizer step it rides on?

bench_pruned_step's LM (``--width``, every block linear a TT matrix at ``--rank``), one backward so that every
parameter has a gradient, then, with the columns interleaved and rotated (``common.time_rotated``), each followed
by a wait for the device: AdamW's step alone; the step with a ``RankAdaptive`` budget schedule attached whose
first prune lies far beyond the timed steps (its per-step work only); and the hook's two parts alone, the
importance averages (``BondSensitivity.update``) and the history entry (``live_counts`` and the sizes).
``--profile`` adds torch.profiler's table of the hooked steps (CPU, and CUDA where the model is).

    .venv/bin/python benchmarks/investigations/bench_hook_overhead.py
    python benchmarks/investigations/bench_hook_overhead.py --device cuda --width 1024 --profile
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common and bench_pruned_step
import common  # noqa: E402

common.use_this_checkout()

from bench_pruned_step import VOCAB, build, loss_fn  # noqa: E402
from comera_fx.runtime import BudgetConfig, RankAdaptive  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    model = build(args.rank, args.width).to(device)
    data = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(1)).to(device)
    hooked = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    hooked_opt = torch.optim.AdamW(hooked.parameters(), lr=1e-6)
    hook = RankAdaptive(hooked, hooked_opt, BudgetConfig(keep_fraction=0.3, total_steps=10**7, prunes=5))
    for m in (model, hooked):
        loss_fn(m, data[:, :-1], data[:, 1:]).backward()
    entries = [m for m in hook.matrices if m.shrinkable]
    columns = {
        "AdamW step": common.synced(plain_opt.step, device),
        "AdamW step + hook": common.synced(hooked_opt.step, device),
        "hook: importance averages": common.synced(lambda: hook.importance.update(entries), device),
        "hook: history entry": common.synced(lambda: hook._entry([], None), device),
    }
    seconds = common.time_rotated(columns, repeats=args.rounds, inner=args.inner)
    gates = sum(len(m.tt.gates) for m in entries)
    print(
        f"device {args.device}, width {args.width}, rank {args.rank}: {len(entries)} TT matrices, {gates} gates, "
        f"{sum(1 for _ in hooked.parameters())} parameters; threads {args.threads}, load {common.loadavg()}"
    )
    for name, s in seconds.items():
        print(f"{name:28s} {1e3 * s:7.3f} ms")
    print(f"the hook adds {1e3 * (seconds['AdamW step + hook'] - seconds['AdamW step']):.3f} ms per step")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(10):
                columns["AdamW step + hook"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
