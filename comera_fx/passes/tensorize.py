"""Rewrite large linear-like and embedding ops into TT form.

Two entry points, one decision procedure:

* ``tensorize_(model, config)`` — in place, before the optimizer is built (torchao/PEFT style): parameters must
  exist before compilation so the optimizer, ``state_dict``, DDP and ``.to()`` see them. Modules whose forward is
  known (``nn.Linear``, ``nn.Embedding``, transformers' ``Conv1D``) are swapped for ``TTLinear`` / ``TTEmbedding``;
  any other holder of a converted parameter reads a reconstructed dense weight through a property, so eager code
  stays correct. A tied parameter becomes one ``TTMatrix`` shared by all of its users.
* ``tensorize(gm, config)`` (``passes.tensorize_graph``) — a ``GraphModule -> GraphModule`` pass for custom
  compilers: registers the cores and gates on the GraphModule and replaces each op by the explicit TT contraction
  subgraph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..checks import check_config_type
from ..config import Init, TensorizeConfig, warn_renamed
from .experts import ExpertStep
from ..tt.inventory import is_hf_conv1d
from ..tt.layers import TTEmbedding, TTLinear, TTMatrix, make_tt_matrix
from ..tt.shapes import NoBalancedModes
from .layer_plan import LayerInput, LayerPlan, plan_layers
from .sizing import SizeTargetInfo, build_fitted
from .find import Candidate, FindResult, UseKind, find_in_model
from .holders import Journal, attach_tt_property, hook_problem, move_hooks

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class LayerDecision:
    """What happened to one candidate parameter, and why."""

    fqn: str
    aliases: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]
    uses: tuple[str, ...]
    converted: bool = False
    reason: str | None = None  # why it was skipped
    notes: list[str] = field(default_factory=list)
    ranks: tuple[int, ...] = ()
    params: int = 0

    @property
    def dense_params(self) -> int:
        return math.prod(self.shape)


@dataclass
class TensorizeSummary:
    """Returned by ``tensorize_``: every candidate with its decision, and how the model was read."""

    layers: list[LayerDecision]
    method: str
    fallback_reason: str | None = None
    size_target: SizeTargetInfo | None = None  # asked, reached, allocation (None without a size target)

    @property
    def budget(self) -> SizeTargetInfo | None:
        """Deprecated spelling of ``size_target``."""
        warn_renamed("TensorizeSummary.budget", "TensorizeSummary.size_target")
        return self.size_target

    @property
    def ranks(self) -> dict[str, tuple[int, ...]]:
        """Bond ranks of every layer converted by this call, by parameter FQN."""
        return {d.fqn: d.ranks for d in self.converted}

    @property
    def converted(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.converted]

    @property
    def skipped(self) -> list[LayerDecision]:
        return [d for d in self.layers if not d.converted]

    def __str__(self) -> str:
        lines = [
            f"comera_fx.tensorize_: {len(self.converted)} of {len(self.layers)} candidate parameters converted "
            f"(found by {self.method}{'; ' + self.fallback_reason if self.fallback_reason else ''})"
        ]
        if self.size_target is not None:
            lines.append(f"  {self.size_target}")
        for d in self.layers:
            uses = ", ".join(d.uses)
            if d.converted:
                lines.append(
                    f"  converted {d.fqn} {d.shape} [{uses}]: ranks {d.ranks}, "
                    f"{d.dense_params:,} -> {d.params:,} params ({d.dense_params / d.params:.1f}x)"
                )
            else:
                lines.append(f"  skipped   {d.fqn} {d.shape} [{uses}]: {d.reason}")
            lines.extend(f"            note: {n}" for n in d.notes)
        if not self.converted:
            lines.append("  nothing converted: the model is unchanged")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- decisions


def skip_reason(cand: Candidate, config: TensorizeConfig) -> str | None:
    """Why a candidate must stay dense (independent of the model's modules), or None."""
    if not cand.dtype.is_floating_point:
        return f"weight dtype {cand.dtype} is not floating point; only float weights can be tensorized"
    if cand.unsupported_uses and not config.weight_space:
        ops_used = sorted({u.target for u in cand.unsupported_uses})
        return (
            f"also used by {ops_used}, which comera_fx cannot contract in TT form "
            f"(TensorizeConfig(weight_space=True) holds it in TT form and rebuilds it for those reads)"
        )
    if not config.is_large(cand.shape):
        return (
            f"below the size threshold (needs >= {config.min_numel} elements and both dims >= "
            f"{config.min_dim}; set TensorizeConfig.min_numel / min_dim to include it)"
        )
    if any(config.is_skipped(name) for name in cand.aliases):
        return "excluded by TensorizeConfig.skip / overrides"
    return None


def stores_transpose(cand: Candidate) -> bool:
    """True when the TT matrix M is Pᵀ (P read by ``linear``: rows of M are then the input features)."""
    return cand.kind == "linear" and any(u.kind is UseKind.LINEAR for u in cand.uses)


def build_tt(param: Tensor, plan: LayerPlan) -> tuple[TTMatrix, list[str]]:
    """The TTMatrix of one layer's plan plus notes for the summary (clamped ranks, padding). Reads the plan only.

    ``plan.fit`` (a size target or a calibration, ``passes/sizing.py``) fixes the modes, every bond's rank and the
    input statistics; without it the layer settings decide (``make_tt_matrix``).

    The cores and gates get the parameter's dtype, device and ``requires_grad`` (a frozen weight stays frozen).
    """
    settings, options = plan.settings, plan.tt_options
    matrix = param.detach().t() if plan.transposed else param.detach()
    if settings.init is Init.SVD and not bool(torch.isfinite(matrix).all()):
        bad = int((~torch.isfinite(matrix)).sum())
        raise ValueError(
            f"the weight holds {bad} NaN/Inf entries and TT-SVD needs finite values; fix the weights, "
            f"or leave the layer dense (TensorizeConfig.skip)"
        )
    generator = None
    if plan.seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(plan.seed)
    if plan.fit is None:
        tt = make_tt_matrix(matrix, kind=plan.kind, generator=generator, **options)
    else:
        tt = build_fitted(matrix, plan.kind, plan.fit, generator)
    tt.to(device=param.device, dtype=param.dtype).requires_grad_(param.requires_grad)
    tt.made_with = (plan.kind, options)  # what a later tensorize_ call compares against
    notes = []
    full = max(tt.full_ranks)
    if plan.fit is None and settings.max_rank is not None and settings.max_rank > full:
        notes.append(
            f"max_rank {settings.max_rank} exceeds this layer's largest feasible rank {full}; "
            f"clamped to the full ranks {tt.full_ranks}"
        )
    layout = tt.layout
    if layout.padded_rows != layout.rows or layout.padded_cols != layout.cols:
        notes.append(f"padded: {layout.describe_modes()} (padding is sliced away)")
    return tt, notes


def no_modes_reason(exc) -> str:
    return (
        f"no balanced factorisation ({exc}); raise TensorizeConfig.max_pad_fraction, or give "
        f"this layer row_modes / col_modes or num_modes through overrides"
    )


def build_or_skip(param: Tensor, cand: Candidate, decision: LayerDecision, plan: LayerPlan):
    """``build_tt``, or None with ``decision.reason`` set for a size without balanced modes; errors name the layer."""
    try:
        return build_tt(param, plan)
    except NoBalancedModes as exc:
        decision.reason = no_modes_reason(exc)
        return None
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"cannot tensorize {cand.fqn} {cand.shape}: {exc}") from exc
    except Exception as exc:  # e.g. torch.linalg.LinAlgError: the message must still name the layer
        raise RuntimeError(f"cannot tensorize {cand.fqn} {cand.shape}: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------- model-level rewrite


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str, str]:
    module_path, _, attr = fqn.rpartition(".")
    return model.get_submodule(module_path), module_path, attr


def _is_plain(module: nn.Module, base: type[nn.Module]) -> bool:
    """An instance of ``base`` (or a subclass) whose forward is ``base.forward`` — safe to swap."""
    return isinstance(module, base) and type(module).forward is base.forward


def _swap_kind(module: nn.Module, attr: str, kind: str, transposed_m: bool) -> str | None:
    """Which TT module replaces ``module`` ("embedding", "linear", "conv1d"), or None: a property is attached."""
    if attr != "weight":
        return None
    if _is_plain(module, nn.Embedding):
        return "embedding"
    if _is_plain(module, nn.Linear):
        return "linear"
    if is_hf_conv1d(module) and not transposed_m and kind == "linear":
        return "conv1d"
    return None


def _holder_problem(module: nn.Module, attr: str, cand: Candidate) -> str | None:
    if attr == "weight" and isinstance(module, nn.Embedding):
        if problem := TTEmbedding.check_supported(module):
            return problem
    if _swap_kind(module, attr, cand.kind, stores_transpose(cand)) is not None:
        return hook_problem(module)
    return None


def tensorize_(
    model: nn.Module,
    config: TensorizeConfig | None = None,
    *,
    example_inputs=None,
    filter_fn: FilterFn | None = None,
    calibration=None,
) -> TensorizeSummary:
    """Convert a model's large linear-like and embedding weights to TT form, in place.

    Args:
        model: any ``nn.Module``; build the optimizer afterwards (the cores are new parameters).
        config: a ``TensorizeConfig`` (default: max_rank 32, TT-SVD of the current weights).
        example_inputs: a tensor, tuple of positional inputs or dict of keyword inputs. With them the model is
            captured with Dynamo, which finds functional uses (``F.linear`` on raw parameters, ``addmm``) and tied
            weights; without them only module types are scanned (the summary says so). The capture leaves
            buffers, the RNG state and Dynamo's caches as they were.
        filter_fn: ``filter_fn(module, module_fqn) -> bool``; a parameter is converted only if it accepts every
            module holding it.
        calibration: a ``comera_fx.calibrate(model, batches)`` result. Linear-like weights it has statistics for
            are decomposed activation-aware (``comera_fx.tt.whiten``: small ||X(W - Ŵ)ᵀ|| on such inputs rather
            than small ||W - Ŵ||), and an energy allocation weighs their bonds by it. Embeddings are unaffected.

    Mixture-of-experts weights are converted too, each expert its own TT matrix (``comera_fx.moe``,
    docs/moe.md): transformers experts modules are swapped for ``TTExperts``; a raw 3D parameter read through
    ``bmm`` or per-expert slices is found only with ``example_inputs``. A size target counts and sizes every
    expert's matrix with the other layers.

    Cores and gates take the dtype, device and ``requires_grad`` of the weight they replace; a swapped module's
    bias (the same parameter) and forward / backward hooks move to its TT twin. TT layers made by an earlier call
    are listed as skipped; a config asking for other settings for them raises ``ValueError``. Returns a
    ``TensorizeSummary``. Nothing is modified if anything fails: errors are raised before the first change, and
    a failure while swapping modules restores every module it touched.
    """
    check_config_type("tensorize_(model, config)", config, TensorizeConfig, "TensorizeConfig(max_rank=32)")
    config = config or TensorizeConfig()
    result: FindResult = find_in_model(model, example_inputs)
    earlier = _earlier_tt_layers(model, config, filter_fn)
    experts = ExpertStep(model, config, filter_fn, example_inputs, _expert_decision, calibration)  # MoE experts
    experts.add_missed(result)  # and expert-list linears the captured graphs did not record
    decisions, plans = [], []
    for cand in result.candidates:
        decision = LayerDecision(
            cand.fqn, cand.aliases, cand.kind, cand.shape, tuple(sorted({u.kind.value for u in cand.uses}))
        )
        decisions.append(decision)
        decision.reason = skip_reason(cand, config)
        holders = [_owner(model, alias) for alias in cand.aliases]
        if decision.reason is None and filter_fn is not None:
            rejected = [path or "<root>" for module, path, _ in holders if not filter_fn(module, path)]
            if rejected:
                decision.reason = f"filter_fn rejected {rejected}"
        if decision.reason is None:
            problems = [p for module, _, attr in holders if (p := _holder_problem(module, attr, cand))]
            decision.reason = problems[0] if problems else None
        if decision.reason is None:
            if any(
                not path and _swap_kind(module, attr, cand.kind, stores_transpose(cand))
                for module, path, attr in holders
            ):
                raise ValueError("tensorize_ cannot replace the root module itself; wrap it in a parent module")
            plans.append((cand, decision, holders))

    # Every layer's settings, modes and ranks decided once, together (a size target is global).
    params = dict(model.named_parameters())
    if calibration is not None and config.rel_tol is not None:
        raise ValueError(
            "tensorize_ with a calibration needs TensorizeConfig.rel_tol=None (the whitened "
            "TT-SVD truncates to ranks, not to a tolerance)"
        )
    layers = [
        LayerInput(cand.fqn, cand.kind, stores_transpose(cand), _tt_matrix_of(params[cand.fqn], cand))
        for cand, _, _ in plans
    ]
    layers += experts.layer_inputs(len(plans))  # a size target sizes each expert's matrix with the other layers
    decided = plan_layers(layers, config, calibration)
    experts.take_plans(decided, no_modes_reason)
    for cand, decision, _ in plans:
        decision.notes.extend(decided.notes[cand.fqn])
        if cand.fqn in decided.no_modes:
            decision.reason = no_modes_reason(decided.no_modes[cand.fqn])

    # Build every TT matrix from its plan before touching the model, so an error leaves it unchanged.
    built = []
    for cand, decision, holders in plans:
        if cand.fqn in decided.plans:
            made = build_or_skip(params[cand.fqn], cand, decision, decided.plans[cand.fqn])
            if made is not None:
                built.append((cand, decision, holders, *made))
    size_info = decided.size_info
    experts.annotate(decisions)
    experts.build(len(plans), build_tt)

    # Mutate; whatever fails on the way (an exception, KeyboardInterrupt) restores every module touched.
    journal = Journal()
    try:
        for cand, decision, holders, tt, notes in built:
            for module, path, attr in holders:
                _replace_holder(model, module, path, attr, tt, cand.kind, stores_transpose(cand), journal)
            if not tt.is_zero:
                tt.prepare_plans()  # a graph compiled before any eager call then runs the planned order
        experts.install(journal)
    except BaseException:
        journal.undo()
        experts.undo()
        raise
    for cand, decision, holders, tt, notes in built:
        decision.converted = True
        decision.notes.extend(notes)
        if cand.unsupported_uses:  # TensorizeConfig.weight_space
            decision.notes.append(
                f"weight-space: {sorted({u.target for u in cand.unsupported_uses})} read the "
                f"weight rebuilt from the TT cores (the other uses are contracted)"
            )
        decision.ranks = tt.ranks
        decision.params = tt.layout.num_params
    if size_info is not None:
        size_info.reached = sum(tt.layout.num_params for *_, tt, _ in built) + experts.tt_params()
    return TensorizeSummary(decisions + experts.finish() + earlier, result.method, result.fallback_reason, size_info)


def _expert_decision(cand) -> LayerDecision:
    """The decision for one 3D expert parameter (``comera_fx.moe``); its kind is "experts"."""
    return LayerDecision(cand.fqn, (cand.fqn,), "experts", cand.shape, tuple(cand.uses) or (cand.layout,))


def _tt_matrix_of(param: Tensor, cand: Candidate) -> Tensor:
    """M for a candidate: Pᵀ for a linear-first weight (rows = input features), P otherwise."""
    return param.detach().t() if stores_transpose(cand) else param.detach()


def _replace_holder(
    model: nn.Module,
    module: nn.Module,
    path: str,
    attr: str,
    tt: TTMatrix,
    kind: str,
    transposed_m: bool,
    journal: Journal,
) -> None:
    """Swap a known module for its TT twin, or give any other module a reconstructing property."""
    swap = _swap_kind(module, attr, kind, transposed_m)
    if swap is None:
        if module._modules.get(f"{attr}_tt") is tt:
            return  # one module registered under two names (a block used twice): its property is attached
        journal.touch(module)
        journal.added_property(tt)
        attach_tt_property(module, attr, tt, transposed=transposed_m)
        return
    if swap == "embedding":
        pad = module.padding_idx
        row = module.weight.detach()[pad] if pad is not None else None
        new: nn.Module = TTEmbedding(tt, pad, row)
    else:
        # M = Wᵀ for a linear-first parameter; a tied head reads the embedding's M = W. Conv1D: y = x W + b, W = M.
        new = TTLinear(tt, None, transposed=swap == "linear" and not transposed_m)
        new.bias = module.bias  # the same parameter: its requires_grad, ties and identity are kept
    move_hooks(module, new)
    new.train(module.training)
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    journal.touch(parent)
    setattr(parent, child, new)


def _earlier_tt_layers(model: nn.Module, config: TensorizeConfig, filter_fn: FilterFn | None) -> list[LayerDecision]:
    """TT matrices already in the model (an earlier ``tensorize_`` call), as skipped decisions.

    Their dense weights are gone, so they are never converted again; if ``config`` (and ``filter_fn``) select one
    with other settings than it was made with, the call is refused rather than ignoring the new settings.
    """
    found: dict[int, tuple[TTMatrix, list[tuple[str, nn.Module, str]]]] = {}
    for path, tt in model.named_modules(remove_duplicate=False):
        if not isinstance(tt, TTMatrix):
            continue
        holder_path, _, leaf = path.rpartition(".")
        attr = "weight" if leaf == "tt" else leaf[:-3] if leaf.endswith("_tt") else None
        if attr is not None:
            fqn = f"{holder_path}.{attr}" if holder_path else attr
            found.setdefault(id(tt), (tt, []))[1].append((fqn, model.get_submodule(holder_path), holder_path))
    decisions, conflicts = [], []
    for tt, holders in found.values():
        names = tuple(fqn for fqn, _, _ in holders)
        kind, made_with = getattr(tt, "made_with", (None, None))
        shape = _dense_shape(tt, holders[0][1], names[0].rpartition(".")[2])
        decision = LayerDecision(
            names[0], names, kind or "linear", shape, ("tt",), ranks=tt.ranks, params=tt.layout.num_params
        )
        decision.reason = f"already in TT form ({tt.format.value}, ranks {tt.ranks}); tensorize_ converts dense weights"
        decisions.append(decision)
        selected = (
            made_with is not None
            and config.is_large(shape)
            and not any(config.is_skipped(n) for n in names)
            and (filter_fn is None or all(filter_fn(m, p) for _, m, p in holders))
        )
        if selected:
            wanted = config.settings_for(names[0]).tt_options(kind)
            changed = [f"{k} {made_with.get(k)!r} -> {v!r}" for k, v in wanted.items() if v != made_with.get(k)]
            if changed:
                conflicts.append(f"{names[0]} ({', '.join(changed)})")
    if conflicts:
        raise ValueError(
            f"this model was already tensorized and the config asks for other settings for {len(conflicts)} of its "
            f"TT layers: {'; '.join(conflicts)}. A TT layer's dense weight is gone, so tensorize_ cannot convert it "
            f"again: tensorize the dense model with the new config, or leave these layers out "
            f"(TensorizeConfig.skip, filter_fn) to convert only the dense ones"
        )
    return decisions


def _dense_shape(tt: TTMatrix, holder: nn.Module, attr: str) -> tuple[int, int]:
    """The shape of the parameter a TT matrix replaced: Pᵀ = M for a linear-first weight, P = M otherwise."""
    if isinstance(holder, TTLinear):
        return (holder.out_features, holder.in_features)
    transposed = getattr(type(holder), "_comera_fx_properties", {}).get(attr, False)
    return (tt.cols, tt.rows) if transposed else (tt.rows, tt.cols)
