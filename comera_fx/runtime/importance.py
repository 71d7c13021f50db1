"""Importance of the rank slices of the TT matrices, for the budget schedule.

Two parts, because the slices of a TT bond are not separable the way LoRA's singular triplets are: any
invertible change of basis on a bond (the gauge) leaves the matrix unchanged, so a trained bond spreads its
content over all its slices, and dropping stored slices can cost far more than the bond's redundancy suggests
(measured: on the rank-4 teacher of the tests, removing 4 of 32 stored slices of a well-fit student raised its loss
from 1.3e-3 to 0.17). So:

* **sensitivity of each bond** (this module): the smoothed Σ_i |g_k[i] · ∂L/∂g_k[i]|. Removing slice i sets
  g_k[i] to 0, which changes the loss by −g_k[i]·∂L/∂g_k[i] to first order, so this is the first-order loss
  sensitivity of the bond's slices (AdaLoRA's |θ ⊙ ∂L/∂θ|, without its uncertainty term), summed over the bond.
  Smoothing: an exponential moving average over steps, Ī ← β·Ī + (1 − β)·I, on the device from the gradients the
  optimizer is about to use (no host synchronisation); ``values()`` reads them back in one transfer.
* **importance of a whole layer** (the rank-0 decision): the smoothed |Σ_i g_k[i] · ∂L/∂g_k[i]| = |⟨W, ∂L/∂W⟩|,
  the same for every bond k: the first-order loss change of setting W to 0. Unlike a bond's sum of |·| it does not
  shrink as the bond loses directions, so a layer is not judged negligible just because it was pruned before.
* **matrices no gradient reached** (an expert of a mixture-of-experts layer that no token was routed to): a step
  whose gate gradient is missing or exactly zero leaves the averages as they were, and ``unseen`` names the
  matrices that got no such gradient since the last prune, which ``RankAdaptive`` then leaves at their ranks
  (zero importance would otherwise read as "useless" and prune the expert first).
* **share of each direction** (``slice_importance``): at a prune, the bond's singular values σ (gauge-invariant,
  ``shrink.bond_singular_values``) split the bond's sensitivity: direction i gets Ī_k · σ_i² / Σ_j σ_j². The
  budget schedule removes the least important directions by TT rounding (``shrink.round_to_ranks_``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..tt.inventory import segment_sums


class BondSensitivity:
    """Ī per internal bond (a 0-d tensor), keyed by matrix name (``tt_matrices``' names) and bond index, and the
    smoothed |⟨W, ∂L/∂W⟩| per matrix (``layer``)."""

    def __init__(self, beta: float = 0.85):
        if not (isinstance(beta, (int, float)) and 0 <= beta < 1):
            raise ValueError(f"RankAdaptive: importance_beta must be a float in [0, 1); got {beta!r}")
        self.beta = float(beta)
        self.ema: dict[str, list[Tensor]] = {}
        self.layer: dict[str, Tensor] = {}
        self.seen: dict[str, Tensor] = {}  # 0-d bool per matrix: a non-zero gate gradient since start_window()
        self.updates = 0

    def update(self, entries: Sequence[Any]) -> None:
        """Fold this step's Σ |g ⊙ ∂L/∂g| per bond into the averages (a gate without a gradient keeps its own).

        Batched over all gates (a few foreach kernels per device and dtype, not ~10 small ones per gate): on a GPU
        the per-gate version cost more than the optimizer step it rides on."""
        rows: dict[tuple[torch.device, torch.dtype], list[tuple[str, int, Tensor]]] = {}
        for entry in entries:
            if entry.tt.is_zero:
                continue
            ema = self.ema.setdefault(entry.name, [])
            for k, gate in enumerate(entry.tt._stored_gates()):
                if k == len(ema):
                    ema.append(gate.new_zeros(()).detach())
                elif ema[k].device != gate.device or ema[k].dtype != gate.dtype:  # e.g. loaded from a checkpoint
                    ema[k] = ema[k].to(gate.device, gate.dtype)
                if gate.grad is not None:
                    rows.setdefault((gate.device, gate.dtype), []).append((entry.name, k, gate))
        with torch.no_grad():
            for group in rows.values():
                self._fold(group)
        self.updates += 1

    def _fold(self, rows: list[tuple[str, int, Tensor]]) -> None:
        """``update`` for gates of one device and dtype. An all-zero gradient (zero_grad(set_to_none=False), an
        expert no token reached) is no evidence: the averages keep their value, decided on the device (no host
        sync)."""
        gates = [gate.detach() for _, _, gate in rows]
        grads = [gate.grad for _, _, gate in rows]
        terms = torch._foreach_mul(gates, grads)
        grad_norms = torch._foreach_norm(grads, 1)
        hit = torch.stack(grad_norms) != 0
        sensitivity = torch.stack(torch._foreach_norm(terms, 1))  # Σ_i |g[i] · ∂L/∂g[i]| per bond
        _masked_ema_list_([self.ema[name][k] for name, k, _ in rows], sensitivity, self.beta, hit)
        first = [i for i, (_, k, _) in enumerate(rows) if k == 0]  # one bond per matrix: |⟨W, ∂L/∂W⟩|
        if not first:
            return
        names = [rows[i][0] for i in first]
        flat = torch.cat([terms[i] for i in first])
        wide = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype  # as .sum() adds
        layer_value = segment_sums(flat, [terms[i].numel() for i in first], wide).abs().to(flat.dtype)
        layers = []
        for name in names:
            layer = self.layer.get(name)
            if layer is None or layer.device != flat.device or layer.dtype != flat.dtype:
                layer = self.layer[name] = flat.new_zeros(()) if layer is None else layer.to(flat.device, flat.dtype)
            layers.append(layer)
        first_hit = torch.stack([grad_norms[i] for i in first]) != 0  # not hit[first]: a list index is a blocking copy
        _masked_ema_list_(layers, layer_value, self.beta, first_hit)
        for name, reached in zip(names, first_hit.unbind(0)):
            seen = self.seen.get(name)
            self.seen[name] = reached.clone() if seen is None else seen.to(reached.device) | reached

    def forget(self, name: str) -> None:
        """A zeroed matrix has no bonds left."""
        self.ema.pop(name, None)
        self.layer.pop(name, None)
        self.seen.pop(name, None)

    def unseen(self, entries: Sequence[Any]) -> set[str]:
        """Names of the non-zero matrices that got no non-zero gradient since ``start_window`` (one transfer)."""
        live = [e.name for e in entries if not e.tt.is_zero]
        flags = [self.seen[n].detach().cpu() for n in live if n in self.seen]
        values = iter(torch.stack(flags).tolist() if flags else [])
        return {n for n in live if n not in self.seen or not next(values)}

    def start_window(self) -> None:
        """Forget which matrices were reached (``RankAdaptive`` calls it after each prune)."""
        self.seen.clear()

    def values(self, entries: Sequence[Any]) -> tuple[dict[str, tuple[float, ...]], dict[str, float]]:
        """(Ī of every bond, the layer importance) of every non-zero matrix as Python floats (one host transfer);
        0 before any gradient."""
        flat, keys = [], []
        for entry in entries:
            if entry.tt.is_zero:
                continue
            layer = self.layer.get(entry.name)
            flat.append(
                torch.zeros((), dtype=torch.float64) if layer is None else layer.detach().to("cpu", torch.float64)
            )
            keys.append(("layer", entry.name))
            ema = self.ema.get(entry.name, [])
            for k, gate in enumerate(entry.tt.gates):
                flat.append(
                    ema[k].detach().to("cpu", torch.float64) if k < len(ema) else torch.zeros((), dtype=torch.float64)
                )
                keys.append(("bond", entry.name))
        numbers = torch.stack(flat).tolist() if flat else []
        bonds: dict[str, list[float]] = {}
        layers: dict[str, float] = {}
        for (kind, name), value in zip(keys, numbers):
            if kind == "layer":
                layers[name] = value
            else:
                bonds.setdefault(name, []).append(value)
        return {name: tuple(v) for name, v in bonds.items()}, layers

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "updates": self.updates,
            "ema": {name: [t.detach().clone() for t in ema] for name, ema in self.ema.items()},
            "layer": {name: t.detach().clone() for name, t in self.layer.items()},
            "seen": {name: t.detach().clone() for name, t in self.seen.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]
        self.ema = {name: [t.detach().clone() for t in ema] for name, ema in state["ema"].items()}
        self.layer = {name: t.detach().clone() for name, t in state.get("layer", {}).items()}
        self.seen = {name: t.detach().clone() for name, t in state.get("seen", {}).items()}


def _masked_ema_list_(averages: list[Tensor], values: Tensor, beta: float, hit: Tensor) -> None:
    """averages[j] <- beta·averages[j] + (1 − beta)·values[j] where ``hit[j]``, unchanged elsewhere (each a 0-d
    tensor, updated in place on the device)."""
    old = torch.stack(averages)
    torch._foreach_copy_(averages, torch.where(hit, old * beta + values * (1 - beta), old).unbind(0))


def slice_importance(sensitivity: float, sigmas: Sequence[float], rank: int) -> tuple[float, ...]:
    """Importance of the ``rank`` directions of one bond: ``sensitivity`` · σ_i² / Σ σ², largest σ first; the
    directions beyond the singular values (a bond larger than its matrix needs) get 0. A bond whose σ are all 0
    splits its sensitivity evenly."""
    energy = [float(s) ** 2 for s in sigmas][:rank]
    total = sum(energy)
    shares = [e / total for e in energy] if total > 0 else [1.0 / rank] * len(energy)
    return tuple(sensitivity * share for share in shares) + (0.0,) * (rank - len(energy))
