"""Per-layer report of a tensorized model: formats, modes (with padding), ranks, parameters, compression.

Data first (``Report.layers``, ``Report.to_dict()``), formatting second (``str(report)``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import nn

from .rmm.modules import RandomizedBackward
from .rmm.uses import RandomizedUses
from .tt.inventory import DEFAULT_GATE_THRESHOLD, live_counts, physical_params, tt_matrices
from .tt.layers import TTLinear, TTMatrix
from .tt.plan_cache import planned_envelope

__all__ = ["DEFAULT_GATE_THRESHOLD", "LayerRow", "RandomizedRow", "Report", "report"]  # the threshold lives in tt


@dataclass(frozen=True)
class LayerRow:
    fqn: str
    used_by: tuple[str, ...]
    format: str
    modes: str
    ranks: tuple[int, ...]
    live_ranks: tuple[int, ...]
    params: int
    dense_params: int
    plan: str | None = None  # the contraction order at the report's batch size (None: not asked, or a lookup)
    backward: str = "exact"  # "rmm rho=0.25, gaussian" when randomize_backward_ randomized a layer using it

    @property
    def compression(self) -> float:
        """Dense / TT parameters; infinite for a matrix that rank adaptation removed entirely."""
        return self.dense_params / self.params if self.params else math.inf


@dataclass(frozen=True)
class RandomizedRow:
    """A layer whose backward ``randomize_backward_`` randomized (dense or TT), or a raw parameter read by a module's
    own code (``module``: "<Class>.forward")."""

    fqn: str
    module: str
    rho: float
    sketch: str


@dataclass(frozen=True)
class Report:
    layers: tuple[LayerRow, ...]
    model_params: int
    batch: int | None = None
    randomized: tuple[RandomizedRow, ...] = ()

    @property
    def tt_params(self) -> int:
        return sum(r.params for r in self.layers)

    @property
    def dense_params(self) -> int:
        return sum(r.dense_params for r in self.layers)

    @property
    def dense_model_params(self) -> int:
        """What the model would hold with every TT layer dense again."""
        return self.model_params - self.tt_params + self.dense_params

    def to_dict(self) -> dict:
        return {
            "layers": [dict(asdict(r), compression=r.compression) for r in self.layers],
            "total": {
                "tt_params": self.tt_params,
                "dense_params": self.dense_params,
                "compression": self.dense_params / max(self.tt_params, 1),
                "model_params": self.model_params,
                "dense_model_params": self.dense_model_params,
            },
            "randomized_backward": [asdict(r) for r in self.randomized],
        }

    def __str__(self) -> str:
        header = ("layer", "format", "modes (rows | cols)", "ranks", "params", "dense", "ratio")
        rows = [
            (
                r.fqn + (f" (tied: {', '.join(r.used_by[1:])})" if len(r.used_by) > 1 else ""),
                r.format,
                r.modes,
                _ranks_text(r),
                f"{r.params:,}",
                f"{r.dense_params:,}",
                f"{r.compression:.1f}x" if r.params else "removed",
            )
            for r in self.layers
        ]
        ratio = self.dense_params / max(self.tt_params, 1)
        rows.append(("total (TT layers)", "", "", "", f"{self.tt_params:,}", f"{self.dense_params:,}", f"{ratio:.1f}x"))
        rows.append(
            (
                "whole model",
                "",
                "",
                "",
                f"{self.model_params:,}",
                f"{self.dense_model_params:,}",
                f"{self.dense_model_params / max(self.model_params, 1):.1f}x",
            )
        )
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(header, widths))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)) for row in rows]
        if not self.layers:
            lines.append("(no TT layers: run comera_fx.tensorize_(model, ...) first)")
        if self.batch is not None:
            lines.append(f"\ncontraction order at {self.batch} tokens (comera_fx.plan):")
            lines += [f"  {r.fqn}: {r.plan or 'row lookup (not planned)'}" for r in self.layers]
        if self.randomized:
            lines.append(
                "\nrandomized backward (comera_fx.randomize_backward_: weight gradients from a sketch of "
                "rho of the tokens):"
            )
            lines += [f"  {r.fqn or '<root>'} ({r.module}): rho={r.rho:g}, {r.sketch}" for r in self.randomized]
        return "\n".join(lines)


def _ranks_text(row: LayerRow) -> str:
    inner = ",".join(map(str, row.ranks[1:-1]))
    if row.live_ranks != row.ranks:
        return f"{inner} (live {','.join(map(str, row.live_ranks[1:-1]))})"
    return inner


def _randomized_bank(module: nn.Module) -> bool:
    """An expert bank (``comera_fx.moe.TTExpertBank``: a ModuleList of TT matrices) with a randomized backward;
    recognised by shape, as ``moe`` sits beside this module, not below it."""
    shared = isinstance(getattr(module, "tt", None), TTMatrix)  # a shared bank: one chain over the experts
    return (isinstance(module, nn.ModuleList) or shared) and getattr(module, "rmm", None) is not None


def _randomized(model: nn.Module) -> tuple[RandomizedRow, ...]:
    """Randomized modules by their path; raw parameters read by a module's own code by the parameter's path."""
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, RandomizedBackward) or _randomized_bank(module):
            base = module._rmm_base.__name__ if isinstance(module, RandomizedBackward) else type(module).__name__
            rows.append(RandomizedRow(name, base, module.rmm.rho, module.rmm.sketch))
        if isinstance(module, RandomizedUses):
            rows += [
                RandomizedRow(
                    f"{name}.{param}" if name else param,
                    f"{module._rmm_uses_base.__name__}.forward",
                    module.rmm.rho,
                    module.rmm.sketch,
                )
                for param in module.rmm_parameters
            ]
    return tuple(rows)


def _backward_of(model: nn.Module, tt: TTMatrix) -> str:
    for module in model.modules():
        if isinstance(module, RandomizedBackward) and getattr(module, "tt", None) is tt:
            return f"rmm {module.rmm.describe()}"
        if _randomized_bank(module) and any(m is tt for m in ([module.tt] if hasattr(module, "tt") else module)):
            return f"rmm {module.rmm.describe()}"
    return "exact"


def _product_op(model: nn.Module, tt: TTMatrix) -> str | None:
    """Which product the model runs with ``tt``: that of the first TTLinear using it, else None (lookups only)."""
    for module in model.modules():
        if isinstance(module, TTLinear) and module.tt is tt:
            return "matmul_t" if module.transposed else "matmul"
    return None


def report(model: nn.Module, *, batch: int | None = None, gate_threshold: float = DEFAULT_GATE_THRESHOLD) -> Report:
    """Report every TT matrix in ``model`` once (a tied matrix lists all modules using it), and every layer whose
    backward ``randomize_backward_`` randomized (with its ρ and sketch).

    ``live_ranks`` counts gate entries above ``gate_threshold``; ``ranks`` are the stored core sizes. With
    ``batch`` (tokens per call), each layer also shows the contraction order the planner chooses there.
    """
    matrices = tt_matrices(model)
    rows = []
    for entry, counts in zip(matrices, live_counts([m.tt for m in matrices], gate_threshold)):
        tt, layout = entry.tt, entry.tt.layout
        op = _product_op(model, tt) if batch is not None and not tt.is_zero else None
        chosen = str(planned_envelope(layout, op, device=tt.device).choose(batch)) if op is not None else None
        rows.append(
            LayerRow(
                entry.name,
                entry.used_by,
                layout.format.value,
                layout.describe_modes(),
                layout.ranks,
                (1, *counts, 1),
                physical_params(tt),
                layout.dense_params,
                chosen,
                _backward_of(model, tt),
            )
        )
    model_params = sum(p.numel() for p in model.parameters())
    return Report(tuple(rows), model_params, batch, _randomized(model))
