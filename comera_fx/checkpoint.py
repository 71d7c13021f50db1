"""Ship a tensorized model: ``save_tensorized`` writes its state and TT structure; ``load_tensorized`` rebuilds it
without ever materialising the dense weights that were converted.

One file. With ``safetensors`` installed it is a safetensors file whose metadata holds the manifest (JSON);
otherwise a ``torch.save`` of ``{"manifest": str, "tensors": dict}`` (loadable with ``weights_only=True``). The
manifest lists every TT matrix (its layout: format, sizes, modes, live ranks — a pruned model records its pruned
ranks) and every module that holds one (a ``TTLinear``, a ``TTEmbedding``, or a module reading a reconstructing
property), the aliases of tensors shared between state-dict keys (tied weights, a shared TT matrix), and the
model's non-persistent buffers (``to_empty`` would leave them uninitialised), and the weights ``quantize_`` put on
an int8 / int4 / int3 grid: those are stored as their integer codes (int4 two to a byte, int3 eight to three bytes)
plus one fp32 scale per group, and come back as the same float values, bit for bit.

Loading calls ``build_fn()`` under ``torch.device("meta")`` (no memory), swaps the TT holders in with TT matrices
of the recorded layouts (meta too), then ``to_empty`` allocates only what the tensorized model holds, and the state
is copied in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from .moe.checkpoint import HOLDER_TYPES as EXPERT_HOLDER_TYPES
from .moe.checkpoint import expert_holders, install_expert_holder
from .passes.holders import attach_tt_property
from .packed import install_packed, packed_from_quantized, packed_manifest, packed_tt_from_quantized, packed_tt_manifest
from .quantize import QuantSpec, dequantize, pack, quantize_groups, quantized_specs, set_spec, unpack
from .tt.layers import TTEmbedding, TTLinear, TTMatrix, prepare_plans_under
from .tt.layout import TTFormat, TTLayout

FORMAT_VERSION = 1
_BUFFER_PREFIX = "__comera_fx_nonpersistent__."
_SCALE_PREFIX = "__comera_fx_scales__."


def _made_with_to_json(made_with):
    if made_with is None:
        return None
    kind, options = made_with
    return {
        "kind": kind,
        "options": {
            k: (v.value if hasattr(v, "value") else list(v) if isinstance(v, tuple) else v) for k, v in options.items()
        },
    }


def _made_with_from_json(data):
    if data is None:
        return None
    options = dict(data["options"])
    options["format"] = TTFormat(options["format"])
    for name in ("row_modes", "col_modes"):
        if options.get(name) is not None:
            options[name] = tuple(options[name])
    return data["kind"], options


def manifest_of(model: nn.Module) -> dict:
    """The TT structure of a model: its TT matrices (layouts) and the modules holding them."""
    matrices: dict[int, str] = {}
    entries = []
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TTMatrix) and id(module) not in matrices:
            matrices[id(module)] = path
            layout = module.layout
            entries.append(
                {
                    "fqn": path,
                    **layout.to_json(),
                    "made_with": _made_with_to_json(getattr(module, "made_with", None)),
                }
            )
    holders = []
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TTLinear):
            holders.append(
                {"path": path, "type": "linear", "tt": matrices[id(module.tt)], "transposed": module.transposed}
            )
        elif isinstance(module, TTEmbedding):
            holders.append(
                {"path": path, "type": "embedding", "tt": matrices[id(module.tt)], "padding_idx": module.padding_idx}
            )
        elif getattr(type(module), "_comera_fx_tt_class", False):
            for attr, transposed in type(module)._comera_fx_properties.items():
                holders.append(
                    {
                        "path": path,
                        "type": "property",
                        "attr": attr,
                        "transposed": transposed,
                        "tt": matrices[id(module._modules[f"{attr}_tt"])],
                    }
                )
    holders.extend(expert_holders(model, matrices))  # MoE: banks of per-expert TT matrices
    return {
        "format_version": FORMAT_VERSION,
        "tt_matrices": entries,
        "holders": holders,
        "packed": packed_manifest(model),
        "packed_tt": packed_tt_manifest(model),
    }


def non_persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers registered with ``persistent=False`` (not in the state_dict), by name. Not those a module's own
    ``_save_to_state_dict`` writes in another form (packed codes: their portable form is in the state_dict, their
    in-memory layout is the module's business)."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def save_tensorized(model: nn.Module, path: str | Path) -> dict:
    """Write the model's state and TT manifest to ``path`` (one file); returns the manifest."""
    manifest = manifest_of(model)
    state = model.state_dict()
    for name, buffer in non_persistent_buffers(model).items():
        state[_BUFFER_PREFIX + name] = buffer.detach()
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for key, tensor in state.items():
        tensor = tensor.detach()
        if tensor.numel() > 0:
            ident = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
            storage = tensor.untyped_storage().data_ptr()
            tensor = tensor.clone() if storage in storages else tensor  # another view of a saved storage
            storages.add(storage)
        tensors[key] = tensor.contiguous().cpu()
    manifest["aliases"] = aliases
    manifest["quantized"] = _store_quantized(tensors, quantized_specs(model))
    text = json.dumps(manifest)
    try:
        from safetensors.torch import save_file
    except ImportError:
        torch.save({"manifest": text, "tensors": tensors}, path)
    else:
        save_file(tensors, str(path), metadata={"comera_fx": text})
    return manifest


def _store_quantized(tensors: dict[str, Tensor], specs: dict[str, QuantSpec]) -> dict[str, dict]:
    """Replace each quantized weight in ``tensors`` by its codes and add its scales; returns the manifest entries."""
    entries = {}
    for key, spec in specs.items():
        tensor = tensors.get(key)
        if tensor is None:  # an alias of a key stored under another name
            continue
        codes, scales = quantize_groups(tensor, spec)
        tensors[key] = pack(codes, spec.bits)
        tensors[_SCALE_PREFIX + key] = scales
        entries[key] = {
            "bits": spec.bits,
            "group_size": spec.group_size,
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    return entries


def _restore_quantized(tensors: dict[str, Tensor], entries: dict[str, dict]) -> dict[str, QuantSpec]:
    """Undo ``_store_quantized`` in ``tensors``; returns {key: its grid}."""
    specs = {}
    for key, entry in entries.items():
        spec = QuantSpec(entry["bits"], entry["group_size"])
        shape = tuple(entry["shape"])
        codes = unpack(tensors[key], spec.bits, math.prod(shape))
        tensors[key] = dequantize(codes, tensors.pop(_SCALE_PREFIX + key), spec, shape, getattr(torch, entry["dtype"]))
        specs[key] = spec
    return specs


def _read(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    try:
        from safetensors import safe_open
    except ImportError:
        safe_open = None
    if safe_open is not None:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception:  # not a safetensors file: written by the torch.save fallback
            handle = None
        if handle is not None:
            with handle as f:
                metadata = f.metadata() or {}
                if "comera_fx" not in metadata:
                    raise ValueError(
                        f"{path} is a safetensors file without comera_fx's manifest; it was not "
                        f"written by comera_fx.save_tensorized"
                    )
                return json.loads(metadata["comera_fx"]), {k: f.get_tensor(k) for k in f.keys()}
    data = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(data, dict) or "manifest" not in data:
        raise ValueError(f"{path} is not a file written by comera_fx.save_tensorized")
    return json.loads(data["manifest"]), data["tensors"]


def load_tensorized(
    path: str | Path, build_fn: Callable[[], nn.Module], *, device: torch.device | str = "cpu", pack: bool = False
) -> nn.Module:
    """Rebuild a model saved by ``save_tensorized``: ``build_fn()`` builds the dense architecture (it is called
    under ``torch.device("meta")``, so its weights take no memory), the recorded TT layers replace their dense
    holders, and the saved state is loaded onto ``device``. Dense versions of the converted weights are never
    allocated. The tensors come back with the state's dtypes; every parameter requires grad (as built). The TT
    matrices come back planned (``TTMatrix.prepare_plans``), so the model compiles before any eager call.
    ``PackedLinear`` / ``PackedTTLinear`` layers come back packed; ``pack=True`` also loads every ``nn.Linear``
    weight ``quantize_`` put on an int grid (whose groups fit its rows) as a ``PackedLinear``, and every ``TTLinear``
    whose cores are all quantized (its TT matrix not shared) as a ``PackedTTLinear``: codes in memory, no fp32
    weight or core built."""
    manifest, tensors = _read(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: manifest version {manifest.get('format_version')} is not {FORMAT_VERSION}; "
            f"save it again with this comera_fx"
        )
    with torch.device("meta"):
        model = build_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_fn must return an nn.Module, got {type(model).__name__}")
    matrices = {}
    for entry in manifest["tt_matrices"]:
        layout = TTLayout.from_json(entry)
        cores = [torch.empty(shape, device="meta") for shape in layout.core_shapes]
        tt = TTMatrix(layout, cores)
        made_with = _made_with_from_json(entry.get("made_with"))
        if made_with is not None:
            tt.made_with = made_with
        matrices[entry["fqn"]] = tt
    for holder in manifest["holders"]:
        if holder["type"] in EXPERT_HOLDER_TYPES:
            install_expert_holder(model, holder, matrices)
        else:
            _install(model, holder, matrices[holder["tt"]])
    if pack:
        packed_from_quantized(model, manifest, tensors, _SCALE_PREFIX)
        packed_tt_from_quantized(manifest, tensors, _SCALE_PREFIX)
    install_packed(model, manifest.get("packed", {}), manifest.get("packed_tt", {}))
    model.to_empty(device=device)
    specs = _restore_quantized(tensors, manifest.get("quantized", {}))
    state = {k: v for k, v in tensors.items() if not k.startswith(_BUFFER_PREFIX)}
    for key, target in manifest.get("aliases", {}).items():
        state[key] = tensors[target]
    buffers = {k[len(_BUFFER_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_BUFFER_PREFIX)}
    _cast_to_saved_dtypes(model, state)
    model.load_state_dict(state, strict=True)
    for key, spec in specs.items():
        set_spec(model, key, spec)
    for key, target in manifest.get("aliases", {}).items():
        if target in specs:
            set_spec(model, key, specs[target])
    named, loose = dict(model.named_buffers(remove_duplicate=False)), non_persistent_buffers(model)
    with torch.no_grad():
        for name, value in buffers.items():
            if name not in named:
                raise ValueError(f"{path}: the saved buffer {name!r} is not in the model build_fn builds")
            if name in loose:  # files of older versions also hold buffers the state_dict carries in its own form
                loose[name].copy_(value)
    prepare_plans_under(model)  # ready to compile: traced code reads the plans, it does not make them
    return model


def _install(model: nn.Module, holder: dict, tt: TTMatrix) -> None:
    path = holder["path"]
    module = model.get_submodule(path)
    if holder["type"] == "property":
        if isinstance(module._modules.get(f"{holder['attr']}_tt"), TTMatrix):
            return  # one module registered under two names: done at its first name
        attach_tt_property(module, holder["attr"], tt, transposed=holder["transposed"])
        return
    if holder["type"] == "linear":
        new: nn.Module = TTLinear(tt, None, transposed=holder["transposed"])
        new.bias = getattr(module, "bias", None)
    elif holder["type"] == "embedding":
        new = TTEmbedding(tt, holder["padding_idx"], None)
    else:
        raise ValueError(f"unknown TT holder type {holder['type']!r} in the manifest")
    new.train(module.training)
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path), child, new)


def _cast_to_saved_dtypes(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Give every parameter and buffer the dtype it was saved with (build_fn builds in the default dtype)."""
    for name, param in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        saved = state.get(name)
        if saved is not None and saved.dtype != param.dtype and saved.is_floating_point():
            param.data = param.data.to(saved.dtype)
