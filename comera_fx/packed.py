"""Small where it runs: linear layers held as int8 / int4 codes in memory, not as fp32 weights on a grid.

``quantize_`` / ``apply_formats_`` round a weight onto a grid but keep it in fp32 (4 bytes a weight in RAM for a
weight stored in 1 or ½). ``PackedLinear`` holds only the codes (int8; int4 two to a byte) and one fp32 scale per
group, and rebuilds the fp32 weight of one layer at a time inside its forward, in eager inference into one buffer
per thread that every layer shares (``REUSE_WORKSPACE``; its size is the largest layer's fp32 weight).

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

``PackedTTLinear`` does the same for a ``TTLinear`` whose cores ``quantize_`` put on a grid: each core is held as
its stored codes and scales (exactly the bytes ``save_tensorized`` writes for it), the cores are dequantized on each
call (they are small: a rank-64 TT layer of MiniLM's 384 x 384 attention has 57 k core weights, the dense one 147 k),
all cores in one pass when they share a grid and whole groups, and the product runs the planner's inference plan,
as ``TTLinear`` does. It never uses ``tt.merged``'s cached fp32 forms, which would hold fp32 factors larger than the
codes.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantize import SPEC_ATTR, QuantSpec, dequantize, pack, quantize_groups, unpack
from .tt import ops
from .tt import plan as planner
from .tt.layers import TTLinear, TTMatrix, choose_plan, planned_envelope
from .tt.layout import TTLayout

SCALES_SUFFIX = "weight_scales"

#: Rebuild each layer's fp32 weight in one buffer per thread (dtype, device) that all ``PackedLinear`` s share,
#: grown to the largest layer, in eager calls that record no gradient. Why: a fresh 2.4 MB allocation per call
#: came back as fresh pages, and the GEMM reading them ran 2.3x slower than from a reused buffer at 18 tokens
#: (1.59 against 0.65 ms, fp32 weight 0.70 ms; benchmarks/history/2026-12-05-issue-46-session2.md). The buffer is
#: the same peak memory a call needs anyway, kept between calls: ``workspace_bytes()`` reports it.
REUSE_WORKSPACE = True
_WORKSPACE = threading.local()


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    held = buffers.get((dtype, device))
    if held is None or held.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in place both inside and outside inference mode
            held = buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return held[:numel]


def workspace_bytes() -> int:
    """Bytes of this thread's shared ``PackedLinear`` workspaces (0 before any eager call)."""
    return sum(t.numel() * t.element_size() for t in _WORKSPACE.__dict__.get("buffers", {}).values())


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
        else:  # in memory, byte j of a row holds input features j (low nibble) and j + in/2 (high nibble)
            nibbles, half = (grid.to(torch.int16) + 8).to(torch.uint8), cols // 2
            self.codes = (nibbles[:, :half] | (nibbles[:, half:] << 4)).contiguous().to(device)

    def stored(self) -> tuple[Tensor, Tensor]:
        """(``pack``'s stored codes, fp32 scales per group of ``spec``): the portable form."""
        codes, scales = quantize_groups(self.dequantized(), self.spec)
        return pack(codes, self.spec.bits), scales

    def _unsigned_grid(self, dtype: torch.dtype, shared: bool = False) -> Tensor:
        """The codes as floats (out × in), unscaled; int4 codes + 8 (0..15: ``forward`` takes the 8 off the
        product, not off every weight). ``shared``: written into the thread's workspace (valid until the next
        call)."""
        rows, cols = self.out_features, self.in_features
        if shared:
            grid = _workspace(rows * cols, dtype, self.codes.device).view(rows, cols)
        else:
            grid = self.codes.new_empty((rows, cols), dtype=dtype)
        if self.spec.bits == 8:
            return grid.copy_(self.codes) if shared else self.codes.to(dtype)
        half = cols // 2
        grid[:, :half] = self.codes & 0xF
        grid[:, half:] = self.codes >> 4
        return grid

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight these codes stand for (out × in): ``forward``'s product is ``x`` times its transpose."""
        rows, cols = self.out_features, self.in_features
        grid = self._unsigned_grid(dtype)
        if self.spec.bits == 4:
            grid = grid.sub_(8)
        grid = grid.reshape(rows, -1, self.kgroup).mul_(self.scales.to(dtype)[..., None])
        return grid.reshape(rows, cols)

    def forward(self, x: Tensor) -> Tensor:
        """``x Wᵀ + b``. With fewer tokens than 2/3 of the input width (the output smaller than the weight), one
        pass over the weight: the codes converted to floats (int4: kept as code + 8), one scale per output channel
        applied to the output instead of the weight, int4's offset taken off the output as ``8 · (x's sum over each
        group) · scales``, a (tokens × groups) by (groups × out) product. With more, and when compiled or exported,
        the weight is finished (offset, scales) and the bias rides in the GEMM."""
        rows, cols, scales = self.out_features, self.in_features, self.scales.to(x.dtype)
        shared = (
            REUSE_WORKSPACE
            and not torch.compiler.is_compiling()
            and type(x) is torch.Tensor
            and not (torch.is_grad_enabled() and x.requires_grad)
        )
        grid = self._unsigned_grid(x.dtype, shared)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # the output is the larger operand: finish the weight, not it (always when traced: a size test is a guard)
        if torch.compiler.is_compiling() or 3 * (x.numel() // cols) >= 2 * cols:
            if self.spec.bits == 4:
                grid = grid.sub_(8)
            grid = grid.reshape(rows, -1, self.kgroup).mul_(scales[..., None]).reshape(rows, cols)
            return F.linear(x, grid, bias)
        per_row = self.kgroup == cols
        if not per_row:
            grid = grid.reshape(rows, -1, self.kgroup).mul_(scales[..., None]).reshape(rows, cols)
        out = F.linear(x, grid)
        if self.spec.bits == 4:
            sums = x.sum(-1, keepdim=True) if per_row else x.unflatten(-1, (-1, self.kgroup)).sum(-1)
            out = out - 8 * (sums if per_row else sums @ scales.t())
        if per_row:
            out = out * scales[:, 0]
        return out if bias is None else out + bias

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


def _codes_width(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def dequantize_stored(codes: Tensor, scales: Tensor, spec: QuantSpec, shape, dtype: torch.dtype) -> Tensor:
    """The tensor of ``shape`` that ``pack``'s stored codes and the scales per group stand for, in ``dtype``: the
    same values as ``comera_fx.quantize.dequantize`` (the same products, so bit for bit), in a few traceable ops
    (bit masks, not ``unpack``'s int16 round trip)."""
    numel = math.prod(shape)
    if spec.bits == 8:
        grid = codes.to(dtype)
    else:
        grid = torch.stack([codes & 0xF, codes >> 4], -1).reshape(-1).to(dtype) - 8
    size = max(numel, 1) if spec.group_size is None else spec.group_size
    whole = numel + (-numel) % size
    grid = grid[:whole] if grid.numel() >= whole else F.pad(grid, (0, whole - grid.numel()))
    return (grid.reshape(-1, size) * scales.to(dtype)[:, None]).reshape(-1)[:numel].reshape(shape)


class PackedTTLinear(nn.Module):
    """``TTLinear`` with each core held as int8 / int4 codes (``pack``'s stored form) and fp32 scales per group,
    dequantized on each call: exactly the cores ``quantize_`` left in fp32, in their stored bytes. The gates (one
    fp32 value per rank) and the bias stay float. Inference only: codes, scales and gates are buffers.

    The product runs the planner's forward-only plan for the batch size (``planned_envelope(...,
    backward=False)``), pinned at construction, so the module compiles and exports (``comera_fx.export`` pins one
    plan per range through ``tt.layers.choose_plan``) without planning inside a trace."""

    def __init__(
        self,
        layout: TTLayout,
        specs,
        bias: bool = True,
        *,
        transposed: bool = False,
        device=None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        specs = tuple(specs)
        if len(specs) != len(layout.core_shapes):
            raise ValueError(f"{len(specs)} grids for {len(layout.core_shapes)} cores")
        self.layout, self.specs, self.transposed, self.dtype = layout, specs, transposed, dtype
        # All cores' stored codes end to end in one byte buffer (int8 codes viewed as bytes), their scales in one
        # fp32 buffer: one unpack per call for all cores when their groups line up (``_aligned``).
        self._spans, code_at, scale_at, value_at = [], 0, 0, 0
        for shape, spec in zip(layout.core_shapes, specs):
            numel = math.prod(shape)
            width, groups = _codes_width(numel, spec.bits), spec.groups(numel)
            self._spans.append((code_at, code_at + width, scale_at, scale_at + groups, value_at, shape, spec))
            code_at, scale_at, value_at = code_at + width, scale_at + groups, value_at + numel
        unit = [s.group_size * (2 if s.bits == 4 and s.group_size % 2 else 1) for s in specs if s.group_size]
        self._aligned = (
            len(set(specs)) == 1
            and len(unit) == len(specs)
            and all(math.prod(shape) % unit[0] == 0 for shape in layout.core_shapes)
        )
        self.register_buffer("codes", torch.empty(code_at, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(scale_at, device=device))
        for k, rank in enumerate(layout.internal_ranks):
            self.register_buffer(f"gates_{k}", torch.empty(rank, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)) if bias else None
        self._plan()

    @property
    def op(self) -> str:
        return "matmul_t" if self.transposed else "matmul"

    @property
    def in_features(self) -> int:
        return self.layout.cols if self.transposed else self.layout.rows

    @property
    def out_features(self) -> int:
        return self.layout.rows if self.transposed else self.layout.cols

    @property
    def stored_empty(self) -> bool:
        return any(math.prod(shape) == 0 for shape in self.layout.core_shapes)

    def _plan(self) -> None:
        """Pin the forward-only plans for the device the codes are on (its launch cost chooses them)."""
        if self.stored_empty:
            self._pins = {}
            return
        self._pins = {self.op: planned_envelope(self.layout, self.op, device=self.codes.device, backward=False)}

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to``, ``.cuda``, ...), then the plans pinned again for the codes' new device."""
        moved = super()._apply(fn, recurse)
        if hasattr(self, "_pins"):  # not while __init__ registers the buffers
            self._plan()
        return moved

    @classmethod
    def from_tt_linear(cls, linear: TTLinear, specs=None) -> "PackedTTLinear":
        """``linear``'s cores rounded onto ``specs`` (default: the grids ``quantize_`` recorded) and packed; cores
        already on their grid are kept bit for bit. The stored (possibly wider, zero-gated) cores are packed as
        they are."""
        tt = linear.tt
        specs = tuple(specs) if specs is not None else tt_core_specs(tt)
        if specs is None or None in specs:
            raise ValueError("every TT core needs a grid (quantize_ the TT matrix first, or pass specs)")
        cores = [c.detach() for c in tt._stored_cores()]
        layer = cls(
            tt.layout,
            specs,
            linear.bias is not None,
            transposed=linear.transposed,
            device=cores[0].device,
            dtype=cores[0].dtype,
        )
        with torch.no_grad():
            for k, (core, spec) in enumerate(zip(cores, specs)):
                codes, scales = quantize_groups(core, spec)
                layer.core_codes(k).copy_(pack(codes, spec.bits))
                layer.core_scales(k).copy_(scales)
            for k, gate in enumerate(tt._stored_gates()):
                getattr(layer, f"gates_{k}").copy_(gate.detach())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        layer.train(linear.training)
        return layer

    def core_codes(self, k: int) -> Tensor:
        """Core ``k``'s stored codes (``pack``'s form: int8, or uint8 two to a byte): a view of ``codes``."""
        start, end, *_, spec = self._spans[k]
        codes = self.codes[start:end]
        return codes.view(torch.int8) if spec.bits == 8 else codes

    def core_scales(self, k: int) -> Tensor:
        """Core ``k``'s scales, one per group: a view of ``scales``."""
        _, _, start, end, *_ = self._spans[k]
        return self.scales[start:end]

    def cores(self, dtype: torch.dtype | None = None) -> list[Tensor]:
        """The cores the codes stand for (ungated), in ``dtype`` (default: the cores' saved dtype)."""
        dtype = dtype or self.dtype
        if not self._aligned:
            return [
                dequantize_stored(self.core_codes(k), self.core_scales(k), span[-1], span[-2], dtype)
                for k, span in enumerate(self._spans)
            ]
        spec = self.specs[0]  # every core on one grid, whole groups: unpack all cores at once, then cut
        flat = dequantize_stored(
            self.codes.view(torch.int8) if spec.bits == 8 else self.codes,
            self.scales,
            spec,
            (self._spans[-1][4] + math.prod(self._spans[-1][5]),),
            dtype,
        )
        return [flat[at : at + math.prod(shape)].view(shape) for *_, at, shape, _ in self._spans]

    def gates(self) -> list[Tensor]:
        return [getattr(self, f"gates_{k}") for k in range(len(self.layout.internal_ranks))]

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The dense (out × in) weight: for checks, not for the hot path."""
        dtype = dtype or self.dtype
        gates = [g.to(dtype) for g in self.gates()]
        dense = ops.to_dense(ops.gate_cores(self.cores(dtype), gates, self.layout), self.layout)
        return dense if self.transposed else dense.t()

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.stored_empty:
            out = x[..., :0] @ x.new_zeros(0, self.out_features)
            return out if bias is None else out + bias
        gates = [g.to(x.dtype) for g in self.gates()]
        cores = ops.gate_cores(self.cores(x.dtype), gates, self.layout)
        envelope = self._pins.get(self.op)
        if envelope is None:  # a module whose pins were dropped and not remade (never in normal use)
            envelope = planned_envelope(self.layout, self.op, device=x.device, backward=False)
        chosen = choose_plan(envelope, x.numel() // self.in_features)
        return planner.execute(chosen, x, cores, self.layout, bias)

    def nbytes(self) -> int:
        """Bytes held in memory by the codes and scales: the cores' stored bytes (gates and bias not counted, as
        ``comera_fx.quantize.stored_bytes`` does not count them)."""
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    # ---- state_dict: per core, as save_tensorized stores a TT matrix's quantized cores

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        del destination[prefix + "codes"], destination[prefix + "scales"]
        for k in range(len(self._spans)):
            destination[f"{prefix}codes_{k}"] = self.core_codes(k).detach()
            destination[f"{prefix}scales_{k}"] = self.core_scales(k).detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        keys = [f"{prefix}{kind}_{k}" for k in range(len(self._spans)) for kind in ("codes", "scales")]
        if all(key in state_dict for key in keys):
            with torch.no_grad():
                for k in range(len(self._spans)):
                    self.core_codes(k).copy_(state_dict.pop(f"{prefix}codes_{k}"))
                    self.core_scales(k).copy_(state_dict.pop(f"{prefix}scales_{k}"))
            state_dict[prefix + "codes"], state_dict[prefix + "scales"] = self.codes, self.scales
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def manifest_entry(self) -> dict:
        layout = self.layout
        return {
            **layout.to_json(),
            "specs": [[s.bits, s.group_size] for s in self.specs],
            "bias": self.bias is not None,
            "transposed": self.transposed,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def from_manifest_entry(cls, e: dict, device=None) -> "PackedTTLinear":
        layout = TTLayout.from_json(e)
        specs = [QuantSpec(bits, group) for bits, group in e["specs"]]
        return cls(
            layout, specs, e["bias"], transposed=e["transposed"], device=device, dtype=getattr(torch, e["dtype"])
        )

    def __getstate__(self):
        state = super().__getstate__()
        state["_pins"] = {}  # planner objects: a copy or a loaded module plans its own
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._plan()

    def extra_repr(self) -> str:
        bits = sorted({f"int{s.bits} group {s.group_size}" for s in self.specs})
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.layout.ranks}, "
            f"cores {', '.join(bits)}, bias={self.bias is not None}"
        )


def tt_core_specs(tt: TTMatrix) -> tuple[QuantSpec | None, ...]:
    """The grid ``quantize_`` recorded for each core of ``tt`` (None where a core has none)."""
    recorded = getattr(tt.cores, SPEC_ATTR, {})
    return tuple(recorded.get(str(k)) for k in range(len(tt.cores)))


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
