"""Pure TT math and TT modules: no compiler knowledge (never imports passes/, runtime/ or the backend).

``kernels/`` holds the optional Triton fast paths of ``ops.take_rows`` and the gated core merge that
``TTMatrix.take_rows`` calls (registered as ``torch.library`` ops on first use, with the aten code as fallback).
"""

from .layers import TTEmbedding, TTLinear, TTMatrix, make_tt_matrix
from .layout import TTFormat, TTLayout

__all__ = ["TTEmbedding", "TTFormat", "TTLayout", "TTLinear", "TTMatrix", "make_tt_matrix"]
