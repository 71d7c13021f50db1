"""CoMERA's two-stage scalarization (``CoMERAConfig``): the ℓ1 pull on the rank gates, the
late stage's achievement switch λ and the plateau detector. Pure functions on gradients and numbers; the hook in
``rank_adaptive`` calls them.

* ``add_gate_penalty_`` — adds weight · ∂R/∂g to the gates' ``.grad``; R is the mean (or sum) of |g| over the
  gate entries above the threshold.
* ``achievement_lambda`` — the late-stage switch: 1 when the size is relatively farther from its target than the
  loss, else 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

EARLY, LATE = "early", "late"

# ------------------------------------------------------------------------------------------------ gradient terms


def add_gate_penalty_(gates: Sequence[Tensor], weight: float, threshold: float, reduction: str = "mean") -> None:
    """Add weight · ∂R/∂g to each gate's ``.grad``, R = mean (or sum) of |g| over the entries above the threshold.

    Adding to ``.grad`` instead of to the loss keeps the user's loss and backward untouched. The number of entries
    above the threshold is piecewise constant, so it is treated as a constant; dead entries get no pull (they count
    as zero and pruning removes them). Everything stays on the device: no host synchronisation.
    """
    gates = [g for g in gates if g.requires_grad and g.numel() > 0]
    if not gates or weight == 0:
        return
    masks = [g.detach().abs() > threshold for g in gates]
    count = None
    if reduction == "mean":
        count = torch.stack([m.sum().to(gates[0].device) for m in masks]).sum().clamp_min(1)
    for gate, mask in zip(gates, masks):
        # weight stays a Python float so the scale is computed in the gate's own precision
        scale = weight if count is None else weight / count.to(gate.device, gate.dtype)
        pull = torch.sign(gate.detach()) * mask * scale
        if gate.grad is None:
            gate.grad = pull
        else:
            gate.grad.add_(pull)


def scale_grads_(params: Iterable[Tensor], factor: float) -> None:
    """Multiply every existing gradient by ``factor`` (the late stage's weight on the task loss)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def achievement_lambda(loss: float | None, target_loss: float | None, size: int, target_size: float) -> float:
    """CoMERA's λ = [(L − L_t)/L < (S − S_t)/S]: 1 pushes the size, 0 the loss — whichever is relatively farther
    from its target.

    Without a target loss (or an observed loss) the loss counts as on target (gap 0), so the size is pushed until
    it reaches S_t and the task loss gets the gradient afterwards. |L| is the denominator so negative losses work.
    """
    loss_gap = 0.0
    if loss is not None and target_loss is not None:
        loss_gap = (loss - target_loss) / max(abs(loss), 1e-12)
    size_gap = (size - target_size) / size if size > 0 else -math.inf
    return 1.0 if loss_gap < size_gap else 0.0


# ------------------------------------------------------------------------------------------------- stage switch


@dataclass
class PlateauDetector:
    """Says when the loss stopped improving: no new best (by a relative margin ``tol``) for ``patience`` steps.
    Compares against the best loss so far, which tolerates per-batch noise better than step-to-step changes."""

    patience: int
    tol: float
    best: float = math.inf
    since: int = 0

    def update(self, loss: float) -> bool:
        if self.best == math.inf or loss < self.best - self.tol * abs(self.best):
            self.best, self.since = loss, 0
        else:
            self.since += 1
        return self.since >= self.patience
