"""Swapping packed layers into a model, and the manifest entries ``save_tensorized`` / ``load_tensorized`` use."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..quantize import SPEC_ATTR, QuantSpec
from ..tt.layers import TTLinear, TTMatrix
from .linear import SCALES_SUFFIX, PackedLinear, kernel_group
from .tt import PACKED_CORE_BITS, PackedTTLinear, tt_core_specs


@torch.no_grad()
def pack_linears_(model: nn.Module, *, tt: bool = True) -> dict[str, str]:
    """Swap every ``nn.Linear`` whose weight ``quantize_`` / ``apply_formats_`` put on an int grid for a
    ``PackedLinear`` holding the same values as codes, and (``tt=True``) every ``TTLinear`` whose cores are all on
    a grid for a ``PackedTTLinear``; returns {module path: why it stayed} for quantized layers that could not be
    packed (they stay fake-quantized fp32). Inference only: pack after training. A weight or TT matrix shared with
    another module (tied) is left as it is."""
    counts: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
        for child in module._modules.values():
            if isinstance(child, TTMatrix):
                counts[id(child)] = counts.get(id(child), 0) + 1
    left, swaps = {}, []
    for path, module in model.named_modules():
        if tt and type(module) is TTLinear:
            specs = tt_core_specs(module.tt)
            if all(s is None for s in specs):
                continue
            if None in specs:
                left[path] = "some of its TT cores are not quantized"
            elif any(s.bits not in PACKED_CORE_BITS for s in specs):
                left[path] = f"PackedTTLinear holds int8 / int4 cores, not int{min(s.bits for s in specs)}"
            elif counts[id(module.tt)] > 1:
                left[path] = "its TT matrix is shared with another module"
            else:
                swaps.append((path, module, PackedTTLinear.from_tt_linear))
            continue
        if type(module) is not nn.Linear or "weight" not in getattr(module, SPEC_ATTR, {}):
            continue
        spec = getattr(module, SPEC_ATTR)["weight"]
        if counts[id(module.weight)] > 1:
            left[path] = "its weight is shared with another module"
            continue
        try:
            kernel_group(spec, module.out_features, module.in_features)
        except ValueError as exc:
            left[path] = str(exc)
            continue
        swaps.append((path, module, lambda m, spec=spec: PackedLinear.from_linear(m, spec).to(m.weight.device)))
    for path, module, make in swaps:
        packed = make(module)
        packed.train(module.training)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, packed)
    return left


def packed_modules(model: nn.Module) -> dict[str, PackedLinear | PackedTTLinear]:
    """{path: module} of every packed layer (``PackedLinear`` and ``PackedTTLinear``; both have ``nbytes()``)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, (PackedLinear, PackedTTLinear))}


# ---- save_tensorized / load_tensorized


def packed_manifest(model: nn.Module) -> dict[str, dict]:
    """{path: its grid and shape} of every ``PackedLinear`` (the manifest entry ``load_tensorized`` rebuilds)."""
    return {
        path: {
            "bits": m.spec.bits,
            "group_size": m.spec.group_size,
            "in": m.in_features,
            "out": m.out_features,
            "bias": m.bias is not None,
        }
        for path, m in packed_modules(model).items()
        if isinstance(m, PackedLinear)
    }


def packed_tt_manifest(model: nn.Module) -> dict[str, dict]:
    """{path: its layout, grids per core, ...} of every ``PackedTTLinear``."""
    return {path: m.manifest_entry() for path, m in packed_modules(model).items() if isinstance(m, PackedTTLinear)}


def _swap(model: nn.Module, path: str, new: nn.Module) -> None:
    new.train(model.get_submodule(path).training)
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def install_packed(model: nn.Module, entries: dict[str, dict], tt_entries: dict[str, dict] | None = None) -> None:
    """Swap the modules at the manifest's paths for (unallocated) ``PackedLinear`` s and ``PackedTTLinear`` s; the
    state fills them."""
    for path, e in (tt_entries or {}).items():
        old = model.get_submodule(path)
        _swap(model, path, PackedTTLinear.from_manifest_entry(e, device=next(old.parameters(), torch.empty(0)).device))
    for path, e in entries.items():
        old = model.get_submodule(path)
        new = PackedLinear(
            e["in"],
            e["out"],
            QuantSpec(e["bits"], e["group_size"]),
            e["bias"],
            device=next(old.parameters(), torch.empty(0)).device,
        )
        new.train(old.training)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def packed_from_quantized(model: nn.Module, manifest: dict, tensors: dict[str, Tensor], scale_prefix: str) -> None:
    """``load_tensorized(pack=True)``: turn each saved quantized ``nn.Linear`` weight whose groups fit into a
    packed entry of the manifest (its codes and scales are already the portable form ``PackedLinear`` loads)."""
    quantized, packed = manifest.get("quantized", {}), manifest.setdefault("packed", {})
    aliased = set(manifest.get("aliases", {}).values()) | set(manifest.get("aliases", {}))
    for key in [k for k in quantized if k.endswith(".weight") and k not in aliased]:
        path = key[: -len(".weight")]
        module = model.get_submodule(path)
        spec = QuantSpec(quantized[key]["bits"], quantized[key]["group_size"])
        if type(module) is not nn.Linear or tuple(quantized[key]["shape"]) != tuple(module.weight.shape):
            continue
        try:
            kernel_group(spec, module.out_features, module.in_features)
        except ValueError:
            continue
        packed[path] = {
            "bits": spec.bits,
            "group_size": spec.group_size,
            "in": module.in_features,
            "out": module.out_features,
            "bias": module.bias is not None,
        }
        tensors[f"{path}.{SCALES_SUFFIX}"] = tensors.pop(scale_prefix + key)
        del quantized[key]


def packed_tt_from_quantized(manifest: dict, tensors: dict[str, Tensor], scale_prefix: str) -> None:
    """``load_tensorized(pack=True)``: turn each saved ``TTLinear`` whose cores are all quantized, and whose TT
    matrix no other holder shares, into a ``packed_tt`` entry of the manifest; its stored codes and scales become
    the ``PackedTTLinear``'s buffers as they are (no fp32 core is built)."""
    quantized, packed = manifest.get("quantized", {}), manifest.setdefault("packed_tt", {})
    aliases = manifest.get("aliases", {})
    aliased = set(aliases.values()) | set(aliases)
    matrices = {e["fqn"]: e for e in manifest["tt_matrices"]}
    holders_of: dict[str, int] = {}
    for holder in manifest["holders"]:
        if "tt" in holder:
            holders_of[holder["tt"]] = holders_of.get(holder["tt"], 0) + 1
    for holder in manifest["holders"]:
        if holder.get("type") != "linear" or holders_of[holder["tt"]] > 1:
            continue
        entry, path, fqn = matrices[holder["tt"]], holder["path"], holder["tt"]
        n_cores = len(entry["ranks"]) - 1
        cores = [f"{fqn}.cores.{k}" for k in range(n_cores)]
        gates = [f"{fqn}.gates.{k}" for k in range(n_cores - 1)]
        if any(k not in quantized or k in aliased for k in cores) or any(g in aliased for g in gates):
            continue
        bias = f"{path}.bias"
        packed[path] = {
            **{k: entry[k] for k in ("format", "rows", "cols", "row_modes", "col_modes", "ranks")},
            "specs": [[quantized[k]["bits"], quantized[k]["group_size"]] for k in cores],
            "bias": bias in tensors or bias in aliases,
            "transposed": holder["transposed"],
            "dtype": quantized[cores[0]]["dtype"],
        }
        for k, key in enumerate(cores):
            tensors[f"{path}.codes_{k}"] = tensors.pop(key)
            tensors[f"{path}.scales_{k}"] = tensors.pop(scale_prefix + key)
            del quantized[key]
        for k, key in enumerate(gates):
            tensors[f"{path}.gates_{k}"] = tensors.pop(key)
