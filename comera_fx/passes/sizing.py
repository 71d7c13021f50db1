"""``tensorize_``'s steps for a size target (total TT parameters) and for calibration: per-layer modes, ranks and
input statistics.

Decided for all layers together, before any TT matrix is built (the size target is global): ``plan_fits``, given
each layer's settings as ``layer_plan.plan_layers`` resolved them, returns one ``LayerFit`` per layer (format,
modes, the rank of every bond, the input second moment if the layer is calibrated) and a ``SizeTargetInfo``;
``build_fitted`` turns a fit into a ``TTMatrix``. With neither a size target nor a calibration there is no fit and
the layer's settings decide (``make_tt_matrix``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config import Allocation, Init, TensorizeConfig
from ..tt import allocate
from ..tt.decompose import matrix_to_tt, matrix_to_ttm, pad_matrix, random_tt_cores
from ..tt.layers import TTMatrix, choose_layout_modes, default_init_std
from ..tt.layout import TTFormat, TTLayout, chain_dims
from ..tt.shapes import NoBalancedModes, capped_ranks
from ..tt.whiten import regularized_gram, sqrt_factor, whitened_matrix_to_tt


class SizeTargetTooSmall(ValueError):
    """``TensorizeConfig.size_target`` is below the smallest TT (rank 1 at every bond) of the layers converted."""


@dataclass(frozen=True)
class LayerFit:
    """How one layer is built: its layout's modes, the cap of every bond, and C when it is calibrated."""

    format: TTFormat
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]
    init: Init
    gram: Tensor | None = None

    @property
    def dims(self) -> tuple[int, ...]:
        return chain_dims(self.format, self.row_modes, self.col_modes)


@dataclass
class SizeTargetInfo:
    """The size target asked (parameters), what the built layers reached, and how it was split."""

    asked: int
    allocation: str
    reached: int = 0
    max_rank: int | None = None  # the one max_rank of a uniform allocation
    dense: int = 0  # dense size of the layers it covers
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        how = f"one max_rank {self.max_rank}" if self.max_rank is not None else "ranks per layer and bond"
        return (
            f"size_target {self.asked:,} ({self.asked / self.dense:.1%} of {self.dense:,} dense): reached "
            f"{self.reached:,} with {self.allocation} allocation ({how})"
        )


def target_params(config: TensorizeConfig, dense: int) -> int:
    """The size target in parameters: ``size_target`` itself, or that fraction of ``dense``."""
    target = config.size_target
    return target if isinstance(target, int) else max(1, int(round(target * dense)))


def plan_fits(
    items, config: TensorizeConfig, calibration
) -> tuple[dict[str, LayerFit | str], SizeTargetInfo | None, dict[str, list[str]]]:
    """One ``LayerFit`` per candidate (or the reason it has no balanced modes), the size target's info, and notes.

    ``items`` are (fqn, kind, M, settings) for every layer this call converts: M the TT matrix to be (rows × cols;
    rows = input features for linear-like layers).
    """
    fits: dict[str, LayerFit | str] = {}
    notes: dict[str, list[str]] = {}
    matrices: dict[str, Tensor] = {}
    for fqn, kind, matrix, settings in items:
        notes[fqn] = []
        format = settings.format_for(kind)
        rows, cols = matrix.shape
        try:
            if settings.row_modes is None or settings.col_modes is None:
                auto = choose_layout_modes(rows, cols, format, settings.num_modes, settings.max_pad_fraction)
            row_modes = settings.row_modes if settings.row_modes is not None else auto[0]
            col_modes = settings.col_modes if settings.col_modes is not None else auto[1]
        except NoBalancedModes as exc:
            fits[fqn] = str(exc)
            continue
        gram = _gram_for(fqn, kind, format, rows, settings, calibration, notes[fqn])
        dims = chain_dims(format, row_modes, col_modes)
        caps = capped_ranks(dims, settings.max_rank, settings.rank_ratio)
        fits[fqn] = LayerFit(format, tuple(row_modes), tuple(col_modes), caps, settings.init, gram)
        matrices[fqn] = matrix
    planned = {fqn: fit for fqn, fit in fits.items() if isinstance(fit, LayerFit)}
    if config.size_target is None or not planned:
        return fits, None, notes
    dense = sum(math.prod(matrices[fqn].shape) for fqn in planned)
    info = SizeTargetInfo(target_params(config, dense), config.allocation.value, dense=dense)
    names = list(planned)
    dims_list = [planned[n].dims for n in names]
    try:
        if config.allocation is Allocation.UNIFORM:
            info.max_rank, ranks = allocate.uniform_ranks(dims_list, info.asked)
        else:
            energies = [_relative_energies(matrices[n], planned[n]) for n in names]
            ranks = allocate.allocate_ranks(dims_list, energies, info.asked)
    except allocate.BudgetTooSmall as exc:
        raise SizeTargetTooSmall(
            f"TensorizeConfig.size_target: {exc}; raise the size target or convert fewer layers"
        ) from None
    for name, r in zip(names, ranks):
        fits[name] = dataclasses.replace(planned[name], ranks=tuple(r))
    return fits, info, notes


def _gram_for(fqn, kind, format, rows, settings, calibration, notes) -> Tensor | None:
    if calibration is None or kind != "linear":
        return None
    stats = calibration.get(fqn)
    if stats is None:
        notes.append(
            "no calibration statistics for this weight (only nn.Linear / Conv1D inputs are recorded): plain TT-SVD"
        )
        return None
    if stats.in_features != rows:
        raise ValueError(
            f"the calibration of {fqn} has {stats.in_features} input features but the weight has "
            f"{rows}: calibrate this model (the same architecture) before tensorize_"
        )
    if format is not TTFormat.TT or settings.init is not Init.SVD:
        notes.append(
            f"calibration not used ({format.value} format, init {settings.init.value}): only TT-SVD layers are whitened"
        )
        return None
    notes.append(f"activation-aware TT-SVD ({stats.tokens:,} calibration tokens)")
    return stats.second_moment


def _relative_energies(matrix: Tensor, fit: LayerFit) -> list[Tensor]:
    """Each bond's squared singular values over the layer's total energy, whitened (C^{1/2}·M) when calibrated."""
    rows, cols = math.prod(fit.row_modes), math.prod(fit.col_modes)
    m = pad_matrix(matrix.detach().to(torch.float64), rows, cols)
    if fit.gram is not None:
        m = sqrt_factor(regularized_gram(fit.gram, rows)) @ m
    if fit.format is TTFormat.TT:
        chain = m.reshape(fit.dims)
    else:
        d = len(fit.row_modes)
        order = [axis for k in range(d) for axis in (k, d + k)]
        chain = m.reshape(*fit.row_modes, *fit.col_modes).permute(order).reshape(fit.dims)
    total = float((chain**2).sum()) or 1.0
    return [e / total for e in allocate.bond_energies(chain)]


def build_fitted(matrix: Tensor, kind: str, fit: LayerFit, generator: torch.Generator | None) -> TTMatrix:
    """The TTMatrix of one fit: whitened TT-SVD when calibrated, plain TT-/TTM-SVD, or random cores."""
    rows, cols = matrix.shape
    if fit.init is Init.RANDOM:
        layout = TTLayout(fit.format, rows, cols, fit.row_modes, fit.col_modes, fit.ranks)
        fan_in = cols if kind == "embedding" else rows
        cores = random_tt_cores(
            layout.core_shapes,
            default_init_std(kind, fan_in),
            dtype=matrix.dtype,
            device=matrix.device,
            generator=generator,
        )
    elif fit.gram is not None:
        cores = whitened_matrix_to_tt(matrix, fit.gram.to(matrix.device), fit.row_modes, fit.col_modes, fit.ranks)
    else:
        split = matrix_to_tt if fit.format is TTFormat.TT else matrix_to_ttm
        cores = split(matrix, fit.row_modes, fit.col_modes, fit.ranks)
    ranks = (1,) + tuple(c.shape[-1] for c in cores)
    return TTMatrix(TTLayout(fit.format, rows, cols, fit.row_modes, fit.col_modes, ranks), cores)
