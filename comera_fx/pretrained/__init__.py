"""Compressing a model that is already trained: calibrate on the user's batches, tensorize at a size target,
refit layer by layer, distill against the original.

Layering: this package sits above ``runtime`` (distillation trains under ``RankAdaptive``) and ``passes`` (it
tensorizes through ``tensorize_``); nothing below imports it.

    augment.py     ``Augmentation`` / ``augmented``: edited copies of token batches for distillation
    calling.py     how a user's model is called: the output tensor to match, a block's input slot, eval mode, RNG
    calibrate.py   input second moments of the layers ``tensorize_`` would convert
    refit.py       ``refit_sequential_``: each layer refit on the compressed model's own inputs
    distill.py     ``distill_``: calibrate, tensorize at a target, then train against the teacher
    formats.py     ``choose_formats`` / ``apply_formats_``: a storage format per layer (int8, int4, TT with int8
                   cores) under one byte budget, from calibration error per byte
    compress.py    ``compress_``: the whole recipe under a byte budget in one call (calibrate, choose formats, build,
                   distill with a quantization-aware tail, round, pack); ``DistillConfig`` its training settings
    quant.py       weight bytes and fake-quantization of the baselines in benchmarks/bench_distill.py
"""

from .augment import Augmentation, augmented
from .calibrate import Calibration, InputStats, calibrate
from .compress import CompressSummary, DistillConfig, compress_
from .distill import DistillSummary, distill_
from .formats import FormatChoice, FormatPlan, FormatSummary, apply_formats_, choose_formats
from .refit import RefitSummary, refit_sequential_

__all__ = [
    "Augmentation",
    "Calibration",
    "CompressSummary",
    "DistillConfig",
    "DistillSummary",
    "FormatChoice",
    "FormatPlan",
    "FormatSummary",
    "InputStats",
    "RefitSummary",
    "apply_formats_",
    "augmented",
    "calibrate",
    "choose_formats",
    "compress_",
    "distill_",
    "refit_sequential_",
]
