"""Per MoE family: does ``RankAdaptive`` train and shrink the converted experts, and does one compiled training
step (``aot_eager``) equal eager? The figures behind ``tests/test_moe_families.py``'s per-family checks.

Tiny random-init configs (``comera_fx.testing.moe_families``). ``train``: experts and everything else at
max_rank 8 (embeddings and head dense), Adam 3e-3, ``BudgetConfig(keep_fraction=0.5, total_steps=8, prunes=2)``, 8
steps on 4×16 tokens; reported: expert banks, expert TT parameters before -> after, loss first -> last.
``compile``: full rank capped at 6; one step eager and one compiled (a deep copy); reported: relative loss
difference, the largest relative gradient difference over every parameter (a parameter with no gradient on one
side must have none or zeros on the other), and the seconds (tracing dominates). No timing figure is compared
between runs: no lock needed. One JSON line per family is appended to ``--out``.

    python benchmarks/bench_moe_families_training.py train [--families mixtral gpt_oss] [--out FILE]
    python benchmarks/bench_moe_families_training.py compile --families llama4 jetmoe
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch


def train(build, config_cls, comera_fx) -> dict:
    from comera_fx.testing.moe_families import train_with_rank_adaptive

    model = build().train()
    comera_fx.tensorize_(model, config_cls(max_rank=8, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head")))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    run = train_with_rank_adaptive(model, ids)
    losses = run.pop("losses")
    ok = bool(run["banks"]) and losses[-1] < losses[0] and run["after"] < run["before"]
    return dict(run, first=losses[0], last=losses[-1], ok=ok)


def compiled(build, config_cls, comera_fx) -> dict:
    from comera_fx.testing.moe_families import compiled_step_differences

    model = build().train()
    comera_fx.tensorize_(model, config_cls(max_rank=6, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head")))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    found = compiled_step_differences(model, ids)
    d_loss = abs(float(found["compiled"]) - float(found["eager"])) / abs(float(found["eager"]))
    ok = d_loss < 1e-5 and found["worst_grad"] < 1e-4 and not found["mismatched"]
    return dict(d_loss=d_loss, worst_grad=found["worst_grad"], none_vs_nonzero=found["mismatched"][:3], ok=ok)


def main() -> None:
    import comera_fx
    from comera_fx import TensorizeConfig
    from comera_fx.testing.moe_families import build, families

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_moe_families import UNBUILT

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["train", "compile"])
    parser.add_argument("--families", nargs="*", default=None, help="default: every family that builds")
    parser.add_argument("--out", default="moe_families_training.jsonl")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    table = dict(families())
    names = args.families or sorted(set(table) - set(UNBUILT))
    check = train if args.check == "train" else compiled
    with open(args.out, "a") as out:
        for family in names:
            start = time.perf_counter()
            try:
                row = check(lambda: build(family, table[family]), TensorizeConfig, comera_fx)
            except Exception as exc:  # reported, not hidden: the next family still runs
                row = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            row.update(family=family, check=args.check, seconds=round(time.perf_counter() - start, 1))
            torch._dynamo.reset()
            print(json.dumps(row), file=out, flush=True)
            print(family, "ok" if row["ok"] else "FAILED", row["seconds"], "s", flush=True)


if __name__ == "__main__":
    main()
