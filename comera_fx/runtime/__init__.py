"""Runtime pieces used during training (rank-adaptive optimizer hook, kernels)."""

from .rank_adaptive import RankAdaptive, param_groups

__all__ = ["RankAdaptive", "param_groups"]
