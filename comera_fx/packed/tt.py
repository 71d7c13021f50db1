"""``PackedTTLinear``: a ``TTLinear`` whose cores are held as int8 / int4 codes and fp32 scales per group."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quantize import SPEC_ATTR, QuantSpec, pack, quantize_groups
from ..tt import ops
from ..tt import plan as planner
from ..tt.layers import TTLinear, TTMatrix
from ..tt.plan_cache import choose_plan, planned_envelope
from ..tt.layout import TTLayout
from . import cpu_kernel, workspace
from .linear import low_precision


#: The fewest rows (tokens) a call needs for a ``PackedTTLinear``'s ``compute_dtype`` to apply (``PackedLinear``'s
#: is ``linear.LOW_PRECISION_MIN_ROWS``). Why: a rank-96 low-rank 384 x 384 layer with int4 cores ran 1.83x slower
#: in bf16 at 13 tokens, 1.21x at 128, 1.04x at 256, 0.89x at 384, 0.72x at 640 (its cores are small, its casts
#: and two skinny GEMMs are not; benchmarks/history/2026-12-06-issue-46-session9.md).
LOW_PRECISION_MIN_ROWS = 384

#: The core grids ``PackedTTLinear`` lays out: their stored form (two int4 codes a byte) is its buffer.
PACKED_CORE_BITS = (8, 4)


def _versions(tensors) -> tuple | None:
    """Where each tensor's storage is and how often it was written in place; None for inference tensors (they keep
    no version counter)."""
    try:
        return tuple((t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None


def fold_gates_into_scales(scales: Tensor, gates, spans, group: int) -> tuple[Tensor, tuple[int, ...]]:
    """(scales with each gate multiplied into the next core's groups, the bonds whose gate is not folded in).

    Gate k weighs core k+1's first index; where each of core k+1's groups lies within one first index (its
    other indices' count is a multiple of ``group``), gate k times those groups' scales gives the gated core
    from the codes in the same pass that dequantizes them. Other gates stay a product over that core."""
    folded, left = scales.clone(), []
    for k, gate in enumerate(gates):
        _, _, start, end, _, shape, _ = spans[k + 1]
        per_index = math.prod(shape) // shape[0]
        if per_index % group:
            left.append(k)
            continue
        folded[start:end].view(shape[0], -1).mul_(gate.to(folded.dtype)[:, None])
    return folded, tuple(left)


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

    #: The dtype the cores and the product run in (``set_compute_dtype_``); None: the input's. Not saved.
    compute_dtype: torch.dtype | None = None

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
        if any(spec.bits not in PACKED_CORE_BITS for spec in specs):
            raise ValueError(
                f"PackedTTLinear holds int8 / int4 cores, got int{min(s.bits for s in specs)}: keep the TTLinear "
                "(its cores stay on their grid in fp32) or quantize_ the cores to 4 or 8 bits"
            )
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
        buffers = self._buffers  # not getattr: nn.Module's lookup is a few microseconds a name, on the hot path
        return [buffers[f"gates_{k}"] for k in range(len(self.layout.internal_ranks))]

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The dense (out × in) weight: for checks, not for the hot path."""
        dtype = dtype or self.dtype
        gates = [g.to(dtype) for g in self.gates()]
        dense = ops.to_dense(ops.gate_cores(self.cores(dtype), gates, self.layout), self.layout)
        return dense if self.transposed else dense.t()

    def _folded(self) -> tuple[Tensor, tuple[int, ...]]:
        """``fold_gates_into_scales`` of the held scales and gates, made again when either was written."""
        gates = self.gates()
        key = _versions([self._buffers["scales"], *gates])
        kept = self.__dict__.get("_folded_scales")
        if key is None or kept is None or kept[0] != key:
            spec = self.specs[0]
            kept = (key, *fold_gates_into_scales(self.scales, gates, self._spans, spec.group_size))
            self.__dict__["_folded_scales"] = kept
        return kept[1], kept[2]

    def _dequantizer(self, dtype: torch.dtype, total: int):
        """``cpu_kernel``'s library where it dequantizes all cores in one pass (fp32 on the CPU, groups and the
        cores' total a multiple of 16), else None."""
        group = self.specs[0].group_size
        if dtype != torch.float32 or self.codes.device.type != "cpu" or group % 16 or total % 16:
            return None
        if not self.codes.is_contiguous():
            return None
        return cpu_kernel.library()

    def _low_rank_kernel(self, x: Tensor):
        """``cpu_kernel``'s library where this eager call runs as two of its dense products: a low-rank layer (two
        cores, (1, in, r) and (r, out, 1), not transposed, r(in + out) <= in out so the chain is the cheap order
        at every batch), r and out multiples of 16, fp32 on the CPU, the cores dequantized by the kernel. Why: at
        13 tokens the planner's path (two MKL GEMMs and its reshapes) took 100 us for a rank-96 384 x 384 layer,
        whose dense product takes 63 (benchmarks/history/2026-12-07-issue-46-session10.md)."""
        shapes = self.layout.core_shapes
        if len(shapes) != 2 or any(len(shape) != 3 for shape in shapes) or self.transposed:
            return None
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        (one, inputs, rank), (_, outputs, last) = shapes
        if one != 1 or last != 1 or (inputs, outputs) != (self.in_features, self.out_features):  # no padded modes
            return None
        if rank % 16 or outputs % 16 or rank * (inputs + outputs) > inputs * outputs:
            return None
        return self._dequantizer(x.dtype, inputs * rank + rank * outputs)

    def _forward_low_rank(self, lib, x: Tensor) -> Tensor:
        """``forward`` of a low-rank layer as x A B (+ bias) by ``cpu_kernel.dense_product`` on the gated cores in
        the shared workspace (``_gated_cores_shared``); the bias in the kernel unless autograd records it."""
        (_, inputs, rank), (_, outputs, _) = self.layout.core_shapes
        first, second = self._gated_cores_shared(torch.float32)
        inside, after = cpu_kernel.split_bias(self.bias)
        x2 = x.reshape(-1, inputs).contiguous()
        hidden = cpu_kernel.dense_product(lib, x2, first.view(inputs, rank))
        out = cpu_kernel.dense_product(lib, hidden, second.view(rank, outputs), inside)
        out = out.view(x.shape[:-1] + (outputs,))
        return out if after is None else out + after

    def _gated_cores_shared(self, dtype: torch.dtype) -> list[Tensor]:
        """The gated cores, dequantized into the thread's shared workspace (valid until the next packed layer's
        call): the codes' nibbles, the offset and the gate-folded scales per group (one ``cpu_kernel`` pass where it
        runs, else a few whole-buffer ATen passes), then the gates that could not be folded."""
        scales, left = self._folded()
        spec, total = self.specs[0], self._spans[-1][4] + math.prod(self._spans[-1][5])
        flat = workspace.shared(total, dtype, self.codes.device)
        lib = self._dequantizer(dtype, total)
        if lib is not None:
            cpu_kernel.dequantize(lib, spec.bits, self.codes, scales.float().contiguous(), spec.group_size, flat)
        else:
            if spec.bits == 8:
                flat.copy_(self.codes.view(torch.int8))
            else:
                pairs = flat.view(-1, 2)
                pairs[:, 0] = self.codes & 0xF
                pairs[:, 1] = self.codes >> 4
                flat.sub_(8)
            flat.view(-1, spec.group_size).mul_(scales.to(dtype)[:, None])
        cores = [flat[at : at + math.prod(shape)].view(shape) for *_, at, shape, _ in self._spans]
        for k in left:
            cores[k].mul_(getattr(self, f"gates_{k}").to(dtype))
        return cores

    def forward(self, x: Tensor) -> Tensor:
        """The planner's forward-only plan for x's token count on the gated cores. In eager calls that record no
        gradient, with all cores on one grid, the cores are dequantized into the shared workspace with the gates
        folded in (``_gated_cores_shared``); otherwise built anew (traceable)."""
        low = low_precision(self.compute_dtype, x, self.in_features, LOW_PRECISION_MIN_ROWS) and not self.stored_empty
        if low:  # the plan on cores and input rounded to compute_dtype; the bias added in x's dtype after
            result, x = x, x.to(self.compute_dtype)
        bias = None if self.bias is None or low else self.bias.to(x.dtype)
        if self.stored_empty:
            out = x[..., :0] @ x.new_zeros(0, self.out_features)
            return out if bias is None else out + bias
        if self._aligned and workspace.reusable(x):
            lib = None if low else self._low_rank_kernel(x)
            if lib is not None:
                return self._forward_low_rank(lib, x)
            cores = self._gated_cores_shared(x.dtype)
        else:
            gates = [g.to(x.dtype) for g in self.gates()]
            cores = ops.gate_cores(self.cores(x.dtype), gates, self.layout)
        envelope = self._pins.get(self.op)
        if envelope is None:  # a module whose pins were dropped and not remade (never in normal use)
            envelope = planned_envelope(self.layout, self.op, device=x.device, backward=False)
        chosen = choose_plan(envelope, x.numel() // self.in_features)
        out = planner.execute(chosen, x, cores, self.layout, bias)
        if not low:
            return out
        return out.to(result.dtype) if self.bias is None else torch.add(self.bias.to(result.dtype), out)

    def nbytes(self) -> int:
        """Bytes held in memory by the codes and scales: the cores' stored bytes (gates and bias not counted, as
        ``comera_fx.quantize.stored_bytes`` does not count them)."""
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def stored_nbytes(self) -> int:
        """Bytes of the cores as ``save_tensorized`` stores them: the same as in memory (``nbytes``)."""
        return self.nbytes()

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
        state.pop("_folded_scales", None)  # made again from the copy's own buffers
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._plan()

    def extra_repr(self) -> str:
        bits = sorted({f"int{s.bits} group {s.group_size}" for s in self.specs})
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.layout.ranks}, "
            f"cores {', '.join(bits)}, bias={self.bias is not None}"
            + ("" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}")
        )


def tt_core_specs(tt: TTMatrix) -> tuple[QuantSpec | None, ...]:
    """The grid ``quantize_`` recorded for each core of ``tt`` (None where a core has none)."""
    recorded = getattr(tt.cores, SPEC_ATTR, {})
    return tuple(recorded.get(str(k)) for k in range(len(tt.cores)))
