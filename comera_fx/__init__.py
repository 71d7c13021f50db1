"""comera_fx: compress the large weight matrices of any model into tensor-train form.

Public API::

    comera_fx.tensorize_(model, config, example_inputs=...)   # in place, before building the optimizer
    comera_fx.report(model)                                   # per-layer table / dict
    comera_fx.passes.tensorize(gm, config)                    # GraphModule -> GraphModule for custom compilers
"""

from . import passes
from .config import Init, LayerSettings, TensorizeConfig
from .passes.tensorize import TensorizeSummary, tensorize_
from .report import Report, report
from .tt import TTEmbedding, TTFormat, TTLinear, TTMatrix

__version__ = "0.1.0"

__all__ = [
    "Init",
    "LayerSettings",
    "Report",
    "TTEmbedding",
    "TTFormat",
    "TTLinear",
    "TTMatrix",
    "TensorizeConfig",
    "TensorizeSummary",
    "passes",
    "report",
    "tensorize_",
]
