"""On a GPU, does replaying the compiled training step as CUDA graphs make a pruned TT step follow its FLOPs?

Issue 30 item 3 on an H200: the TT step of bench_pruned_step's LM is bound by kernel launches (FLOPs 0.51, step
0.98× at ranks 32 → 8; benchmarks/RESULTS.md). CUDA graphs remove the per-launch cost. With regional compilation
(``compile_regions``) Inductor's ``triton.cudagraphs`` failed in the first backward, so this compiles the *whole*
model, once without and once with CUDA graphs (``inductor_options={"triton.cudagraphs": True}`` for the comera_fx
backend, ``mode="reduce-overhead"`` for dense), and times forward + backward + AdamW against eager. Each layout
records its error instead of stopping the script.

Run once on an H200 (torch 2.11, 2026-12-04; RESULTS.md, the H200 section) with ``zero_grad(set_to_none=False)``:
CUDA graphs failed for dense and TT alike ("accessing tensor output of CUDAGraphs that has been overwritten"),
and a second TT model's whole-model compile failed in Dynamo's guard on ``tt.layers._ENVELOPES`` (not seen on
torch 2.13; a deep copy now keeps its plan pins, so the copies here read no global cache). The step now sets
gradients to None; that version has not run on a GPU yet.

    python benchmarks/investigations/gpu_cudagraphs_step.py                       # d 1024, 16 k tokens, TF32
    python benchmarks/investigations/gpu_cudagraphs_step.py --device cpu --width 64 --batches 2 --no-graphs   # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common and bench_pruned_step
import common  # noqa: E402

common.use_this_checkout()

from bench_pruned_step import VOCAB, build, loss_fn  # noqa: E402
from comera_fx.backend import make_backend  # noqa: E402


def train_step(model, optimizer, batch, graphs: bool):
    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # None, not zeros: with CUDA graphs the gradients live in the graphs' memory pool, and zeroing them in
        # place touches tensors the next replay overwrites (the first run, with set_to_none=False, failed so).
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, *batch).backward()
        optimizer.step()

    return step


def compiled_copy(model, rank, graphs: bool, inductor: bool):
    if rank is None:
        return torch.compile(
            model, backend="inductor" if inductor else "aot_eager", mode="reduce-overhead" if graphs else None
        )
    options = {"triton.cudagraphs": True} if graphs else {}
    return torch.compile(model, backend=make_backend(inductor=inductor, inductor_options=options))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--ranks", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--batches", type=int, default=256, help="sequences of 64 tokens per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph columns (a CPU smoke run)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    data = torch.randint(0, VOCAB, (args.batches, 65), generator=torch.Generator().manual_seed(1)).to(device)
    batch = (data[:, :-1], data[:, 1:])
    rows = []
    for name, rank in [(f"TT r{r}", r) for r in args.ranks] + [("dense", None)]:
        row = {"layout": name}
        base = build(rank, args.width).to(device)
        columns = {"eager": train_step(base, torch.optim.AdamW(base.parameters(), lr=1e-4), batch, False)}
        for graphs in (False,) if args.no_graphs else (False, True):
            tag = "compiled + graphs" if graphs else "compiled"
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            start = time.perf_counter()
            try:
                step = train_step(
                    compiled_copy(model, rank, graphs, not args.no_inductor),
                    torch.optim.AdamW(model.parameters(), lr=1e-4),
                    batch,
                    graphs,
                )
                step()
                step()
                common.synced(lambda: None, device)()
                row[f"{tag}: compile s"] = round(time.perf_counter() - start, 1)
                columns[tag] = step
            except Exception as exc:  # record and go on: the question is which configurations run at all
                row[f"{tag}: error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                traceback.print_exc()
        try:
            seconds = common.time_rotated(
                {tag: common.synced(fn, device) for tag, fn in columns.items()}, repeats=args.rounds, inner=args.inner
            )
            row.update({f"{tag} ms": round(1e3 * s, 2) for tag, s in seconds.items()})
        except Exception as exc:  # a configuration that compiled but fails on a later replay
            row["timing error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        rows.append(row)
        print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
