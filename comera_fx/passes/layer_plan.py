"""Decide every layer's full settings once, before anything is built: the data ``tensorize_`` builds from.

``plan_layers`` resolves each selected layer's ``LayerSettings`` (defaults, then the overrides matching its FQN)
exactly once, hands them to the size-target / calibration step (``sizing.plan_fits``) when there is one, and
returns one frozen ``LayerPlan`` per layer: its kind, orientation, settings, seed, and the fit (modes, per-bond
ranks, input statistics) where the size target or a calibration decided them. The builders read the plan only,
never the config, so data flows one way: config -> plans -> TT matrices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..config import LayerSettings, TensorizeConfig
from ..tt.layout import TTFormat
from .sizing import LayerFit, SizeTargetInfo, plan_fits


@dataclass(frozen=True)
class LayerInput:
    """What ``plan_layers`` needs of one selected layer: ``matrix`` is its TT matrix to be (rows × cols; Pᵀ when
    ``transposed``). ``index`` fixes its random-init seed (``config.seed + index``); None: its position among the
    planned layers. ``settings_fqn``: the FQN whose settings (overrides) apply, when ``fqn`` names a part of a
    parameter (one expert of a 3D expert weight: ``<fqn>.<e>``). ``modes``: (row modes, column modes) of a TT-format
    chain the layer must have whatever its settings say (the shared form of experts: the expert mode among the
    column modes)."""

    fqn: str
    kind: str
    transposed: bool
    matrix: Tensor
    index: int | None = None
    settings_fqn: str | None = None
    modes: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class LayerPlan:
    """Everything decided about one layer before it is built."""

    fqn: str
    kind: str  # "linear" (linear-like ops) or "embedding"
    transposed: bool  # M = Pᵀ (a parameter read by linear: rows of M are the input features)
    settings: LayerSettings  # the config's defaults with this layer's overrides applied
    seed: int | None  # of the generator for init="random" (None: the global RNG)
    fit: LayerFit | None = None  # modes / ranks / statistics from a size target or a calibration; None: settings

    @property
    def tt_options(self) -> dict[str, Any]:
        """The ``make_tt_matrix`` keywords of the settings (also what a later ``tensorize_`` call compares with)."""
        return self.settings.tt_options(self.kind)


@dataclass
class LayerPlans:
    """``plan_layers``'s result: the plans, the layers left out (reason), the size target's info, notes."""

    plans: dict[str, LayerPlan]
    no_modes: dict[str, str]  # fqn -> why no balanced modes exist (from the fit step)
    size_info: SizeTargetInfo | None
    notes: dict[str, list[str]]


def plan_layers(layers: Sequence[LayerInput], config: TensorizeConfig, calibration=None) -> LayerPlans:
    """One ``LayerPlan`` per layer; ``config.settings_for`` is called once per layer, here only."""
    settings = {layer.fqn: config.settings_for(layer.settings_fqn or layer.fqn) for layer in layers}
    for layer in layers:
        if layer.modes is not None:
            row_modes, col_modes = layer.modes
            settings[layer.fqn] = dataclasses.replace(
                settings[layer.fqn], linear_format=TTFormat.TT, row_modes=row_modes, col_modes=col_modes
            )
    fits: dict[str, LayerFit | str] = {}
    size_info, notes = None, {layer.fqn: [] for layer in layers}
    if config.size_target is not None or calibration is not None:
        items = [(layer.fqn, layer.kind, layer.matrix, settings[layer.fqn]) for layer in layers]
        fits, size_info, fit_notes = plan_fits(items, config, calibration)
        for fqn, found in fit_notes.items():
            notes[fqn].extend(found)
    no_modes = {fqn: fit for fqn, fit in fits.items() if isinstance(fit, str)}
    plans: dict[str, LayerPlan] = {}
    for layer in layers:
        if layer.fqn in no_modes:
            continue
        index = len(plans) if layer.index is None else layer.index
        seed = None if config.seed is None else config.seed + index
        plans[layer.fqn] = LayerPlan(
            layer.fqn, layer.kind, layer.transposed, settings[layer.fqn], seed, fits.get(layer.fqn)
        )
    return LayerPlans(plans, no_modes, size_info, notes)
