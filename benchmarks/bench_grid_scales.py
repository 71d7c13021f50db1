"""Issue 46: what searching each int group's scale buys on all-MiniLM-L6-v2, before any training.

For every encoder linear of the README recipe's teacher (calibrated as ``compress_`` calibrates it: the recipe's
first 32 batches, padding masked) and each grid, the relative calibrated error tr(Eᵀ C E) / tr(Mᵀ C M) (float64,
``formats.relative_error``) of the grid with max|w| / qmax scales and of the grid whose scales
``quantize_groups(..., importance=diag C)`` searched; one JSON line per grid with the sums over the 36 layers, their
ratio and the search's time, and per layer with ``--per-layer``.

    flock /tmp/timing.lock env OMP_NUM_THREADS=2 python benchmarks/bench_grid_scales.py

``--below-int4`` asks instead whether grids coarser than int4 would be worth adding as formats for the 16x budget
(2 bits a weight): for each layer, ternary, 2-bit (four levels ±0.5, ±1.5) and 3-bit (seven levels) grids in groups,
each group's scale searched over the same ratios as ``quantize_groups`` with the calibrated importance, against the
low-rank candidate ``choose_formats`` would build in the same bytes (``lr4``: whitened rank-r product with int4 cores
in groups of 64, the largest rank that fits, ``LayerEstimator.tt_estimate``). One JSON line per grid: the errors'
sums over the 36 layers and on how many layers the grid beats low-rank.

    flock /tmp/timing.lock env OMP_NUM_THREADS=2 python benchmarks/bench_grid_scales.py --below-int4
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
from comera_fx.pretrained.format_estimates import LayerEstimator  # noqa: E402
from comera_fx.pretrained.format_select import modes_of  # noqa: E402
from comera_fx.pretrained.formats import _tt_bytes_at_most  # noqa: E402
from comera_fx.quantize import CLIP_RATIOS, fake_quant, quantized_bytes  # noqa: E402

ENCODER_ONLY = comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"])
GRIDS = ((4, 64), (4, 128), (4, None), (8, 64), (8, None))  # None: one scale per output row (the layer's width)


#: grids below int4 (``--below-int4``): name -> (bits a weight as stored, levels in units of the scale, group size)
COARSE_GRIDS = {
    "ternary g64": (2, (-1.0, 0.0, 1.0), 64),
    "int2 g64": (2, (-1.5, -0.5, 0.5, 1.5), 64),
    "int2 g128": (2, (-1.5, -0.5, 0.5, 1.5), 128),
    "int3 g64": (3, tuple(float(v) for v in range(-3, 4)), 64),
}


def on_levels(weight: torch.Tensor, levels: tuple[float, ...], group: int, importance: torch.Tensor) -> torch.Tensor:
    """``weight`` (out × in) rounded to the nearest of ``levels`` · s, one s per ``group`` consecutive inputs of a
    row, searched over ``CLIP_RATIOS`` · max|w| / max|level| for the least importance-weighted squared error (what
    ``quantize_groups`` does for int grids)."""
    grid = torch.tensor(levels, dtype=torch.float64)
    groups = weight.double().reshape(weight.shape[0], -1, group)
    weights = importance.double().reshape(1, -1, group).expand_as(groups)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    best, best_error = None, None
    for ratio in CLIP_RATIOS:
        scale = amax * ratio / grid.abs().max()
        rounded = grid[(groups.unsqueeze(-1) / scale.unsqueeze(-1) - grid).abs().argmin(-1)] * scale
        error = ((rounded - groups).square() * weights).sum(-1, keepdim=True)
        if best is None:
            best, best_error = rounded, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, rounded, best), torch.where(better, error, best_error)
    return best.reshape(weight.shape).to(weight.dtype)


def low_rank_in(module, estimator: LayerEstimator, nbytes: int) -> tuple[int, float]:
    """(rank, calibrated error) of the largest-rank ``lr4`` candidate within ``nbytes``."""
    modes = modes_of("lr4", None)
    rank = 1
    while _tt_bytes_at_most(module.in_features, module.out_features, rank + 1, modes, 4, 64) <= nbytes:
        rank += 1
    return rank, estimator.tt_estimate(rank, 4, 64)


def below_int4(teacher, calibration, linears: dict, per_layer: bool) -> None:
    estimators = {fqn: LayerEstimator(m, calibration[fqn], modes_of("lr4", None)) for fqn, m in linears.items()}
    for name, (bits, levels, group) in COARSE_GRIDS.items():
        sums, wins, rows = [0.0, 0.0], 0, []
        for fqn, module in linears.items():
            weight, gram = module.weight.detach(), calibration[fqn].second_moment.double()
            grid_error = relative_error(weight.t(), on_levels(weight, levels, group, torch.diagonal(gram)).t(), gram)
            nbytes = quantized_bytes(weight.numel(), bits, group)
            rank, lr_error = low_rank_in(module, estimators[fqn], nbytes)
            sums[0] += grid_error
            sums[1] += lr_error
            wins += grid_error < lr_error
            rows.append({"layer": fqn, "grid": grid_error, "lr4_rank": rank, "lr4": lr_error})
        print(
            json.dumps(
                {
                    "grid": name,
                    "bits_a_weight": bits,
                    "layers": len(linears),
                    "error_grid": round(sums[0], 4),
                    "error_lr4_same_bytes": round(sums[1], 4),
                    "layers_where_grid_wins": wins,
                    "load": common.loadavg(),
                }
            ),
            flush=True,
        )
        if per_layer:
            for row in rows:
                print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-layer", action="store_true")
    parser.add_argument("--below-int4", action="store_true", help="2- and 3-bit grids against low-rank, same bytes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    teacher, _, _, data, _ = cp.prepare(argparse.Namespace(**common.COMPRESS_RECIPE))
    draw = cp.training_sampler(data, argparse.Namespace(**common.COMPRESS_RECIPE), seed=0)
    drawn = [draw() for _ in range(DistillConfig().calibration_batches)]
    calibration = comera_fx.calibrate(teacher, drawn, config=ENCODER_ONLY, token_mask=cp.real_tokens)
    linears = {f"{path}.weight": m for path, m in teacher.named_modules() if f"{path}.weight" in calibration}
    if args.below_int4:
        below_int4(teacher, calibration, linears, args.per_layer)
        return
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
