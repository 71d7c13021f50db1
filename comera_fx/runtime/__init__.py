"""Runtime pieces used during training (the rank-adaptive optimizer hook; the Triton kernels live in tt/kernels/)."""

from .rank_adaptive import RankAdaptive, param_groups

__all__ = ["RankAdaptive", "param_groups"]
