"""Runtime pieces used during training (rank-adaptive optimizer hook, kernels)."""
