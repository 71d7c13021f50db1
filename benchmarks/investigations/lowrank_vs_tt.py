"""At equal weights, is the many-mode TT or the plain low-rank product (a TT with one mode per side) the better
shape for a pretrained layer? Per encoder linear of all-MiniLM-L6-v2: the estimated relative output error
(``comera_fx.pretrained.format_estimates.LayerEstimator``, int4 cores in groups of 64, the calibration
``compress_`` makes: the README recipe's first 32 batches) of the three-mode TT at ``--ranks`` against the rank-r
product with about as many weights. Prints one line per layer and the ratio's range (issue 46; why
``choose_formats`` has the "lr" / "lr4" candidates).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/investigations/lowrank_vs_tt.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
import common  # noqa: E402

common.use_this_checkout()
cp = common.load_example("compress_pretrained")

import comera_fx  # noqa: E402
from comera_fx.pretrained import DistillConfig  # noqa: E402
from comera_fx.pretrained.format_estimates import LayerEstimator  # noqa: E402
from comera_fx.tt.shapes import capped_ranks  # noqa: E402

ENCODER_ONLY = comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ns = argparse.Namespace(**common.COMPRESS_RECIPE)
    teacher, _, _, data, _ = cp.prepare(ns)
    draw = cp.training_sampler(data, ns, seed=0)
    drawn = [draw() for _ in range(DistillConfig().calibration_batches)]
    calibration = comera_fx.calibrate(teacher, drawn, config=ENCODER_ONLY, token_mask=cp.real_tokens)
    ratios = []
    for fqn in calibration:
        module = teacher.get_submodule(fqn.removesuffix(".weight"))
        stats = calibration[fqn]
        tt, lowrank = LayerEstimator(module, stats, None), LayerEstimator(module, stats, 1)
        cells = []
        for rank in args.ranks:
            dims = list(tt.row_modes) + list(tt.col_modes)
            ranks = capped_ranks(dims, rank)
            weights = sum(ranks[k] * dims[k] * ranks[k + 1] for k in range(len(dims)))
            lr_rank = max(1, round(weights / (module.in_features + module.out_features)))
            e_tt, e_lr = tt.tt_estimate(rank, 4, 64), lowrank.tt_estimate(lr_rank, 4, 64)
            ratios.append(e_lr / e_tt)
            cells.append(f"tt r{rank} {e_tt:.4f} | lr r{lr_rank} {e_lr:.4f}")
        print(fqn.removeprefix("bert.encoder.layer."), tuple(module.weight.shape), "  ".join(cells), flush=True)
    print(
        f"low-rank error / TT error at equal weights: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
        f"max {max(ratios):.3f} over {len(ratios)} (layer, rank) pairs"
    )


if __name__ == "__main__":
    main()
