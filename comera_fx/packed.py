"""Small where it runs: linear layers held as int8 / int4 codes in memory, not as fp32 weights on a grid.

``quantize_`` / ``apply_formats_`` round a weight onto a grid but keep it in fp32 (4 bytes a weight in RAM for a
weight stored in 1 or ½). ``PackedLinear`` holds only the codes (int8; int4 two to a byte) and one fp32 scale per
group, and rebuilds the fp32 weight of one layer at a time inside its forward (freed after the GEMM).

Why not torch's int kernels: ``aten._weight_int4pack_mm_for_cpu`` and ``aten._weight_int8pack_mm`` exist in the
pinned torch 2.13 CPU build, give exactly these products, and were measured 6-74x slower than the fp32 GEMM with
fp32 activations on this project's 2-core machine (benchmarks/history/2026-12-05-issue-46.md); unpacking the codes
and calling the fp32 GEMM costs 1.07x the fp32 layer at 2048 rows and 1.6-2.2x at 8. torchao was not used: 0.18.0
imports against the pinned torch, but its int4 weight-only path needs a further package (``mslk``). The module keeps
one code path so that a faster kernel can replace ``forward`` alone.

The grid is ``comera_fx.quantize``'s: row-major groups of ``group_size`` weights with symmetric codes. A group that
divides the input width is a group of input features of one output channel; a group that is a multiple of it spans
whole rows (one scale per row, repeated). Other group sizes are refused.

``state_dict`` holds the portable form (the codes as ``comera_fx.quantize.pack`` stores them, the scales per group),
so ``save_tensorized`` / ``load_tensorized`` keep the layer packed (never building the fp32 weight on load).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantize import SPEC_ATTR, QuantSpec, dequantize, pack, quantize_groups, unpack

SCALES_SUFFIX = "weight_scales"


def kernel_group(spec: QuantSpec, rows: int, cols: int) -> int:
    """Input features per scale within a row for ``spec`` on a rows × cols weight; ValueError if groups straddle
    rows unevenly (int4 also needs an even number of input features)."""
    group = rows * cols if spec.group_size is None else spec.group_size
    if group % cols and cols % group:
        raise ValueError(
            f"a group of {group} weights neither divides nor spans whole rows of {cols} input "
            f"features: no packed layout; use a group size that divides {cols}"
        )
    if spec.bits == 4 and cols % 2:
        raise ValueError(f"int4 codes go two to a byte along a row: {cols} input features is odd")
    return min(group, cols)


def _row_scales(scales: Tensor, spec: QuantSpec, rows: int, cols: int, kgroup: int) -> Tensor:
    """The scales as (rows, cols // kgroup): one per group of each row (repeated where a group spans rows)."""
    group = rows * cols if spec.group_size is None else spec.group_size
    start = torch.arange(rows)[:, None] * cols + torch.arange(0, cols, kgroup)[None, :]  # first weight of each
    return scales[start // group].float()


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W held as int8 / int4 codes and fp32 scales: exactly the weights
    ``fake_quant(W, bits, group_size)`` gives, in 1 or ½ byte each (plus the scales). Inference only: the codes are
    buffers, not parameters."""

    def __init__(
        self, in_features: int, out_features: int, spec: QuantSpec, bias: bool = True, device=None, dtype=None
    ):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.kgroup = kernel_group(spec, out_features, in_features)
        width = in_features if spec.bits == 8 else in_features // 2
        self.register_buffer(
            "codes",
            torch.empty(out_features, width, device=device, dtype=torch.int8 if spec.bits == 8 else torch.uint8),
        )
        self.register_buffer("scales", torch.empty(out_features, in_features // self.kgroup, device=device))
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
        device = self.codes.device
        self.scales = _row_scales(scales.reshape(-1).cpu(), spec, rows, cols, self.kgroup).to(device)
        if spec.bits == 8:
            self.codes = grid.contiguous().to(device)
        else:
            nibbles = (grid.to(torch.int16) + 8).to(torch.uint8)
            self.codes = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous().to(device)

    def stored(self) -> tuple[Tensor, Tensor]:
        """(``pack``'s stored codes, fp32 scales per group of ``spec``): the portable form."""
        codes, scales = quantize_groups(self.dequantized(), self.spec)
        return pack(codes, self.spec.bits), scales

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight these codes stand for (out × in): what ``forward`` multiplies by."""
        rows, cols = self.out_features, self.in_features
        if self.spec.bits == 8:
            grid = self.codes.to(dtype)
        else:
            grid = torch.stack([self.codes & 0xF, self.codes >> 4], -1).reshape(rows, cols).to(dtype).sub_(8)
        grid = grid.reshape(rows, -1, self.kgroup).mul_(self.scales.to(dtype)[..., None])
        return grid.reshape(rows, cols)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def nbytes(self) -> int:
        """Bytes held in memory by the codes and scales (the resident size of the weight)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    # ---- state_dict: the portable form

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        codes, scales = self.stored()
        destination[prefix + "weight"] = codes
        destination[prefix + SCALES_SUFFIX] = scales
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
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
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int{self.spec.bits} "
            f"group {self.spec.group_size}, bias={self.bias is not None}"
        )


def packable(module: nn.Module) -> QuantSpec | None:
    """The grid of an ``nn.Linear`` whose weight ``quantize_`` recorded and whose groups fit its rows, else None."""
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
    whose groups do not fit their rows (they stay fake-quantized fp32). Inference only: pack after training. A weight
    shared with another module (tied) is left as it is."""
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
    return dequantize(
        unpack(codes, spec.bits, math.prod(shape)) if codes.dtype == torch.uint8 else codes,
        scales,
        spec,
        tuple(shape),
        torch.float64,
    )


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
    }


def install_packed(model: nn.Module, entries: dict[str, dict]) -> None:
    """Swap the modules at the manifest's paths for (unallocated) ``PackedLinear`` s; the state fills them."""
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
