"""Compressing a model that is already trained: calibrate on the user's batches, tensorize at a size target,
refit layer by layer, distill against the original.

Layering: this package sits above ``runtime`` (distillation trains under ``RankAdaptive``) and ``passes`` (it
tensorizes through ``tensorize_``); nothing below imports it. Inside it, imports run down this list:

    calling.py         how a user's model is called: the output tensor to match, a block's input slot, eval mode, RNG
    batches.py         ``BatchStream``: the user's batches one at a time (an iterable restarted, or a callable)
    augment.py         ``Augmentation`` / ``augmented``: edited copies of token batches for distillation
    calibrate.py       input second moments of the layers ``tensorize_`` would convert
    refit.py           ``refit_sequential_``: each layer refit on the compressed model's own inputs
    distill_config.py  ``DistillConfig``: how a student is trained against its teacher (one config for
                       ``distill_``, ``match_teacher`` and ``compress_``), and its model-derived defaults
    student_checks.py  checks before the student changes: a budget, a fresh copy of the teacher, batches that run
    match_hooks.py     forward hooks of the training loop: hidden states to match, teacher inputs fed to blocks
    match.py           ``match_teacher``: the training loop (AdamW to the teacher's outputs, under DDP too)
    distill.py         ``distill_``: calibrate, tensorize at a target, then ``match_teacher``
    format_select.py   ``FormatChoice`` and the knapsack over candidates: the least summed error that fits a budget
    format_estimates.py  cheap per-layer error estimates of every candidate from calibration statistics
    format_output.py   a candidate's error measured at the model's output, earlier blocks replayed
    formats.py         ``choose_formats`` / ``apply_formats_``: a storage format per layer (int8, int4, TT with int8
                       or int4 cores) under one byte budget
    compress.py        ``compress_``: the whole recipe under a byte budget in one call (calibrate, choose formats,
                       build, distill with a quantization-aware tail, round, pack)
"""

from .augment import Augmentation, augmented
from .calibrate import Calibration, InputStats, calibrate
from .compress import CompressSummary, compress_
from .distill import DistillSummary, distill_
from .distill_config import DistillConfig, relative_mse
from .formats import FormatChoice, FormatPlan, FormatSummary, apply_formats_, choose_formats
from .match import match_teacher
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
    "match_teacher",
    "refit_sequential_",
    "relative_mse",
]
