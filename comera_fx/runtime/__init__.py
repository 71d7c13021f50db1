"""Runtime pieces used during training (the rank-adaptive optimizer hook; the Triton kernels live in tt/kernels/)."""

from .rank_adaptive import RankAdaptive, param_groups
from .rank_config import BudgetConfig, CoMERAConfig

__all__ = ["BudgetConfig", "CoMERAConfig", "RankAdaptive", "param_groups"]
