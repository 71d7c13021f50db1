"""Small where it runs: linear layers held as int8 / int4 codes in memory and multiplied by torch's int kernels.

``quantize_`` / ``apply_formats_`` round a weight onto a grid but keep it in fp32 (4 bytes a weight in RAM for a
weight stored in 1 or ½). ``PackedLinear`` holds only the codes and scales and runs ``aten._weight_int8pack_mm``
(int8, one scale per output channel) or ``aten._weight_int4pack_mm_for_cpu`` (int4, one scale per group of input
features). torchao was not used: no release installs against the pinned torch 2.13 CPU build, and these aten ops
are what its CPU int4 / int8 weight-only paths call.

The grid is ``comera_fx.quantize``'s: row-major groups of ``group_size`` weights with symmetric codes. A group that
divides the input width is a group of input features of one output channel; a group that is a multiple of it spans
whole rows (one scale per row, repeated). Other group sizes have no kernel layout and are refused.

``state_dict`` holds the portable form (the codes as ``comera_fx.quantize.pack`` stores them, the scales per group),
not the kernel's tiled layout, so a saved model loads on any CPU; ``save_tensorized`` / ``load_tensorized`` keep the
layer packed (never building the fp32 weight).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .quantize import SPEC_ATTR, QuantSpec, dequantize, pack, quantize_groups, unpack

INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes _weight_int4pack_mm_for_cpu takes, largest first
SCALES_SUFFIX = "weight_scales"


def kernel_group(spec: QuantSpec, rows: int, cols: int) -> int:
    """The kernel's group (input features per scale) for ``spec`` on a rows × cols weight; ValueError if none."""
    group = rows * cols if spec.group_size is None else spec.group_size
    if group % cols and cols % group:
        raise ValueError(f"a group of {group} weights neither divides nor spans whole rows of {cols} input "
                         f"features: no int kernel layout; use a group size that divides {cols}")
    if spec.bits == 8:
        return min(group, cols)
    if rows % 16:
        raise ValueError(f"int4 kernels need a multiple of 16 output features, got {rows}; keep this layer int8 "
                         f"or fake-quantized")
    span = math.gcd(group, cols)
    found = next((g for g in INT4_KERNEL_GROUPS if span % g == 0), None)
    if found is None:
        raise ValueError(f"int4 kernels take groups of {INT4_KERNEL_GROUPS} input features; a group of {group} "
                         f"weights over {cols} features has none that divides it")
    return found


def _row_scales(scales: Tensor, spec: QuantSpec, rows: int, cols: int, kgroup: int) -> Tensor:
    """The scales as (rows, cols // kgroup): one per kernel group of each row (repeated where a group is larger)."""
    group = rows * cols if spec.group_size is None else spec.group_size
    start = torch.arange(rows)[:, None] * cols + torch.arange(0, cols, kgroup)[None, :]  # first weight of each
    return scales[start // group].float()


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W held as int8 / int4 codes and fp32 scales: exactly the weights
    ``fake_quant(W, bits, group_size)`` gives, in 1 or ½ byte each (plus the scales), through int kernels.
    Inference only: the codes are buffers, not parameters."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.kgroup = kernel_group(spec, out_features, in_features)
        groups = in_features // self.kgroup
        if spec.bits == 8:
            self.register_buffer("codes", torch.empty(groups, out_features, self.kgroup, dtype=torch.int8,
                                                      device=device))
            self.register_buffer("scales", torch.empty(groups, out_features, device=device))
        else:
            self.register_buffer("codes", torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                      device=device))
            self.register_buffer("scales", torch.empty(groups, out_features, 2, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, spec: QuantSpec, shape, bias: Tensor | None = None):
        """From ``quantize_groups``' int8 codes (or ``pack``'s stored form) and per-group scales of a weight."""
        rows, cols = shape
        layer = cls(cols, rows, spec, bias is not None, device="cpu")
        layer._set_codes(codes, scales)
        if bias is not None:
            layer.bias.data = bias.detach().float().clone()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> "PackedLinear":
        """``linear`` rounded onto ``spec``'s grid and packed (its weight already on the grid stays bit for bit)."""
        codes, scales = quantize_groups(linear.weight.detach().float().cpu(), spec)
        return cls.from_codes(codes, scales, spec, tuple(linear.weight.shape), linear.bias)

    def _set_codes(self, codes: Tensor, scales: Tensor) -> None:
        rows, cols, spec = self.out_features, self.in_features, self.spec
        if codes.dtype == torch.uint8 or codes.numel() != rows * cols:  # pack's stored form
            codes = unpack(codes, spec.bits, rows * cols)
        grid = codes.reshape(rows, cols)
        per_group = _row_scales(scales.reshape(-1).cpu(), spec, rows, cols, self.kgroup).to(self.scales.device)
        if spec.bits == 8:
            self.codes = grid.reshape(rows, -1, self.kgroup).transpose(0, 1).contiguous().to(self.codes.device)
            self.scales = per_group.t().contiguous()
        else:
            nibbles = (grid.to(torch.int32) + 8).contiguous()
            self.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1).to(self.codes.device)
            self.scales = torch.stack([per_group.t(), torch.zeros_like(per_group.t())], -1).contiguous()

    def stored(self) -> tuple[Tensor, Tensor]:
        """(``pack``'s stored codes, fp32 scales per group of ``spec``): the portable form."""
        weight = self.dequantized()
        codes, scales = quantize_groups(weight, self.spec)
        return pack(codes, self.spec.bits), scales

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight these codes stand for (out × in), computed from the kernel layout (a test reference)."""
        if self.spec.bits == 8:
            return (self.codes.to(dtype) * self.scales.to(dtype)[..., None]).transpose(0, 1).reshape(
                self.out_features, self.in_features)
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.codes.device)
        unit = self.scales.clone()
        unit[..., 0] = 1.0
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.codes, self.kgroup, unit).t()  # (q - 8) exactly
        scales = self.scales[..., 0].t().repeat_interleave(self.kgroup, 1)
        return (codes.to(dtype) * scales.to(dtype)).contiguous()

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if self.spec.bits == 4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.codes, self.kgroup, self.scales)
        elif self.codes.shape[0] == 1:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes[0], self.scales[0])
        else:
            parts = flat.reshape(flat.shape[0], -1, self.kgroup)
            out = sum(torch.ops.aten._weight_int8pack_mm(parts[:, g].contiguous(), self.codes[g], self.scales[g])
                      for g in range(self.codes.shape[0]))
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        """Bytes held in memory by the codes and scales (the resident size of the weight)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    # ---- state_dict: the portable form, so that a file saved on one CPU loads on another

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        codes, scales = self.stored()
        destination[prefix + "weight"] = codes
        destination[prefix + SCALES_SUFFIX] = scales
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for key in ("weight", SCALES_SUFFIX) + (("bias",) if self.bias is not None else ()):
            if prefix + key not in state_dict:
                missing_keys.append(prefix + key)
        if prefix + "weight" in state_dict and prefix + SCALES_SUFFIX in state_dict:
            with torch.no_grad():
                self._set_codes(state_dict[prefix + "weight"], state_dict[prefix + SCALES_SUFFIX])
        if self.bias is not None and prefix + "bias" in state_dict:
            with torch.no_grad():
                self.bias.copy_(state_dict[prefix + "bias"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.spec.bits} "
                f"group {self.spec.group_size} (kernel group {self.kgroup}), bias={self.bias is not None}")


def packable(module: nn.Module) -> QuantSpec | None:
    """The grid of an ``nn.Linear`` whose weight ``quantize_`` recorded and an int kernel can run, else None."""
    if type(module) is not nn.Linear:
        return None
    spec = getattr(module, SPEC_ATTR, {}).get("weight")
    if spec is None:
        return None
    try:
        kernel_group(spec, module.out_features, module.in_features)
    except ValueError:
        return None
    return spec


@torch.no_grad()
def pack_linears_(model: nn.Module) -> dict[str, str]:
    """Swap every ``nn.Linear`` whose weight ``quantize_`` / ``apply_formats_`` put on an int grid for a
    ``PackedLinear`` holding the same values as codes; returns {module path: why it stayed} for quantized linears
    that no int kernel runs (they stay fake-quantized fp32). Inference only: pack after training. A weight shared
    with another module (tied) is left as it is."""
    counts: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
    left, swaps = {}, []
    for path, module in model.named_modules():
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
        swaps.append((path, module, spec))
    for path, module, spec in swaps:
        packed = PackedLinear.from_linear(module, spec).to(module.weight.device)
        packed.train(module.training)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, packed)
    return left


def packed_modules(model: nn.Module) -> dict[str, PackedLinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, PackedLinear)}


def reference_weight(codes: Tensor, scales: Tensor, spec: QuantSpec, shape) -> Tensor:
    """The float64 weight of stored codes and scales (``comera_fx.quantize.dequantize``), for tests and checks."""
    return dequantize(unpack(codes, spec.bits, math.prod(shape)) if codes.dtype == torch.uint8 else codes,
                      scales, spec, tuple(shape), torch.float64)


# ---- save_tensorized / load_tensorized


def packed_manifest(model: nn.Module) -> dict[str, dict]:
    """{path: its grid and shape} of every ``PackedLinear`` (the manifest entry ``load_tensorized`` rebuilds)."""
    return {path: {"bits": m.spec.bits, "group_size": m.spec.group_size, "in": m.in_features,
                   "out": m.out_features, "bias": m.bias is not None} for path, m in packed_modules(model).items()}


def install_packed(model: nn.Module, entries: dict[str, dict]) -> None:
    """Swap the modules at the manifest's paths for (unallocated) ``PackedLinear`` s; the state fills them."""
    for path, e in entries.items():
        old = model.get_submodule(path)
        new = PackedLinear(e["in"], e["out"], QuantSpec(e["bits"], e["group_size"]), e["bias"],
                           device=next(old.parameters(), torch.empty(0)).device)
        new.train(old.training)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def packed_from_quantized(model: nn.Module, manifest: dict, tensors: dict[str, Tensor], scale_prefix: str) -> None:
    """``load_tensorized(pack=True)``: turn each saved quantized ``nn.Linear`` weight an int kernel runs into a
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
        packed[path] = {"bits": spec.bits, "group_size": spec.group_size, "in": module.in_features,
                        "out": module.out_features, "bias": module.bias is not None}
        tensors[f"{path}.{SCALES_SUFFIX}"] = tensors.pop(scale_prefix + key)
        del quantized[key]
