"""``tensorize_``'s shared form for expert ``nn.ModuleList``s (``TensorizeConfig(expert_form="shared")``).

The graph finder lists each expert's ``nn.Linear`` as its own candidate. With the shared form asked, the linears
of one name across a list's experts (``experts.0.w_in`` … ``experts.<E-1>.w_in``) are taken out of those
candidates and decided, built and installed together: one ``SharedTTExpertBank`` (TT-SVD of the experts side by
side) and one ``SharedExpertLinear`` per expert (``moe/expert_list.py``). A group that cannot be shared (an
expert's linear is not a plain ``nn.Linear``, has hooks, is skipped, filtered, too small) stays with the other
candidates: each expert its own TT matrix, with the reason noted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import TensorizeConfig
from ..moe.expert_list import bank_name, install_shared_linears
from ..moe.shared import SharedTTExpertBank
from .find_experts import MODULE_LIST, ExpertCandidate, ExpertScan
from .holders import hook_problem


@dataclass
class ListGroup:
    """The linears of one name across an expert list: their weight FQNs and module paths, in expert order."""

    list_path: str
    linear: str  # the path inside one expert ("" when the expert itself is the linear)
    fqns: list[str]
    paths: list[str]
    decision: object = None
    bank: SharedTTExpertBank | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def bank_path(self) -> str:
        parent = self.list_path.rpartition(".")[0]
        name = bank_name(self.list_path, self.linear)
        return f"{parent}.{name}" if parent else name


def _groups(scan: ExpertScan) -> list[ListGroup]:
    groups: dict[tuple[str, str], ListGroup] = {}
    for cand in scan.of_layout(MODULE_LIST):
        prefix = f"{cand.expert_list}.{cand.expert_index}"
        linear = cand.holder[len(prefix) + 1 :] if cand.holder != prefix else ""
        group = groups.setdefault((cand.expert_list, linear), ListGroup(cand.expert_list, linear, [], []))
        group.fqns.append(cand.fqn)
        group.paths.append(cand.holder)
    return list(groups.values())


class SharedLists:
    """Decide, build and install the shared chains of expert lists, in ``tensorize_``'s order."""

    def __init__(
        self,
        model: nn.Module,
        scan: ExpertScan,
        config: TensorizeConfig,
        filter_fn,
        make_decision: Callable[[ExpertCandidate], object],
    ):
        self.model, self.config, self.groups, self.refused = model, config, [], {}
        for group in _groups(scan):
            weight = model.get_parameter(group.fqns[0])
            reason = self._problem(group, weight, filter_fn)
            if reason is not None:
                for fqn in group.fqns:
                    self.refused[fqn] = reason
                continue
            shape = (len(group.fqns), *weight.shape)
            cand = ExpertCandidate(
                f"{group.list_path}.*.{group.linear}.weight".replace("..", "."),
                group.list_path,
                MODULE_LIST,
                shape,
                weight.dtype,
                len(group.fqns),
                uses=["linear"],
            )
            group.decision = make_decision(cand)
            self.groups.append(group)

    def _problem(self, group: ListGroup, weight, filter_fn) -> str | None:
        if self.config.size_target is not None:  # its linears are then sized by the allocation, as any linear
            return "not under a size target (the shared chains of expert lists are not sized by it yet)"
        modules = [self.model.get_submodule(p) for p in group.paths]
        if any(type(m) is not nn.Linear for m in modules):
            return "its experts' linears are not all plain nn.Linear"
        if not weight.dtype.is_floating_point or not self.config.is_large(tuple(weight.shape)):
            return "one expert's matrix is below the size threshold or not floating point"
        if any(self.config.is_skipped(f) for f in group.fqns):
            return "excluded by TensorizeConfig.skip / overrides"
        if filter_fn is not None and not all(filter_fn(m, p) for m, p in zip(modules, group.paths)):
            return "filter_fn rejected one of its experts' linears"
        return next((p for m in modules if (p := hook_problem(m))), None)

    def take(self, result) -> None:
        """Remove the grouped linears from the graph finder's candidates (they are converted here)."""
        taken = {f for g in self.groups for f in g.fqns}
        result.candidates[:] = [c for c in result.candidates if not set(c.aliases) & taken]

    def annotate(self, decisions: list) -> None:
        for d in decisions:
            if d.fqn in self.refused:
                d.notes.append(
                    f"expert_form='shared' not built for this expert list ({self.refused[d.fqn]}): "
                    "each expert its own TT matrix"
                )

    def build(self) -> None:
        for group in self.groups:
            weights = torch.stack([self.model.get_parameter(f).detach() for f in group.fqns])
            settings = self.config.settings_for(group.fqns[0])
            try:
                bank = SharedTTExpertBank.from_dense(
                    weights,
                    "linear",
                    max_rank=settings.max_rank,
                    rank_ratio=settings.rank_ratio,
                    rel_tol=settings.rel_tol,
                    max_pad_fraction=settings.max_pad_fraction,
                )
            except (ValueError, TypeError) as exc:
                raise type(exc)(
                    f"cannot build the shared form of the expert list {group.list_path} "
                    f"({group.linear or 'its linears'}): {exc}; TensorizeConfig(expert_form="
                    f"'per_expert') converts each expert on its own"
                ) from exc
            first = self.model.get_parameter(group.fqns[0])
            bank.to(device=first.device, dtype=first.dtype).requires_grad_(first.requires_grad)
            bank.tt.made_with = ("linear", settings.tt_options("linear"))
            group.bank = bank

    def install(self, journal) -> None:
        for group in self.groups:
            install_shared_linears(
                self.model, group.bank_path, group.bank, [(p, e) for e, p in enumerate(group.paths)], journal.touch
            )
            if not group.bank.tt.is_zero:
                group.bank.tt.prepare_plans()

    def tt_params(self) -> int:
        return sum(g.bank.tt.layout.num_params for g in self.groups if g.bank is not None)

    def finish(self) -> list:
        for group in self.groups:
            d = group.decision
            d.converted, d.ranks, d.params = True, group.bank.tt.ranks, group.bank.tt.layout.num_params
            d.notes.append(
                f"shared form over the {len(group.fqns)} experts of the nn.ModuleList "
                f"{group.list_path!r}: one TT chain ({group.bank.tt.layout.describe_modes()}), one core "
                f"per expert; each expert's linear is a SharedExpertLinear"
            )
        return [g.decision for g in self.groups]
