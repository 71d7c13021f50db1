"""Randomized backward (RMM) on the experts' TT products: ``randomize_backward_`` sets ``bank.rmm`` on every
``TTExpertBank`` it accepts, and each expert's product then keeps a sketch of ρ of *that expert's* tokens for its
core gradients (``rmm.functions.rmm_tt_product``); forward and dX stay exact. ``restore_backward_`` clears it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..rmm.functions import prepare_rmm_plans
from .bank import TTExpertBank
from .shared import SharedTTExpertBank
from .weight_space import bank_attrs


def randomize_banks(
    model: nn.Module, config, filter_fn: Callable[[nn.Module, str], bool] | None, decision: Callable
) -> list:
    """Give every expert bank of ``model`` (each expert's matrix at least ``config.min_numel`` entries, trainable,
    accepted by ``filter_fn``) the randomized backward; returns one ``decision(fqn, kind, shape, randomized,
    reason)`` per bank."""
    out = []
    rebuilt = {id(m._modules[f"{a}_tt"]) for m in model.modules() for a in bank_attrs(m)}
    for fqn, bank in model.named_modules():
        if not isinstance(bank, (TTExpertBank, SharedTTExpertBank)):
            continue
        shape = bank.weight_shape
        reason = None
        if id(bank) in rebuilt:
            reason = (
                "weight-space form: the module's own ops read the experts rebuilt from the cores, there is no "
                "TT product to randomize"
            )
        elif shape[1] * shape[2] < config.min_numel:
            reason = f"{shape[1] * shape[2]:,} entries per expert < min_numel={config.min_numel:,}"
        elif not any(p.requires_grad for p in bank.parameters()):
            reason = "frozen experts: no core gradient to estimate"
        elif filter_fn is not None and not filter_fn(bank, fqn):
            reason = "filter_fn rejected it"
        out.append(decision(fqn, "tt_experts", shape, reason is None, reason))
        if reason is None:
            bank.rmm = config
            chains = [bank.expert_chain(0)] if isinstance(bank, SharedTTExpertBank) else list(bank)
            for tt in chains:  # a shared bank's experts share one layout
                if not tt.stored_empty:
                    prepare_rmm_plans(tt)  # a compiled model reads plans, it does not make them
    return out


def restore_banks(model: nn.Module) -> int:
    """Exact backward for every randomized expert bank again; returns how many were restored."""
    banks = [m for m in model.modules() if isinstance(m, (TTExpertBank, SharedTTExpertBank)) and m.rmm is not None]
    for bank in banks:
        bank.rmm = None
    return len(banks)
