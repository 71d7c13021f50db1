"""Every MoE causal-LM family of the installed transformers: expert parameters and training step time, dense
against ``tensorize_`` at its defaults (experts only), and the full-rank error on the tiny test config.

Per family (``comera_fx.testing.moe_families``: the family's default config shrunk to ``--hidden`` / ``--ffn``,
2 layers, 4 experts, top-2):

* path: how the experts were converted (``contracted``: ``TTExperts`` / ``ExpertWeight`` run TT products;
  ``weight-space``: the module's own forward reads the experts rebuilt from the cores);
* full-rank rel err: ||logits - dense logits|| / ||dense logits|| at full rank, fp32, on the tiny test config;
* expert params dense -> default (``TensorizeConfig()``, its max_rank 32 and size threshold);
* step: median time of forward + backward (+ SGD step) over ``--steps`` steps after one warm-up, eager, batch
  ``--batch`` × ``--seq`` tokens, dense and converted measured alternately in the same run; ratio = TT / dense.

Run under ``flock /tmp/timing.lock`` on a shared machine:

    python benchmarks/bench_moe_families.py [--steps 5] [--hidden 256] [--ffn 256] [--families gpt_oss mixtral]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch


def step_time(model, ids, steps: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def path_of(summary) -> str:
    paths = set()
    for d in summary.layers:
        if d.kind == "experts" and d.converted:
            paths.add("weight-space" if any(n.startswith("weight-space") for n in d.notes) else "contracted")
    return "+".join(sorted(paths)) or "none"


def full_rank_error(family: str, class_name: str) -> float:
    import comera_fx
    from comera_fx.testing.moe_families import build

    model = build(family, class_name)
    dense = copy.deepcopy(model)
    comera_fx.tensorize_(
        model, comera_fx.TensorizeConfig(max_rank=10**6, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head"))
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(ids).logits, dense(ids).logits
    return float((a - b).norm() / b.norm())


def main() -> None:
    import comera_fx
    from comera_fx.testing.moe_families import build, expert_parameters, families

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--families", nargs="*", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)

    print(
        f"torch {torch.__version__}, 1 thread, hidden {args.hidden}, ffn {args.ffn}, 2 layers, 4 experts top-2, "
        f"{args.batch}x{args.seq} tokens, median of {args.steps} steps"
    )
    print(
        "| family | path | full-rank rel err | expert params dense -> default | step dense ms | step TT ms | "
        "TT / dense |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    sizes = dict(hidden_size=args.hidden, intermediate_size=args.ffn, moe_intermediate_size=args.ffn)
    for family, class_name in families():
        if args.families and family not in args.families:
            continue
        try:
            dense = build(family, class_name, **sizes).train()
        except Exception as exc:  # the family's tiny config does not build here: say so, do not hide it
            print(f"| {family} | not built: {type(exc).__name__}: {str(exc)[:60]} | | | | | |")
            continue
        model = copy.deepcopy(dense)
        summary = comera_fx.tensorize_(
            model,
            comera_fx.TensorizeConfig(),
            filter_fn=lambda m, p: any(q.dim() == 3 for q in m.parameters(recurse=False)),
        )
        ids = torch.randint(0, 64, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        t_dense = step_time(dense, ids, args.steps)
        t_tt = step_time(model, ids, args.steps)
        before, after = expert_parameters(dense), expert_parameters(model)
        print(
            f"| {family} | {path_of(summary)} | {full_rank_error(family, class_name):.1e} | "
            f"{before:,} -> {after:,} ({before / after:.1f}x) | {t_dense * 1e3:.1f} | {t_tt * 1e3:.1f} | "
            f"{t_tt / t_dense:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
