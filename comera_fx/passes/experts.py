"""Decide, build and install the TT form of the expert weights ``find_experts`` found (``tensorize_``'s MoE step).

The same three phases as the rest of ``tensorize_``: decide (a ``LayerDecision`` per expert parameter, with the
reason when it stays dense), build every ``TTExpertBank`` before touching the model, then install them:

* a transformers experts module is swapped for ``TTExperts`` (both of its projections, or neither);
* a raw 3D parameter is deleted from its module, its bank registered as ``<attr>_tt`` and the attribute ``<attr>``
  set to an ``ExpertWeight`` that runs ``bmm`` / slice products through the bank.

Expert lists (``nn.ModuleList`` of linears) need no step of their own: their linears are converted like any
other; ``expert_notes`` only says which expert each one is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TensorizeConfig
from ..moe.bank import TTExpertBank, stored_matrix
from ..moe.shared import SharedTTExpertBank, shared_modes, stacked_experts
from ..tt.layers import TTMatrix
from ..moe.experts import TTExperts, hf_experts_problem
from ..moe.weight import ExpertWeight, attach_expert_weight
from ..moe.weight_space import attach_bank_properties
from .find import Candidate, Use, UseKind, parameter_table
from .find_experts import HF_EXPERTS, MODULE_LIST, PARAMETER_3D, ExpertCandidate, ExpertScan
from .expert_lists import SharedLists
from .holders import Journal, hook_problem, move_hooks

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class ExpertPlan:
    """One holder to convert: its candidates (two projections of a transformers module, or one 3D parameter)
    with their decisions, and, once built, their banks."""

    holder: str
    layout: str
    candidates: list[ExpertCandidate]
    decisions: list  # LayerDecision, one per candidate
    weight_space: str | None = None  # why the module's own forward reads rebuilt banks (None: the contracted path)
    banks: list[TTExpertBank] | None = None
    layer_plans: list[list] | None = None  # per candidate, one LayerPlan per expert (a size target decided them)


def expert_notes(scan: ExpertScan) -> dict[str, str]:
    """{linear weight FQN: which expert of which list it is} for the expert-list layout."""
    return {c.fqn: c.describe() for c in scan.of_layout(MODULE_LIST)}


def plan_experts(
    model: nn.Module,
    scan: ExpertScan,
    config: TensorizeConfig,
    filter_fn: FilterFn | None,
    make_decision: Callable[[ExpertCandidate], object],
) -> tuple[list, list[ExpertPlan]]:
    """(a decision for every 3D expert parameter, the holders to convert). ``make_decision`` builds a
    ``LayerDecision`` (passed in so that this module does not import ``passes.tensorize``)."""
    groups: dict[str, list[ExpertCandidate]] = {}
    for cand in scan.candidates:
        if cand.layout != MODULE_LIST:
            groups.setdefault(cand.holder, []).append(cand)
    decisions, plans = [], []
    for holder_path, cands in groups.items():
        holder = model.get_submodule(holder_path)
        made = [make_decision(c) for c in cands]
        decisions.extend(made)
        problem = functools.cache(lambda holder=holder: hf_experts_problem(holder))  # the probe runs once
        reasons = [_skip_reason(holder, holder_path, c, config, filter_fn, problem) for c in cands]
        if cands[0].layout == HF_EXPERTS and any(reasons):
            first = next(r for r in reasons if r)
            reasons = [
                r or f"its partner projection stays dense ({first}); an experts module is converted whole"
                for r in reasons
            ]
        for d, r in zip(made, reasons):
            d.reason = r
        if cands[0].layout == HF_EXPERTS:
            if not any(reasons):
                plans.append(ExpertPlan(holder_path, HF_EXPERTS, cands, made, problem()))
        else:
            plans.extend(
                ExpertPlan(holder_path, PARAMETER_3D, [c], [d], _weight_space_reason(c))
                for c, d in zip(cands, made)
                if not d.reason
            )
    return decisions, plans


def _weight_space_reason(cand: ExpertCandidate) -> str | None:
    """Why a raw 3D parameter's module must read its rebuilt bank (None: ``ExpertWeight`` serves every read)."""
    if cand.unsupported:
        return f"also read by {cand.unsupported}, which has no TT product"
    if not cand.uses:
        return (
            "its reads are unknown (found by the module scan; example_inputs would show whether they are "
            "bmm / slice products)"
            if cand.experts_seen is None
            else "no op read it on the example inputs"
        )
    return None


def _skip_reason(
    holder: nn.Module,
    path: str,
    cand: ExpertCandidate,
    config: TensorizeConfig,
    filter_fn: FilterFn | None,
    problem: Callable[[], str | None],
) -> str | None:
    if not cand.dtype.is_floating_point:
        return f"weight dtype {cand.dtype} is not floating point; only float weights can be tensorized"
    if not config.is_large(cand.slice_shape):
        return (
            f"one expert's matrix {cand.slice_shape} is below the size threshold (needs >= {config.min_numel} "
            f"elements and both dims >= {config.min_dim}; set TensorizeConfig.min_numel / min_dim)"
        )
    if config.is_skipped(cand.fqn):
        return "excluded by TensorizeConfig.skip / overrides"
    if filter_fn is not None and not filter_fn(holder, path):
        return f"filter_fn rejected {path or '<root>'}"
    if cand.layout == HF_EXPERTS and problem() is None:
        return hook_problem(holder)  # swapped for TTExperts; the weight-space form keeps the module
    if not path:
        return "tensorize_ cannot replace a parameter of the root module itself; wrap it in a parent module"
    return None


def expert_name(fqn: str, expert: int) -> str:
    """The name one expert's matrix goes by in the size target's allocation (``<3D parameter FQN>.<e>``)."""
    return f"{fqn}.{expert}"


def shared_name(fqn: str) -> str:
    """The name the shared chain of a 3D parameter's experts goes by in the size target's allocation."""
    return f"{fqn}.shared"


def is_shared(plan: ExpertPlan, config: TensorizeConfig) -> bool:
    """Does ``plan`` build the shared form (``expert_form="shared"``, a transformers experts module or the
    weight-space form)? Otherwise each expert gets its own TT matrix."""
    return config.expert_form == "shared" and (plan.layout == HF_EXPERTS or plan.weight_space)


def build_banks(
    model: nn.Module,
    plans: list[ExpertPlan],
    config: TensorizeConfig,
    first_index: int,
    build_tt: Callable | None = None,
) -> None:
    """Build every plan's banks (TT-SVD or random init of each expert), before anything in the model changes.
    Experts a size target planned (``plan.layer_plans``) are built by ``build_tt(slice, layer_plan)``."""
    params = dict(model.named_parameters())
    index = first_index
    for plan in plans:
        plan.banks = []
        for i, cand in enumerate(plan.candidates):
            weight, first, index = params[cand.fqn], index, index + cand.num_experts  # experts first.. index - 1
            settings = config.settings_for(cand.fqn)
            if plan.layer_plans is not None and is_shared(plan, config):  # one planned chain: the shared form
                (layer_plan,) = plan.layer_plans[i]
                tt = build_tt(stacked_experts(weight, cand.slice_use), layer_plan)[0]
                plan.banks.append(SharedTTExpertBank(tt, cand.num_experts, cand.slice_use))
            elif plan.layer_plans is not None:
                matrices = [build_tt(weight[e], layer_plan)[0] for e, layer_plan in enumerate(plan.layer_plans[i])]
                plan.banks.append(TTExpertBank(matrices, cand.slice_use))
            elif is_shared(plan, config):
                plan.banks.append(_shared_bank(weight, cand, settings))
            else:
                if config.expert_form == "shared":
                    plan.decisions[i].notes.append(
                        "expert_form='shared' needs a transformers experts module or "
                        "the weight-space form: each expert its own TT matrix here"
                    )
                seed = None if config.seed is None else config.seed + first
                plan.banks.append(_per_expert_bank(weight, cand, settings, seed))


def _per_expert_bank(weight, cand: ExpertCandidate, settings, seed: int | None) -> TTExpertBank:
    """Each expert its own TT matrix (TT-SVD or random init; expert e's generator seeded ``seed + e``)."""
    generators = None
    if seed is not None:
        generators = [torch.Generator(device=weight.device).manual_seed(seed + e) for e in range(cand.num_experts)]
    try:
        bank = TTExpertBank.from_dense(weight, cand.slice_use, generators=generators, **settings.tt_options("linear"))
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"cannot tensorize the experts {cand.fqn} {cand.shape}: {exc}") from exc
    bank.to(device=weight.device, dtype=weight.dtype).requires_grad_(weight.requires_grad)
    for tt in bank:
        tt.made_with = ("linear", settings.tt_options("linear"))
    return bank


def _shared_bank(weight, cand: ExpertCandidate, settings) -> SharedTTExpertBank:
    """``TensorizeConfig(expert_form="shared")``: one TT chain over the experts of ``weight`` (TT-SVD)."""
    try:
        bank = SharedTTExpertBank.from_dense(
            weight,
            cand.slice_use,
            max_rank=settings.max_rank,
            rank_ratio=settings.rank_ratio,
            rel_tol=settings.rel_tol,
            max_pad_fraction=settings.max_pad_fraction,
        )
    except (ValueError, TypeError) as exc:
        raise type(exc)(
            f"cannot build the shared form of the experts {cand.fqn} {cand.shape}: {exc}; "
            f"TensorizeConfig(expert_form='per_expert') converts each expert on its own"
        ) from exc
    bank.to(device=weight.device, dtype=weight.dtype).requires_grad_(weight.requires_grad)
    bank.tt.made_with = ("linear", settings.tt_options("linear"))
    return bank


def bank_matrices(bank) -> list[TTMatrix]:
    """The TT matrices of a bank: each expert's, or the shared chain."""
    return [bank.tt] if isinstance(bank, SharedTTExpertBank) else list(bank)


def install_banks(model: nn.Module, plans: list[ExpertPlan], journal: Journal) -> None:
    """Put the built banks in the model (see the module docstring); ``journal`` can undo it with ``undo_views``."""
    for plan in plans:
        holder = model.get_submodule(plan.holder)
        if plan.weight_space:
            journal.touch(holder)
            attach_bank_properties(holder, {c.fqn.rpartition(".")[2]: b for c, b in zip(plan.candidates, plan.banks)})
        elif plan.layout == HF_EXPERTS:
            new = TTExperts.from_hf(holder, *plan.banks)
            move_hooks(holder, new)
            parent_path, _, child = plan.holder.rpartition(".")
            parent = model.get_submodule(parent_path)
            journal.touch(parent)
            setattr(parent, child, new)
        else:
            (cand,), (bank,) = plan.candidates, plan.banks
            journal.touch(holder)
            attach_expert_weight(holder, cand.fqn.rpartition(".")[2], bank)
        for bank in plan.banks:
            for tt in bank_matrices(bank):
                if not tt.is_zero:
                    tt.prepare_plans()


def undo_views(plans: list[ExpertPlan], model: nn.Module) -> None:
    """After ``Journal.undo``: drop the ``ExpertWeight`` attributes, which the journal does not record."""
    for plan in plans:
        if plan.layout == PARAMETER_3D and not plan.weight_space:
            holder = model.get_submodule(plan.holder)
            attr = plan.candidates[0].fqn.rpartition(".")[2]
            if isinstance(holder.__dict__.get(attr), ExpertWeight):
                del holder.__dict__[attr]


def record_decisions(plans: list[ExpertPlan]) -> None:
    """Fill the converted decisions: ranks of the first expert (the layout all share) or of the shared chain,
    params of all."""
    for plan in plans:
        for cand, decision, bank in zip(plan.candidates, plan.decisions, plan.banks):
            matrices = bank_matrices(bank)
            decision.converted = True
            decision.ranks = matrices[0].ranks
            decision.params = sum(tt.layout.num_params for tt in matrices)
            decision.notes.append(cand.describe())
            decision.notes.append(
                f"weight-space: {plan.weight_space}; the module's own forward reads the experts "
                "rebuilt from the TT cores"
                if plan.weight_space
                else _contracted_note(plan)
            )
            if isinstance(bank, SharedTTExpertBank):
                decision.notes.append(
                    "shared form: one TT chain over the experts, one core per expert "
                    f"({bank.tt.layout.describe_modes()})"
                )
            elif len({tt.ranks for tt in matrices}) > 1:
                decision.notes.append(f"ranks differ between experts: {[tt.ranks for tt in matrices]}")


def _orientation(cand: ExpertCandidate, calibration) -> str:
    """How a weight-space expert's slices are read, from the width of its calibration inputs (x P[e]ᵀ: the last
    dim of P[e]; x P[e]: the first); the candidate's own guess when that does not decide it."""
    widths = {
        calibration[f"{cand.fqn}.{e}"].in_features for e in range(cand.num_experts) if f"{cand.fqn}.{e}" in calibration
    }
    a, b = cand.slice_shape
    if widths == {b} and a != b:
        return "linear"
    if widths == {a} and a != b:
        return "matmul"
    return cand.slice_use


def _contracted_note(plan: ExpertPlan) -> str:
    if plan.layout == HF_EXPERTS:
        return "contracted: TTExperts runs each routed expert's planned TT products (no dense expert is rebuilt)"
    return "contracted: the module reads an ExpertWeight that runs bmm / slice products on the TT cores"


class ExpertStep:
    """``tensorize_``'s MoE step, in the order ``tensorize_`` calls it: ``annotate`` (notes on expert-list
    linears), ``build`` (before any change), ``install`` (inside the mutate phase), ``undo`` (if that fails),
    ``finish`` (the expert decisions for the summary)."""

    def __init__(
        self,
        model: nn.Module,
        config: TensorizeConfig,
        filter_fn: FilterFn | None,
        example_inputs,
        make_decision: Callable[[ExpertCandidate], object],
        calibration=None,
    ):
        from .find_experts import find_experts

        self.model, self.config = model, config
        # expert statistics (``calibrate_experts``) make each expert's matrix a planned layer, as a size target does
        self.planned = config.size_target is not None or (calibration is not None and config.expert_form != "shared")
        self.calibration = calibration
        self.scanned: set[str] = set()
        self.scan = find_experts(model, example_inputs)
        self.decisions, self.plans = plan_experts(model, self.scan, config, filter_fn, make_decision)
        # expert lists in the shared form: their linears leave the graph finder's candidates (``add_missed``)
        self.lists = (
            SharedLists(model, self.scan, config, filter_fn, make_decision) if config.expert_form == "shared" else None
        )

    def layer_inputs(self, first_index: int) -> list:
        """Under a size target, one ``LayerInput`` per expert matrix (named by ``expert_name``), or per shared chain
        (``shared_name``: the experts side by side, the expert mode among the column modes), so that the allocation
        sizes the experts with the other layers; nothing otherwise."""
        from .layer_plan import LayerInput

        if not self.planned:
            return []
        params = dict(self.model.named_parameters())
        inputs, index = [], first_index
        for plan in self.plans:
            for cand in plan.candidates:
                weight = params[cand.fqn].detach()
                if is_shared(plan, self.config):
                    stacked = stacked_experts(weight, cand.slice_use)
                    pad = self.config.settings_for(cand.fqn).max_pad_fraction
                    try:
                        modes = shared_modes(
                            stacked.shape[0], stacked.shape[1] // cand.num_experts, cand.num_experts, pad
                        )
                    except ValueError as exc:
                        raise ValueError(
                            f"cannot build the shared form of the experts {cand.fqn} {cand.shape}: {exc}; "
                            f"TensorizeConfig(expert_form='per_expert') converts each expert on its own"
                        ) from exc
                    inputs.append(LayerInput(shared_name(cand.fqn), "linear", False, stacked, index, cand.fqn, modes))
                    index += cand.num_experts
                    continue
                if plan.weight_space and self.calibration is not None:
                    cand.slice_use = _orientation(cand, self.calibration)
                for e in range(cand.num_experts):
                    inputs.append(
                        LayerInput(
                            expert_name(cand.fqn, e),
                            "linear",
                            cand.slice_use == "linear",
                            stored_matrix(weight[e], cand.slice_use),
                            index + e,
                            cand.fqn,
                        )
                    )
                index += cand.num_experts
        return inputs

    def take_plans(self, decided, reason_for: Callable[[str], str]) -> None:
        """Read the size target's per-expert plans from ``plan_layers``'s result; a holder with an expert that
        found no balanced modes stays dense (``reason_for`` words it)."""
        if not self.planned:
            return
        kept = []
        for plan in self.plans:
            names = [
                [shared_name(c.fqn)]
                if is_shared(plan, self.config)
                else [expert_name(c.fqn, e) for e in range(c.num_experts)]
                for c in plan.candidates
            ]
            missing = [n for group in names for n in group if n in decided.no_modes]
            if missing:
                for d in plan.decisions:
                    d.reason = reason_for(decided.no_modes[missing[0]])
                continue
            plan.layer_plans = [[decided.plans[n] for n in group] for group in names]
            for d, group in zip(plan.decisions, names):
                d.notes.extend(dict.fromkeys(note for n in group for note in decided.notes[n]))
            kept.append(plan)
        self.plans = kept

    def tt_params(self) -> int:
        """TT parameters of the banks built."""
        lists = self.lists.tt_params() if self.lists is not None else 0
        return lists + sum(
            tt.layout.num_params for plan in self.plans for bank in plan.banks or () for tt in bank_matrices(bank)
        )

    def add_missed(self, result) -> None:
        """Add to the graph finder's ``result`` the linears of expert lists it did not record. Dynamo records an
        expert's linears only if the example tokens reached that expert, and after the loop's graph break it
        may reuse one expert's compiled frame for the next (its ops are then not recorded again)."""
        have = {alias for c in result.candidates for alias in c.aliases}
        table = parameter_table(self.model)
        for cand in self.scan.of_layout(MODULE_LIST):
            if cand.fqn not in have and cand.fqn in table:
                result.candidates.append(
                    Candidate(
                        cand.fqn,
                        table[cand.fqn][1],
                        cand.shape,
                        cand.dtype,
                        [Use(UseKind.LINEAR, cand.holder, "Linear")],
                    )
                )
                self.scanned.add(cand.fqn)
        if self.lists is not None:
            self.lists.take(result)

    def annotate(self, decisions: list) -> None:
        notes = expert_notes(self.scan)
        for d in decisions:
            if d.fqn in notes:
                d.notes.append(notes[d.fqn])
            if d.fqn in self.scanned:
                d.notes.append("found by the expert-list scan: the captured graphs did not record its op")
        if self.lists is not None:
            self.lists.annotate(decisions)

    def build(self, first_index: int, build_tt: Callable) -> None:
        build_banks(self.model, self.plans, self.config, first_index, build_tt)
        if self.lists is not None:
            self.lists.build()

    def install(self, journal: Journal) -> None:
        install_banks(self.model, self.plans, journal)
        if self.lists is not None:
            self.lists.install(journal)

    def undo(self) -> None:
        undo_views(self.plans, self.model)

    def finish(self) -> list:
        record_decisions(self.plans)
        made = self.decisions + (self.lists.finish() if self.lists is not None else [])
        if self.calibration is not None and not self.planned:
            for d in made:
                if d.converted:
                    d.notes.append("calibration not used: expert_form='shared' is built by plain TT-SVD")
        return made
