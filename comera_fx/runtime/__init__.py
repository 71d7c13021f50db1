"""Runtime pieces used during training (the rank-adaptive optimizer hook; the Triton kernels live in tt/kernels/)."""

from .groups import param_groups
from .rank_adaptive import RankAdaptive
from .rank_config import BudgetConfig, CoMERAConfig

__all__ = ["BudgetConfig", "CoMERAConfig", "RankAdaptive", "param_groups"]
