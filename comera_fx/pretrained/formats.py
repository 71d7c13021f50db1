"""One byte budget, a storage format per layer: ``choose_formats`` measures what each format costs each layer on
calibration data and picks the mix with the least total error that fits; ``apply_formats_`` builds it.

Layers are not equally compressible: a layer whose whitened spectrum is flat loses much to a TT of small rank but
little to int8, and one with a steep spectrum is the reverse. The candidates per large linear layer are

    int8 / int4 / int3   the dense weight on a grid (``comera_fx.quantize``), one fp32 scale per group of
                  consecutive weights, for each group size in ``group_sizes`` (a larger group: fewer bytes, a
                  coarser grid). int3 (seven levels) fills the gap between int4 (8x) and low-rank: at 3 bits a
                  weight it had less calibrated error than the low-rank candidate of the same bytes on 34 of
                  all-MiniLM-L6-v2's 36 linears (grids of 2 bits lost to it on 34; benchmarks/bench_grid_scales.py
                  --below-int4)
    tt / tt4      activation-aware TT-SVD at each rank in ``ranks`` (what ``tensorize_`` builds with the
                  calibration), its cores on the int8 / int4 grid: structure and precision multiply
    lr / lr4      the same with one mode per side: the activation-aware rank-r product (in × r)(r × out). At
                  equal bytes it often beats the many-mode TT on pretrained weights (all-MiniLM-L6-v2: 7-45 % lower
                  estimated error in every layer at every rank), and it runs as two GEMMs

and each is scored by its relative output error on the calibration inputs,
e(Ŵ) = ||X (M - M̂)||² / ||X M||² = tr((M - M̂)ᵀ C (M - M̂)) / tr(Mᵀ C M), M = Wᵀ, C = XᵀX / n. The plan minimises
the sum of e over the layers under the budget: a multiple-choice knapsack, solved greedily on each layer's lower
convex hull of (bytes, error), best error saved per byte first. The sum is a proxy for the model's output error
(it treats the layers alike); distillation afterwards (``distill_``) repairs what the proxy misjudges.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..config import TensorizeConfig
from ..tt.layers import choose_layout_modes
from ..tt.layout import TTFormat
from ..tt.shapes import capped_ranks
from ..passes.tensorize import tensorize_
from ..quantize import GRID_BITS, QuantSpec, fake_quant, quantize_, stored_bytes
from .calibrate import Calibration, InputStats, _linear_holders
from .calling import eval_modes, preserved_rng
from .format_output import OutputError
from .format_select import CORE_BITS, FIXED_MODES, FormatChoice, modes_of, select

FORMATS = ("int8", "int4", "int3", "tt", "tt4", "lr", "lr4")
DEFAULT_RANKS = (4, 8, 16, 32, 64, 96)
DEFAULT_GROUPS = (32, 64, 128, 384)


@dataclass
class FormatPlan:
    """``choose_formats``' answer: the chosen format per weight FQN, every candidate measured, the budget."""

    choices: dict[str, FormatChoice]
    candidates: dict[str, list[FormatChoice]]
    budget_bytes: int
    dense_bytes: int
    num_modes: int | None = None
    module_paths: dict[str, str] = field(default_factory=dict)  # weight FQN -> its nn.Linear's path
    scoring: str = "calibration"  # how the errors were measured: "calibration", "output" or "shortlist"
    output_passes: int = 0  # passes over the scoring batches spent measuring candidates at the output

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.choices.values())

    @property
    def total_error(self) -> float:
        return sum(c.error for c in self.choices.values())

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for choice in self.choices.values():
            found[choice.label()] = found.get(choice.label(), 0) + 1
        return found

    def __str__(self) -> str:
        lines = [
            f"FormatPlan: {len(self.choices)} layers, {self.total_bytes:,} bytes = "
            f"{self.total_bytes / self.dense_bytes:.4f} of fp32 dense (budget {self.budget_bytes:,}), "
            f"summed relative error {self.total_error:.4g} ({self.scoring} scoring, {self.output_passes} "
            f"output passes)",
            "  " + ", ".join(f"{n} x {label}" for label, n in sorted(self.counts().items())),
        ]
        for fqn, c in self.choices.items():
            lines.append(f"  {fqn:60s} {c.label():12s} {c.bytes:>10,} B  error {c.error:.3e}")
        return "\n".join(lines)


def input_importance(stats: InputStats) -> Tensor:
    """Each input feature's mean square: the weights of an int grid's scale search (``quantize_groups``)."""
    return torch.diagonal(stats.second_moment).clamp_min(0).float()


def relative_error(matrix: Tensor, approx: Tensor, gram: Tensor) -> float:
    """tr((M - M̂)ᵀ C (M - M̂)) / tr(Mᵀ C M) in float64 (M, M̂: in × out; C: in × in)."""
    m, diff = matrix.double(), (matrix - approx).double()
    c = gram.double()
    total = float((m * (c @ m)).sum())
    return float((diff * (c @ diff)).sum()) / total if total > 0 else 0.0


def check_calibration(model: nn.Module, calibration: Calibration, config: TensorizeConfig) -> list[tuple]:
    """The (module path, module, weight FQN, in features) of the layers to plan; refuses a calibration that was
    not made on this model (another model's layer names or widths) before anything is computed."""
    if not isinstance(calibration, Calibration):
        raise TypeError(
            f"calibration must be a comera_fx.Calibration (comera_fx.calibrate(model, batches)), got "
            f"{type(calibration).__name__}"
        )
    holders = [h for h in _linear_holders(model, config, None) if isinstance(h[1], nn.Linear)]
    if not holders:
        raise ValueError(
            "choose_formats found no large nn.Linear layers in the model (TensorizeConfig.min_numel / "
            "min_dim decide what is large); is it already tensorized?"
        )
    names = {fqn for _, _, fqn, _ in holders}
    foreign = sorted(set(calibration) - names)
    missing = sorted(names - set(calibration))
    if foreign or missing:
        raise ValueError(
            f"the calibration does not belong to this model: {len(missing)} of its large linears have "
            f"no statistics (e.g. {missing[:2]}) and {len(foreign)} statistics name no large linear of it "
            f"(e.g. {foreign[:2]}); run comera_fx.calibrate(model, batches) on this model, with the "
            f"same TensorizeConfig"
        )
    for _, _, fqn, d_in in holders:
        if calibration[fqn].in_features != d_in:
            raise ValueError(
                f"the calibration of {fqn} has {calibration[fqn].in_features} input features but the "
                f"layer has {d_in}: run comera_fx.calibrate(model, batches) on this model"
            )
    return holders


def _tt_candidates(
    linear: nn.Linear,
    stats: InputStats,
    rank: int,
    group_size: int,
    num_modes: int | None,
    fqn: str,
    formats: Sequence[str],
) -> list[tuple[FormatChoice, Tensor]]:
    """The TT of ``linear`` at ``rank`` as ``tensorize_`` builds it with this calibration, its cores on each grid
    of ``formats`` (``"tt"`` / ``"lr"``: int8, ``"tt4"`` / ``"lr4"``: int4; "lr" with one mode per side): (choice
    without its error, the dense M̂ it stands for)."""
    built: dict[int | None, tuple[nn.Module, list[Tensor]]] = {}  # one TT-SVD per chain shape
    found = []
    for name in (f for f in CORE_BITS if f in formats):
        modes = modes_of(name, num_modes)
        if modes not in built:
            holder = nn.Module()
            holder.lin = nn.Linear(
                linear.in_features,
                linear.out_features,
                bias=False,
                device=linear.weight.device,
                dtype=linear.weight.dtype,
            )
            holder.lin.weight.copy_(linear.weight)
            config = TensorizeConfig(max_rank=rank, num_modes=modes, min_numel=1, min_dim=1)
            tensorize_(holder, config, calibration=Calibration({"lin.weight": stats}))
            built[modes] = holder, [core.detach().clone() for core in holder.lin.tt.cores]
        holder, cores = built[modes]
        for core, value in zip(holder.lin.tt.cores, cores):
            core.copy_(value)
        quantize_(holder, CORE_BITS[name], group_size)
        found.append((FormatChoice(fqn, name, rank, stored_bytes(holder), 0.0, group_size), holder.lin.tt.dense()))
    return found


def _budget_bytes(byte_budget, dense: int) -> int:
    if isinstance(byte_budget, bool) or not isinstance(byte_budget, (int, float)) or byte_budget <= 0:
        raise ValueError(
            f"byte_budget must be a positive int (bytes) or a float in (0, 1] (a fraction of the fp32 "
            f"dense bytes), got {byte_budget!r}"
        )
    if isinstance(byte_budget, float):
        if byte_budget > 1:
            raise ValueError(f"a float byte_budget is a fraction of the fp32 dense bytes, in (0, 1]; got {byte_budget}")
        return int(byte_budget * dense)
    return byte_budget


def _tt_bytes_at_most(d_in: int, d_out: int, rank: int, num_modes: int | None, bits: int, group: int) -> int:
    """The bytes of the TT at ``rank`` with ``bits``-bit cores as ``tensorize_`` lays it out (its ranks can only
    come out lower, for a rank-deficient weight), without decomposing anything."""
    row_modes, col_modes = choose_layout_modes(d_in, d_out, TTFormat.TT, num_modes)
    dims = row_modes + col_modes
    ranks = capped_ranks(dims, rank)
    return sum(QuantSpec(bits, group).nbytes(ranks[k] * dims[k] * ranks[k + 1]) for k in range(len(dims)))


def _smallest_bytes(holders, formats, ranks, group_sizes, core_group_size, num_modes) -> int:
    """Per layer the fewest bytes any candidate could take, summed (an upper bound on the true minimum)."""
    total = 0
    for _, module, _, _ in holders:
        sizes = [
            QuantSpec(bits, g).nbytes(module.weight.numel())
            for bits in GRID_BITS
            if f"int{bits}" in formats
            for g in group_sizes
        ]
        for name in (f for f in CORE_BITS if f in formats):
            sizes.append(
                _tt_bytes_at_most(
                    module.in_features,
                    module.out_features,
                    min(ranks),
                    modes_of(name, num_modes),
                    CORE_BITS[name],
                    core_group_size,
                )
            )
        total += min(sizes)
    return total


@torch.no_grad()
def choose_formats(
    model: nn.Module,
    calibration: Calibration,
    byte_budget: int | float,
    *,
    formats: Sequence[str] = FORMATS,
    ranks: Sequence[int] = DEFAULT_RANKS,
    group_sizes: Sequence[int] = DEFAULT_GROUPS,
    core_group_size: int = 64,
    num_modes: int | None = None,
    config: TensorizeConfig | None = None,
    batches: Sequence | None = None,
    output_fn=None,
    score_all: bool = False,
    fast: bool = False,
) -> FormatPlan:
    """Choose a storage format per large ``nn.Linear`` of the dense ``model`` so that their weights fit
    ``byte_budget`` (bytes, or a float fraction of their fp32 bytes) with the least summed relative output error on
    ``calibration`` (``comera_fx.calibrate(model, batches)``). Reads the model only; ``apply_formats_`` builds it.

    ``formats``: the candidates (module docstring); ``ranks``: the TT ranks tried (``max_rank``), TT-SVD with
    ``num_modes`` modes per side; ``group_sizes``: the weights per fp32 scale tried for the dense int grids,
    ``core_group_size`` the TT cores'; ``config``: which layers are large (``min_numel`` / ``min_dim`` / ``skip``),
    as for ``calibrate``.

    ``batches`` (a few model inputs, as for ``calibrate``): score each candidate at the model's output instead, the
    relative squared change of ``output_fn(model(batch))`` (default: the output tensor or ``last_hidden_state``)
    with that layer alone replaced: it sees how much each layer's error reaches the output. Only a short-list is run
    at the output (``_shortlist``: the candidates the choice picks, each layer's other candidates rescaled by its
    measured output-to-calibration ratio, until the choice picks only measured ones); ``score_all=True`` runs every
    candidate (one pass over ``batches`` each: 9 minutes on 2 cores for all-MiniLM-L6-v2's 36 linears). The model
    is read only (its weights are swapped back; eval mode and the RNG state are restored).

    ``fast=True``: the calibration errors are estimates from one factorisation per layer
    (``comera_fx.pretrained.format_estimates``: no TT-SVD per rank, no d_in² product per int candidate), and the
    short-list's TT candidates are measured at the output as that module's stand-in (the whitened TT without the
    ALS refit ``apply_formats_`` runs, so their errors are upper estimates). What ``compress_`` uses.

    A budget below what the smallest candidates need, or a calibration of another model, is refused before any
    candidate is computed; the model's weights are never changed."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {tuple(formats)}")
    for group in (*group_sizes, core_group_size):
        QuantSpec(8, group)  # validates the group sizes
    config = config or TensorizeConfig()
    holders = check_calibration(model, calibration, config)
    dense = sum(4 * module.weight.numel() for _, module, _, _ in holders)
    budget = _budget_bytes(byte_budget, dense)
    smallest = _smallest_bytes(holders, formats, ranks, group_sizes, core_group_size, num_modes)
    if smallest > budget:
        raise ValueError(
            f"byte_budget {budget:,} bytes ({budget / dense:.4f} of the fp32 dense {dense:,}) is below "
            f"the smallest formats' total, {smallest:,} bytes ({smallest / dense:.4f}); raise the budget "
            f"or allow smaller formats (ranks={tuple(ranks)}, formats={tuple(formats)})"
        )
    with eval_modes(model), preserved_rng():
        output_error = OutputError(model, batches, output_fn) if batches else None
        if fast and not score_all:
            candidates, paths, approx = _estimate(
                holders, calibration, formats, ranks, group_sizes, core_group_size, num_modes
            )
        else:
            candidates, paths = _measure(
                model,
                holders,
                calibration,
                formats,
                ranks,
                group_sizes,
                core_group_size,
                num_modes,
                output_error if score_all else None,
            )
            approx = None
        if output_error is None or score_all:
            scoring = "output" if score_all and output_error is not None else "calibration"
            return FormatPlan(
                select(candidates, budget),
                candidates,
                budget,
                dense,
                num_modes,
                paths,
                scoring,
                output_error.passes if output_error is not None else 0,
            )
        if approx is None:
            modules = {fqn: (module, calibration[fqn]) for _, module, fqn, _ in holders}

            def approx(c: FormatChoice) -> Tensor:
                return _approx(*modules[c.fqn], c, num_modes)

        linears = {fqn: module for _, module, fqn, _ in holders}
        candidates, chosen = _shortlist(candidates, budget, linears, approx, output_error)
    return FormatPlan(chosen, candidates, budget, dense, num_modes, paths, "shortlist", output_error.passes)


def _estimate(holders, calibration, formats, ranks, group_sizes, core_group_size, num_modes):
    """``fast=True``: every candidate's bytes and estimated calibration error (``LayerEstimator``), and a function
    giving a candidate's dense stand-in (in × out) for the output short-list."""
    from .format_estimates import LayerEstimator

    candidates: dict[str, list[FormatChoice]] = {}
    paths, estimators = {}, {}
    for path, module, fqn, _ in holders:
        paths[fqn] = path
        tt_names = [f for f in CORE_BITS if f in formats]
        for modes in dict.fromkeys(modes_of(name, num_modes) for name in tt_names) or (num_modes,):
            estimators[fqn, modes] = LayerEstimator(module, calibration[fqn], modes)
        est = estimators[fqn, modes_of(tt_names[0], num_modes) if tt_names else num_modes]
        found = []
        for bits in GRID_BITS:
            for group in group_sizes if f"int{bits}" in formats else ():
                nbytes, error = est.int_candidate(bits, group)
                found.append(FormatChoice(fqn, f"int{bits}", None, nbytes, error, group))
        seen = set()
        for rank in sorted(ranks) if tt_names else ():
            for name in tt_names:
                modes = modes_of(name, num_modes)
                tt_est = estimators[fqn, modes]
                caps = (name, tt_est._caps(rank))
                if caps in seen:  # the rank was clamped to a smaller one's
                    continue
                seen.add(caps)
                error = tt_est.tt_estimate(rank, CORE_BITS[name], core_group_size)
                nbytes = _tt_bytes_at_most(
                    module.in_features, module.out_features, rank, modes, CORE_BITS[name], core_group_size
                )
                found.append(FormatChoice(fqn, name, rank, nbytes, error, core_group_size))
        candidates[fqn] = found

    def approx(c: FormatChoice) -> Tensor:
        if c.format in CORE_BITS:
            est = estimators[c.fqn, modes_of(c.format, num_modes)]
            return est.tt_approx(c.max_rank, CORE_BITS[c.format], c.group_size)
        est = next(e for (fqn, _), e in estimators.items() if fqn == c.fqn)
        return fake_quant(est.weight, int(c.format[3:]), c.group_size, est.diag).t()

    return candidates, paths, approx


def _approx(module: nn.Linear, stats: InputStats, choice: FormatChoice, num_modes: int | None) -> Tensor:
    """M̂ (in × out) of one candidate, rebuilt (a TT candidate's TT-SVD is run again)."""
    if choice.format in CORE_BITS:
        return _tt_candidates(
            module, stats, choice.max_rank, choice.group_size, num_modes, choice.fqn, (choice.format,)
        )[0][1]
    return fake_quant(module.weight.detach(), int(choice.format[3:]), choice.group_size, input_importance(stats)).t()


FAMILIES = ("int", "tt", "lr")


def _family(choice: FormatChoice) -> str:
    if choice.format not in CORE_BITS:
        return "int"
    return "lr" if choice.format in FIXED_MODES else "tt"


def _shortlist(candidates, budget, linears, approx, output_error, max_rounds: int = 4):
    """Output errors for a short-list only. Every candidate starts at its calibration error (cheap, exact for the
    layer's own output) times a factor per layer and family (int / TT / low-rank): the measured output error over the
    calibration error of that layer's measured candidates of the family (else of the layer, else the median of
    the family's over all layers). The choice on these estimates is measured at the output where it is not yet, and
    chosen again, until it picks measured candidates only (or ``max_rounds``); the last choice is returned with
    the estimates it was made on."""
    measured: dict[tuple, float] = {}

    def key(c: FormatChoice) -> tuple:
        return (c.fqn, c.format, c.max_rank, c.group_size)

    def log_ratios(found, family=None):
        return [
            math.log(measured[key(c)] / c.error)
            for c in found
            if key(c) in measured and c.error > 0 and measured[key(c)] > 0 and (family is None or _family(c) == family)
        ]

    def estimates() -> dict[str, list[FormatChoice]]:
        fallback = {}
        for family in FAMILIES:
            pooled = sorted(r for found in candidates.values() for r in log_ratios(found, family))
            fallback[family] = pooled[len(pooled) // 2] if pooled else 0.0
        out = {}
        for fqn, found in candidates.items():
            layer = log_ratios(found)
            factors = {}
            for family in FAMILIES:
                own = log_ratios(found, family)
                ratios = own or layer
                factors[family] = math.exp(sum(ratios) / len(ratios) if ratios else fallback[family])
            out[fqn] = [replace(c, error=measured.get(key(c), c.error * factors[_family(c)])) for c in found]
        return out

    for _ in range(max_rounds):
        chosen = select(estimates(), budget)
        todo = [c for c in chosen.values() if key(c) not in measured]
        if not todo:
            break
        for c in todo:
            measured[key(c)] = output_error(linears[c.fqn], approx(c).t())
    final = estimates()
    return final, select(final, budget)


def _measure(model, holders, calibration, formats, ranks, group_sizes, core_group_size, num_modes, output_error):
    """Every candidate of every layer, with its bytes and error."""
    candidates: dict[str, list[FormatChoice]] = {}
    paths = {}
    for path, module, fqn, _ in holders:
        paths[fqn] = path
        weight, stats = module.weight.detach(), calibration[fqn]

        def score(approx_in_out: Tensor) -> float:  # M̂ (in × out) against M = Wᵀ
            if output_error is not None:
                return output_error(module, approx_in_out.t())
            return relative_error(weight.t(), approx_in_out, stats.second_moment)

        found = []
        for bits in GRID_BITS:
            for group in group_sizes if f"int{bits}" in formats else ():
                approx = fake_quant(weight, bits, group, input_importance(stats))
                found.append(
                    FormatChoice(
                        fqn, f"int{bits}", None, QuantSpec(bits, group).nbytes(weight.numel()), score(approx.t()), group
                    )
                )
        seen = set()
        for rank in sorted(ranks) if any(f in formats for f in CORE_BITS) else ():
            for choice, approx in _tt_candidates(module, stats, rank, core_group_size, num_modes, fqn, formats):
                if (choice.format, choice.bytes) in seen:  # the rank was clamped to a smaller one's
                    continue
                seen.add((choice.format, choice.bytes))
                found.append(FormatChoice(fqn, choice.format, rank, choice.bytes, score(approx), core_group_size))
        candidates[fqn] = found
    return candidates, paths


@dataclass
class FormatSummary:
    """What ``apply_formats_`` built: the plan, the tensorize summary of its TT layers, bytes as stored."""

    plan: FormatPlan
    tensorize: object
    stored_bytes: int


def apply_formats_(model: nn.Module, plan: FormatPlan, calibration: Calibration) -> FormatSummary:
    """Build ``plan`` in ``model`` (the model ``choose_formats`` read) in place: its TT layers by ``tensorize_``
    with the calibration at their ranks, TT cores and int layers by ``quantize_`` (the int layers' scales searched
    with their inputs' mean squares, as ``choose_formats`` measured them). Build the optimizer after this call (the
    TT cores are new parameters)."""
    _check_plan_fits(model, plan, calibration)
    tt = {fqn: c for fqn, c in plan.choices.items() if c.format in CORE_BITS}
    summary = None
    if tt:
        overrides = {
            rf"^{re.escape(fqn)}$": {"max_rank": c.max_rank}
            | ({"num_modes": FIXED_MODES[c.format]} if c.format in FIXED_MODES else {})
            for fqn, c in tt.items()
        }
        config = TensorizeConfig(
            num_modes=plan.num_modes, min_numel=1, min_dim=1, skip=[_only(tt)], overrides=overrides
        )
        summary = tensorize_(model, config, calibration=Calibration({f: calibration[f] for f in tt}))
    for fqn, c in plan.choices.items():  # TT cores and dense int grids, each layer on its own grid
        include = _paths_regex(plan, [fqn])
        if c.format in CORE_BITS:
            quantize_(model, CORE_BITS[c.format], c.group_size, include=include)
        else:  # the scales that minimize the calibrated error, as choose_formats measured them
            weights = input_importance(calibration[fqn])
            quantize_(model, int(c.format[3:]), c.group_size, dense_linears=True, include=include, importance=weights)
    return FormatSummary(plan, summary, stored_bytes(model, only=_planned_params(model, plan)))


def _check_plan_fits(model: nn.Module, plan: FormatPlan, calibration: Calibration) -> None:
    """Refuse a plan or calibration made on another model before any weight is touched."""
    for fqn, path in plan.module_paths.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear) or f"{path}.weight".lstrip(".") != fqn:
            raise ValueError(
                f"the plan does not belong to this model: it has no nn.Linear {path!r} (or it was "
                f"converted already); run choose_formats on this model"
            )
        stats = calibration.get(fqn) if isinstance(calibration, Calibration) else None
        if stats is None or stats.in_features != module.in_features:
            raise ValueError(
                f"the calibration does not belong to this model: no statistics of {module.in_features} "
                f"input features for {fqn}; pass the calibration choose_formats was given"
            )


def _only(fqns) -> str:
    """A ``skip`` regex matching every FQN except these."""
    return "^(?!(?:" + "|".join(re.escape(f) for f in fqns) + ")$)"


def _paths_regex(plan: FormatPlan, fqns) -> str:
    return "^(?:" + "|".join(re.escape(plan.module_paths[f]) for f in fqns) + r")(?:\.|$)"


def _planned_params(model: nn.Module, plan: FormatPlan) -> dict[int, None]:
    """The parameters (by id) holding the planned layers' weights now: TT cores or the dense weight."""
    found = {}
    for path in plan.module_paths.values():
        module = model.get_submodule(path)
        for p in module.parameters():
            if p.dim() >= 2:
                found[id(p)] = None
    return found
