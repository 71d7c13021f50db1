"""The MoE part of ``save_tensorized`` / ``load_tensorized``: which modules hold expert banks, and how to put
them back into a freshly built (meta) model. Each expert's ``TTMatrix`` (or a shared bank's one chain) is saved
like any other."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..tt.layers import TTMatrix
from .bank import TTExpertBank
from .experts import TTExperts
from .shared import SharedTTExpertBank
from .weight import ExpertWeight, attach_expert_weight
from .expert_list import SharedExpertLinear, install_shared_linears
from .weight_space import attach_bank_properties, bank_attrs, is_bank_holder

HOLDER_TYPES = ("experts", "expert_weight", "bank_property", "shared_linears")


def _bank_entry(bank: TTExpertBank | SharedTTExpertBank, path_of: Mapping[int, str]) -> dict:
    if isinstance(bank, SharedTTExpertBank):  # one chain over all experts
        return {"slice_use": bank.slice_use, "shared": path_of[id(bank.tt)], "num_experts": bank.num_experts}
    return {"slice_use": bank.slice_use, "tt": [path_of[id(tt)] for tt in bank]}


def expert_holders(model: nn.Module, path_of: Mapping[int, str]) -> list[dict]:
    """Manifest entries for the ``TTExperts`` modules and ``ExpertWeight`` attributes of ``model``
    (``path_of``: id of each TTMatrix -> its manifest name)."""
    holders = []
    bank_paths = {id(m): p for p, m in model.named_modules() if isinstance(m, SharedTTExpertBank)}
    linears: dict[int, list] = {}  # shared chains of expert lists: id(bank) -> [(linear path, expert)]
    for path, module in model.named_modules():
        if isinstance(module, SharedExpertLinear):
            linears.setdefault(id(module.bank), [module.bank, []])[1].append([path, module.expert])
    for bank, users in linears.values():
        holders.append(
            {
                "path": bank_paths[id(bank)],
                "type": "shared_linears",
                "linears": users,
                "bank": _bank_entry(bank, path_of),
            }
        )
    for path, module in model.named_modules():
        if isinstance(module, TTExperts):
            holders.append(
                {
                    "path": path,
                    "type": "experts",
                    "up_name": module.up_name,
                    "up": _bank_entry(module.up, path_of),
                    "down": _bank_entry(module.down_proj, path_of),
                }
            )
        elif is_bank_holder(module):  # the weight-space form: the module reads its banks rebuilt
            holders.append(
                {
                    "path": path,
                    "type": "bank_property",
                    "banks": {a: _bank_entry(module._modules[f"{a}_tt"], path_of) for a in bank_attrs(module)},
                }
            )
        for attr, value in vars(module).items():
            if isinstance(value, ExpertWeight):
                holders.append(
                    {"path": path, "type": "expert_weight", "attr": attr, "bank": _bank_entry(value.bank, path_of)}
                )
    return holders


def install_expert_holder(model: nn.Module, holder: dict, matrices: Mapping[str, TTMatrix]) -> None:
    """Put one manifest entry's banks into ``model`` (built by ``build_fn``, dense experts still in place)."""

    def bank(entry: dict) -> TTExpertBank | SharedTTExpertBank:
        if "shared" in entry:
            return SharedTTExpertBank(matrices[entry["shared"]], entry["num_experts"], entry["slice_use"])
        return TTExpertBank([matrices[name] for name in entry["tt"]], entry["slice_use"])

    if holder["type"] == "shared_linears":  # the chain's path is new in the built model
        install_shared_linears(model, holder["path"], bank(holder["bank"]), [tuple(u) for u in holder["linears"]])
        return
    module = model.get_submodule(holder["path"])
    if holder["type"] == "experts":
        new = TTExperts.from_hf(module, bank(holder["up"]), bank(holder["down"]))
        parent_path, _, child = holder["path"].rpartition(".")
        setattr(model.get_submodule(parent_path), child, new)
    elif holder["type"] == "bank_property":
        attach_bank_properties(module, {attr: bank(entry) for attr, entry in holder["banks"].items()})
    elif holder["type"] == "expert_weight":
        attach_expert_weight(module, holder["attr"], bank(holder["bank"]))
    else:
        raise ValueError(f"unknown expert holder type {holder['type']!r} in the manifest")
