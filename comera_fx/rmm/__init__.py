"""Randomized backward (RMM) for large linear layers: exact forward, weight gradients from a sketch of the input.

Model level: ``comera_fx.randomize_backward_`` / ``comera_fx.restore_backward_``; graph level:
``comera_fx.passes.randomize_backward``; in the compiler: ``BackendConfig(rmm=RMMConfig(...))``. The ops here are
what those call: ``rmm_linear`` (dense), ``rmm_tt_product`` (a TTMatrix), ``sketch_rows`` (the sketch); module
classes: ``RandomizedBackward`` (nn.Linear, Conv1D, TTLinear), ``RandomizedUses`` (a module whose own forward reads
raw parameters with F.linear / addmm / matmul).
"""

from .functions import rmm_linear, rmm_tt_product, shared_sketch
from .modules import RandomizedBackward, RMMConfig, randomized_class, supported_kind
from .sketch import SKETCHES, projected_rows, sketch_matrix, sketch_rows
from .uses import RandomizedUses

__all__ = [
    "RMMConfig",
    "RandomizedBackward",
    "RandomizedUses",
    "SKETCHES",
    "projected_rows",
    "randomized_class",
    "rmm_linear",
    "rmm_tt_product",
    "shared_sketch",
    "sketch_matrix",
    "sketch_rows",
    "supported_kind",
]
