"""Issue 46: what searching each int group's scale buys on all-MiniLM-L6-v2, before any training.

For every encoder linear of the README recipe's teacher (calibrated as ``compress_`` calibrates it: the recipe's
first 32 batches, padding masked) and each grid, the relative calibrated error tr(Eᵀ C E) / tr(Mᵀ C M) (float64,
``formats.relative_error``) of the grid with max|w| / qmax scales and of the grid whose scales
``quantize_groups(..., importance=diag C)`` searched; one JSON line per grid with the sums over the 36 layers, their
ratio and the search's time, and per layer with ``--per-layer``.

    flock /tmp/timing.lock env OMP_NUM_THREADS=2 python benchmarks/bench_grid_scales.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.use_this_checkout()
cp = common.load_example("compress_pretrained")

import comera_fx  # noqa: E402
from comera_fx.pretrained import DistillConfig  # noqa: E402
from comera_fx.pretrained.formats import relative_error  # noqa: E402
from comera_fx.quantize import fake_quant  # noqa: E402

ENCODER_ONLY = comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"])
GRIDS = ((4, 64), (4, 128), (4, None), (8, 64), (8, None))  # None: one scale per output row (the layer's width)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-layer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    teacher, _, _, data, _ = cp.prepare(argparse.Namespace(**common.COMPRESS_RECIPE))
    draw = cp.training_sampler(data, argparse.Namespace(**common.COMPRESS_RECIPE), seed=0)
    drawn = [draw() for _ in range(DistillConfig().calibration_batches)]
    calibration = comera_fx.calibrate(teacher, drawn, config=ENCODER_ONLY, token_mask=cp.real_tokens)
    linears = {f"{path}.weight": m for path, m in teacher.named_modules() if f"{path}.weight" in calibration}
    for bits, group in GRIDS:
        sums, search_seconds, rows = [0.0, 0.0], 0.0, []
        for fqn, module in linears.items():
            weight, gram = module.weight.detach(), calibration[fqn].second_moment.double()
            size = group or weight.shape[1]
            plain = relative_error(weight.t(), fake_quant(weight, bits, size).t(), gram)
            t0 = time.perf_counter()
            searched_grid = fake_quant(weight, bits, size, torch.diagonal(gram).float())
            search_seconds += time.perf_counter() - t0
            searched = relative_error(weight.t(), searched_grid.t(), gram)
            sums[0] += plain
            sums[1] += searched
            rows.append({"layer": fqn, "max_scales": plain, "searched": searched})
        print(
            json.dumps(
                {
                    "grid": f"int{bits} g{group}" if group else f"int{bits} per output row",
                    "layers": len(linears),
                    "error_max_scales": round(sums[0], 5),
                    "error_searched": round(sums[1], 5),
                    "searched_over_max": round(sums[1] / sums[0], 3),
                    "search_seconds": round(search_seconds, 2),
                    "load": common.loadavg(),
                }
            ),
            flush=True,
        )
        if args.per_layer:
            for row in rows:
                print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
