"""Pure TT math and TT modules: no compiler knowledge (never imports passes/, runtime/ or the backend)."""

from .layers import TTEmbedding, TTLinear, TTMatrix, make_tt_matrix
from .layout import TTFormat, TTLayout

__all__ = ["TTEmbedding", "TTFormat", "TTLayout", "TTLinear", "TTMatrix", "make_tt_matrix"]
