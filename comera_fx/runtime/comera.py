"""CoMERA's two-stage scalarization (``CoMERAConfig``): the ℓ1 pull on the rank gates, the
late stage's achievement switch λ and the plateau detector. Pure functions on gradients and numbers; the hook in
``rank_adaptive`` calls them.

* ``add_gate_penalty_`` — adds weight · ∂R/∂g to the gates' ``.grad``; R is the mean (or sum) of |g| over the
  gate entries above the threshold.
* ``achievement_lambda`` — the late-stage switch: 1 when the size is relatively farther from its target than the
  loss, else 0. ``achievement_lambda_on_device`` is the same switch as a tensor, from the size counted on the
  device (``tt_params_at_counts``) and the loss as observed: the late stage then reads nothing back per step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..tt.inventory import ints_on
from ..tt.layout import TTLayout

EARLY, LATE = "early", "late"

# ------------------------------------------------------------------------------------------------ gradient terms


def add_gate_penalty_(
    gates: Sequence[Tensor], weight: float | Tensor, threshold: float, reduction: str = "mean"
) -> None:
    """Add weight · ∂R/∂g to each gate's ``.grad``, R = mean (or sum) of |g| over the entries above the threshold.

    Adding to ``.grad`` instead of to the loss keeps the user's loss and backward untouched. The number of entries
    above the threshold is piecewise constant, so it is treated as a constant; dead entries get no pull (they count
    as zero and pruning removes them). Everything stays on the device: no host synchronisation.
    """
    gates = [g for g in gates if g.requires_grad and g.numel() > 0]
    if torch.is_tensor(weight) and any(g.grad is None for g in gates):
        # A 0-d tensor weight (the late stage's, on the device) is used unread, except when a gate has no gradient
        # (an expert no token reached): with weight 0 it must stay without one, so the weight is read then.
        weight = float(weight)
    if not gates or (not torch.is_tensor(weight) and weight == 0):
        return
    masks = [g.detach().abs() > threshold for g in gates]
    count = None
    if reduction == "mean":
        count = torch.stack([m.sum().to(gates[0].device) for m in masks]).sum().clamp_min(1)
    for gate, mask in zip(gates, masks):
        # the scale is computed in the gate's own precision (a float weight / a tensor: reciprocal times weight)
        if torch.is_tensor(weight):
            w = weight.to(gate.device, gate.dtype)
            scale = w if count is None else count.to(gate.device, gate.dtype).reciprocal() * w
        else:
            scale = weight if count is None else weight / count.to(gate.device, gate.dtype)
        pull = torch.sign(gate.detach()) * mask * scale
        if gate.grad is None:
            gate.grad = pull
        else:
            gate.grad.add_(pull)


def scale_grads_(params: Iterable[Tensor], factor: float | Tensor) -> None:
    """Multiply every existing gradient by ``factor`` (the late stage's weight on the task loss; a 0-d tensor is
    used where it lies, never read)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor.to(p.grad.device) if torch.is_tensor(factor) else factor)


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


def achievement_lambda_on_device(
    loss: float | Tensor | None, target_loss: float | None, size: Tensor, target_size: float
) -> Tensor:
    """``achievement_lambda`` as a 0-d float64 tensor on ``size``'s device, computed there from ``size`` (a 0-d
    tensor, ``tt_params_at_counts``) and the loss (a tensor as ``observe`` keeps it, or a float): no value is read
    back to the host. Same arithmetic in float64, so the same λ."""
    size = size.to(torch.float64)
    loss_gap = size.new_zeros(())
    if loss is not None and target_loss is not None:
        loss = torch.as_tensor(loss, dtype=torch.float64).to(size.device)
        loss_gap = (loss - target_loss) / loss.abs().clamp_min(1e-12)
    size_gap = torch.where(size > 0, (size - target_size) / size, -math.inf)
    return (loss_gap < size_gap).to(torch.float64)


def tt_params_at_counts(layouts: Sequence[TTLayout], counts: Tensor) -> Tensor:
    """Cores + gates the matrices of ``layouts`` would hold at the internal ranks ``counts`` (every bond's, in
    (matrix, bond) order, ``inventory.live_count_tensor``), as a 0-d float64 tensor computed on ``counts``' device:
    ``shrink.params_at_ranks`` summed, without reading the counts back (0 for a matrix with a bond of rank 0)."""
    left, right, mids, core_owner, gate_owner = _count_indices(tuple(layouts), counts.device)
    ranks = torch.cat([counts.new_ones(1), counts]).to(torch.float64)  # index 0: the end ranks, 1
    cores = ranks[left] * mids * ranks[right]
    per_matrix = torch.zeros(len(layouts), dtype=torch.float64, device=counts.device)
    per_matrix.index_add_(0, core_owner, cores).index_add_(0, gate_owner, ranks[1:])
    zero_bonds = torch.zeros_like(per_matrix).index_add_(0, gate_owner, (counts == 0).to(torch.float64))
    return (per_matrix * (zero_bonds == 0)).sum()


@functools.lru_cache(maxsize=8)
def _count_indices(layouts: tuple[TTLayout, ...], device: torch.device) -> tuple[Tensor, ...]:
    """For ``tt_params_at_counts``, per core of every layout: the index of its left and right bond in the ranks
    (0: an end), its mode size, its matrix; per bond: its matrix. Made once per set of layouts (a prune changes
    them), sent without a stream sync."""
    left, right, mids, core_owner, gate_owner = [], [], [], [], []
    first_bond = 1  # ranks[0] is the end rank
    for j, layout in enumerate(layouts):
        shapes = layout.core_shapes
        for k, shape in enumerate(shapes):
            left.append(0 if k == 0 else first_bond + k - 1)
            right.append(0 if k == len(shapes) - 1 else first_bond + k)
            mids.append(math.prod(shape[1:-1]))
            core_owner.append(j)
        gate_owner += [j] * (len(shapes) - 1)
        first_bond += len(shapes) - 1
    indices = [ints_on(device, values) for values in (left, right, mids, core_owner, gate_owner)]
    indices[2] = indices[2].to(torch.float64)
    return tuple(indices)


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
