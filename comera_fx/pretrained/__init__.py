"""Compressing a model that is already trained: calibrate on the user's batches, tensorize at a size target,
refit layer by layer, distill against the original.

Layering: this package sits above ``runtime`` (distillation trains under ``RankAdaptive``) and ``passes`` (it
tensorizes through ``tensorize_``); nothing below imports it.

    calling.py     how a user's model is called: the output tensor to match, a block's input slot, eval mode, RNG
    calibrate.py   input second moments of the layers ``tensorize_`` would convert
    refit.py       ``refit_sequential_``: each layer refit on the compressed model's own inputs
    distill.py     ``distill_``: calibrate, tensorize at a target, then train against the teacher
"""

from .calibrate import Calibration, InputStats, calibrate
from .distill import DistillSummary, distill_
from .refit import RefitSummary, refit_sequential_

__all__ = ["Calibration", "DistillSummary", "InputStats", "RefitSummary", "calibrate", "distill_",
           "refit_sequential_"]
