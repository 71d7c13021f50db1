"""Optimizer parameter groups for a tensorized model: the TT cores, the TT gates and the rest, each with its own
learning rate (CoMERA's), built before ``RankAdaptive`` is attached to the optimizer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..tt.inventory import tt_matrices


def param_groups(
    model: nn.Module,
    *,
    lr_cores: float = 1e-4,
    lr_gates: float = 1e-3,
    lr_other: float = 5e-5,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups "tt_cores", "tt_gates" and "other" with CoMERA's separate learning rates.

    Every parameter appears exactly once (a tied matrix's cores too). Empty groups are left out. The gates get no
    weight decay whatever ``weight_decay`` is: decay would be a second, unscheduled rank penalty next to the one
    ``RankAdaptive`` controls.
    """
    matrices = tt_matrices(model)
    cores = [p for m in matrices for p in m.tt.cores]
    gates = [p for m in matrices for p in m.tt.gates]
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken]
    groups = [
        {"name": "tt_cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "tt_gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "other", "params": other, "lr": lr_other, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]
