"""``PackedLinear``: an ``nn.Linear`` held as int8 / int4 codes and fp32 scales per group (int3 codes held as int4:
the kernel's nibble layout serves both)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quantize import SPEC_ATTR, QuantSpec, dequantize, pack, quantize_groups, unpack
from . import cpu_kernel, workspace

SCALES_SUFFIX = "weight_scales"

#: What ``PackedLinear._code_grid`` multiplies the codes of each width by (the scales are divided by it).
CODE_UNIT = {4: 16}

#: The fewest rows (tokens) a call needs for a ``PackedLinear``'s ``compute_dtype`` to apply; fewer run in the
#: input's dtype. Why: bf16 over fp32 time of MiniLM's int4 layers on an AMX CPU was 0.85-1.37x at 13 tokens,
#: 0.70-1.05x at 32, 0.59-0.94x at 64 and 0.31-0.76x at 640 (the weight's rebuild decides at few tokens; the 8x
#: student at 13 tokens 13.9 against 11.3 ms; benchmarks/history/2026-12-06-issue-46-session9.md).
LOW_PRECISION_MIN_ROWS = 64

#: How ``PackedLinear`` holds its codes in memory: 3 = output rows in blocks of ``row_block`` rows (16 for
#: ``cpu_kernel`` where it runs, else 1), int4 as 4-bit two's complement. Objects pickled whole
#: (``torch.save(module)``) by older code held them row by row (format 2) or int4 offset by 8 (no format);
#: ``__setstate__`` converts them.
CODE_FORMAT = 3


def low_precision(compute_dtype: torch.dtype | None, x: Tensor, in_features: int, min_rows: int) -> bool:
    """Whether a packed layer with ``compute_dtype`` multiplies ``x`` in it: another dtype than x's, and at least
    ``min_rows`` rows."""
    return compute_dtype is not None and compute_dtype != x.dtype and x.numel() >= min_rows * in_features


def kernel_group(spec: QuantSpec, rows: int, cols: int) -> int:
    """Input features per scale within a row for ``spec`` on a rows × cols weight; ValueError if groups straddle
    rows unevenly (int4 also needs an even number of input features)."""
    group = rows * cols if spec.group_size is None else spec.group_size
    if group % cols and cols % group:
        raise ValueError(
            f"a group of {group} weights neither divides nor spans whole rows of {cols} input "
            f"features: no packed layout; use a group size that divides {cols}"
        )
    if held_bits(spec) == 4 and cols % 2:
        raise ValueError(f"int{spec.bits} codes go two to a byte along a row: {cols} input features is odd")
    return min(group, cols)


def held_bits(spec: QuantSpec) -> int:
    """The code width ``PackedLinear`` holds in memory for ``spec``: int8 as int8, int4 and int3 as 4-bit nibbles
    (an int3 code, -3..3, is a valid int4 code; the stored file keeps 3 bits: ``stored``)."""
    return 8 if spec.bits == 8 else 4


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
        self.row_block = row_block(out_features, device)
        blocks, width = out_features // self.row_block, in_features if held_bits(spec) == 8 else in_features // 2
        # (row blocks, codes a row, rows a block): the 16 rows' codes of one input feature next to each other
        self.register_buffer(
            "codes",
            torch.empty(
                blocks, width, self.row_block, device=device, dtype=torch.int8 if held_bits(spec) == 8 else torch.uint8
            ),
        )
        groups = in_features // self.kgroup
        self.register_buffer("scales", torch.empty(blocks, groups, self.row_block, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.code_format = CODE_FORMAT

    @property
    def held_bits(self) -> int:
        """The width of the codes in memory (``held_bits``)."""
        return held_bits(self.spec)

    #: The dtype the GEMM runs in (``set_compute_dtype_``); None: the input's. A runtime choice, not saved.
    compute_dtype: torch.dtype | None = None

    def __setstate__(self, state):
        """A module pickled whole by older code: int4 codes offset by 8 (no ``code_format``; in two's complement the
        nibble is code & 15 = (code + 8) ^ 8, one XOR per byte converts both nibbles), codes and scales row by row
        (format 2; put into row blocks here). Without it such a file would load silently wrong weights."""
        buffers = state["_buffers"]
        if "code_format" not in state and state["spec"].bits == 4:
            buffers["codes"] = buffers["codes"] ^ 0x88
        if state.get("code_format", 2) < 3:
            block = state["row_block"] = row_block(state["out_features"], buffers["codes"].device)
            buffers["codes"] = to_row_blocks(buffers["codes"], block)
            buffers["scales"] = to_row_blocks(buffers["scales"], block)
        state["code_format"] = CODE_FORMAT
        super().__setstate__(state)

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
        device, block = self.codes.device, self.row_block
        self.scales = to_row_blocks(_row_scales(scales.reshape(-1).cpu(), spec, rows, cols, self.kgroup), block)
        self.scales = self.scales.to(device)
        if self.held_bits == 8:
            self.codes = to_row_blocks(grid, block).to(device)
        else:  # byte j of a row holds input features j (low nibble) and j + in/2 (high nibble), each as a 4-bit
            # two's complement code (see ``_code_grid``)
            nibbles, half = (grid.to(torch.int16) & 0xF).to(torch.uint8), cols // 2
            self.codes = to_row_blocks(nibbles[:, :half] | (nibbles[:, half:] << 4), block).to(device)

    def stored(self) -> tuple[Tensor, Tensor]:
        """(``pack``'s stored codes, fp32 scales per group of ``spec``): the portable form."""
        codes, scales = quantize_groups(self.dequantized(), self.spec)
        return pack(codes, self.spec.bits), scales

    def _code_grid(self, dtype: torch.dtype, start: int = 0, end: int | None = None, out: Tensor | None = None):
        """Output rows start:end of the codes as floats, times ``CODE_UNIT`` (``out``: where to write them).

        An int4 byte holds two 4-bit two's complement codes; as int8, the byte shifted left by 4 is 16 x its low
        code and the byte with its low bits cleared is 16 x its high code: two byte-wide ops, no offset to take
        off afterwards; ``_unit_scales`` divides the 16 back out of the scales (a power of two: exact)."""
        block, end = self.row_block, self.out_features if end is None else end
        if start % block or end % block:
            raise ValueError(f"rows {start}:{end} are not whole blocks of {block}")
        if out is None:
            out = self.codes.new_empty((end - start, self.in_features), dtype=dtype)
        lib = self._unpacker(dtype)
        if lib is not None:
            return cpu_kernel.unpack(
                lib, self.held_bits, self.codes, self.in_features, out, start // block, end // block
            )
        codes = self.codes[start // block : end // block].transpose(1, 2)  # (blocks, rows a block, codes a row)
        grid = out.view(codes.shape[0], block, self.in_features)
        if self.held_bits == 8:
            grid.copy_(codes)
            return out
        half = self.in_features // 2
        grid[..., :half] = (codes << 4).view(torch.int8)
        grid[..., half:] = (codes & 0xF0).view(torch.int8)
        return out

    def _unpacker(self, dtype: torch.dtype):
        """``cpu_kernel``'s library where it unpacks this layer's blocked codes in an eager call (it transposes
        them out of their blocks 2-4x faster than ATen's strided copies), else None."""
        if (
            self.row_block != cpu_kernel.ROW_BLOCK
            or self.codes.device.type != "cpu"
            or not self.codes.is_contiguous()
            or torch.compiler.is_compiling()
            or not cpu_kernel.can_unpack(self.held_bits, self.in_features, dtype)
        ):
            return None
        return cpu_kernel.library()

    def row_scales(self) -> Tensor:
        """The scales as (rows, groups a row): ``scales`` out of its row blocks."""
        blocks, groups, block = self.scales.shape
        return self.scales.transpose(1, 2).reshape(blocks * block, groups)

    def _unit_scales(self, dtype: torch.dtype) -> Tensor:
        """The scales per (row, group) for ``_code_grid``'s floats."""
        scales = self.row_scales().to(dtype)
        return scales / CODE_UNIT[self.held_bits] if self.held_bits in CODE_UNIT else scales

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight these codes stand for (out × in): ``forward``'s product is ``x`` times its transpose."""
        rows, cols = self.out_features, self.in_features
        grid = self._code_grid(dtype).view(rows, -1, self.kgroup).mul_(self._unit_scales(dtype)[..., None])
        return grid.view(rows, cols)

    def forward(self, x: Tensor) -> Tensor:
        """``x Wᵀ + b`` from the codes converted to floats (``_code_grid``). With one scale per row and fewer
        tokens than 2/3 of the input width (the output smaller than the weight), the scales go on the output;
        otherwise, and always when compiled or exported, on the weight, and the bias rides in the GEMM. In eager
        calls that record no gradient of x, the floats go into the shared workspace a block of rows at a time
        (``_forward_in_blocks``)."""
        if low_precision(self.compute_dtype, x, self.in_features, LOW_PRECISION_MIN_ROWS):
            return self._forward_low_precision(x, self.compute_dtype)
        lib = self._kernel_for(x)
        if lib is not None:
            return self._forward_kernel(lib, x)
        rows, cols, scales = self.out_features, self.in_features, self._unit_scales(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if workspace.reusable(x):
            return self._forward_in_blocks(x, scales, bias)
        grid = self._code_grid(x.dtype)
        # the output is the larger operand: finish the weight, not it (always when traced: a size test is a guard)
        if self.kgroup != cols or torch.compiler.is_compiling() or 3 * (x.numel() // cols) >= 2 * cols:
            grid = grid.view(rows, -1, self.kgroup).mul_(scales[..., None]).view(rows, cols)
            return F.linear(x, grid, bias)
        out = F.linear(x, grid) * scales[:, 0]
        return out if bias is None else out + bias

    def _kernel_for(self, x: Tensor):
        """``cpu_kernel``'s library where it runs this call: eager (not traced), a plain fp32 CPU tensor whose
        gradient is not recorded, contiguous codes in row blocks with fp32 scales, and the kernel built
        (``cpu_kernel.library``)."""
        if (
            self.row_block != cpu_kernel.ROW_BLOCK
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or self.scales.dtype != torch.float32  # e.g. after .double(): the kernel reads fp32 scales
            or not (self.codes.is_contiguous() and self.scales.is_contiguous())
            or not workspace.eager_inference(x)
        ):
            return None
        return cpu_kernel.library()

    def _forward_kernel(self, lib, x: Tensor) -> Tensor:
        """``forward`` by ``cpu_kernel``: the codes widened inside the product, no weight rebuilt. The bias goes
        in the kernel unless autograd records it (then it is added after)."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        inside, after = cpu_kernel.split_bias(self.bias)
        out = cpu_kernel.product(lib, self.held_bits, x2, self.codes, self.scales, self.kgroup, inside)
        out = out.view(x.shape[:-1] + (self.out_features,))
        return out if after is None else out + after

    def _forward_low_precision(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``forward`` with the GEMM in ``dtype`` (bf16 / fp16) and the result in x's dtype: x is rounded to
        ``dtype``, the codes are exact in it (at most 8 bits), the products accumulate in fp32 and the output is
        rounded to ``dtype``. One scale per row goes on the output in x's dtype (the weight exact); scales per group
        go on the weight in ``dtype`` (the scale and its product with the code each rounded to it). A block of
        output rows at a time in the shared workspace in eager calls that record no gradient of x
        (``workspace.reusable``, ``workspace.chunk_rows``)."""
        rows, cols, kgroup = self.out_features, self.in_features, self.kgroup
        scales = self._unit_scales(x.dtype)
        low_scales = scales.to(dtype) if kgroup != cols else None
        x2 = x.reshape(-1, cols).to(dtype)
        shared = workspace.reusable(x)
        step = self._chunk_rows(cols * x2.element_size()) if shared else rows
        blocks = []
        for start in range(0, rows, step):
            end = min(rows, start + step)
            out = None
            if shared:
                out = workspace.shared((end - start) * cols, dtype, x.device).view(end - start, cols)
            grid = self._code_grid(dtype, start, end, out=out)
            if kgroup != cols:  # in ``dtype`` (a mixed-dtype in-place multiply converts the whole grid: 15x slower)
                grid.view(end - start, -1, kgroup).mul_(low_scales[start:end, :, None])
            blocks.append(torch.mm(x2, grid.t()))
        product = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if kgroup == cols:
            out = product * scales[:, 0] if bias is None else torch.addcmul(bias, product, scales[:, 0])
        else:
            out = product.to(x.dtype) if bias is None else torch.add(bias, product)
        return out.view(x.shape[:-1] + (rows,))

    def _forward_in_blocks(self, x: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
        """``forward`` with the weight rebuilt a block of output rows at a time into the shared workspace
        (``workspace.chunk_rows``: the workspace stays under ``workspace.MAX_BYTES``), each block's product
        written into its columns of the output."""
        rows, cols, kgroup = self.out_features, self.in_features, self.kgroup
        x2 = x.reshape(-1, cols)
        scale_output = kgroup == cols and 3 * x2.shape[0] < 2 * cols  # as in ``forward``
        fused_bias = bias if not scale_output and not torch.is_grad_enabled() else None
        out = x2.new_empty(x2.shape[0], rows)
        if self._in_halves(x.element_size()):
            self._halves_into(out, x2, scales, fused_bias, scale_output)
            return self._finish_blocks(out, x, scales, bias, fused_bias, scale_output)
        step = self._chunk_rows(cols * x.element_size())
        for start in range(0, rows, step):
            end = min(rows, start + step)
            grid = workspace.shared((end - start) * cols, x.dtype, x.device).view(end - start, cols)
            self._code_grid(x.dtype, start, end, out=grid)
            if not scale_output:
                grid.view(end - start, -1, kgroup).mul_(scales[start:end, :, None])
            if fused_bias is None:
                torch.mm(x2, grid.t(), out=out[:, start:end])
            else:
                torch.addmm(fused_bias[start:end], x2, grid.t(), out=out[:, start:end])
        return self._finish_blocks(out, x, scales, bias, fused_bias, scale_output)

    def _chunk_rows(self, row_bytes: int) -> int:
        """``workspace.chunk_rows`` in whole row blocks."""
        block = self.row_block
        return workspace.chunk_rows(self.out_features // block, row_bytes * block) * block

    @staticmethod
    def _finish_blocks(out, x, scales, bias, fused_bias, scale_output: bool) -> Tensor:
        out = out.view(x.shape[:-1] + (out.shape[-1],))
        if scale_output:
            out = out.mul_(scales[:, 0])
        return out if bias is None or fused_bias is not None else out + bias

    def _in_halves(self, itemsize: int) -> bool:
        """Whether an int4 weight over ``workspace.MAX_BYTES`` goes in two blocks of input features, its low and
        high codes (each block's groups whole, each block under the cap): at 640 tokens a 1536 -> 384 layer's
        two GEMMs over halves of the inputs ran as one (8.13 against 8.16 ms), over halves of the outputs 0.23 ms
        slower (benchmarks/history/2026-12-05-issue-46-latency.md)."""
        rows, cols, half = self.out_features, self.in_features, self.in_features // 2
        return (
            self.held_bits == 4
            and workspace.chunk_rows(rows, cols * itemsize) < rows
            and workspace.chunk_rows(rows, half * itemsize) == rows
            and (self.kgroup == cols or half % self.kgroup == 0)
        )

    def _halves_into(self, out: Tensor, x2: Tensor, scales: Tensor, fused_bias, scale_output: bool) -> None:
        """``out`` = x2 times the weight (or its codes, when ``scale_output``) in two GEMMs, one per half of the
        input features: the low codes, then the high codes accumulated onto it."""
        rows, cols, half = self.out_features, self.in_features, self.in_features // 2
        grid = workspace.shared(rows * half, x2.dtype, x2.device).view(rows, half)
        group = min(self.kgroup, half)
        lib = self._unpacker(x2.dtype)
        for k in range(2):
            if lib is not None:
                cpu_kernel.unpack(lib, 4, self.codes, cols, grid, 0, self.codes.shape[0], halves=k + 1)
            else:
                codes = (self.codes & 0xF0) if k else (self.codes << 4)
                grid.view(-1, self.row_block, half).copy_(codes.view(torch.int8).transpose(1, 2))
            if not scale_output:
                per_half = scales.shape[1] // 2
                block = scales if self.kgroup == cols else scales[:, k * per_half : (k + 1) * per_half]
                grid.view(rows, -1, group).mul_(block[..., None])
            inputs = x2[:, k * half : (k + 1) * half]
            if k:
                out.addmm_(inputs, grid.t())
            elif fused_bias is None:
                torch.mm(inputs, grid.t(), out=out)
            else:
                torch.addmm(fused_bias, inputs, grid.t(), out=out)

    def nbytes(self) -> int:
        """Bytes held in memory by the codes and scales (the resident size of the weight)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def stored_nbytes(self) -> int:
        """Bytes of the weight as ``save_tensorized`` stores it (its grid's codes and one scale per group; in memory
        the scales may be more: one per row at least); ``comera_fx.quantize.stored_bytes`` counts it."""
        return self.spec.nbytes(self.in_features * self.out_features)

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
            + ("" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}")
        )


def row_block(rows: int, device=None) -> int:
    """Rows a block of ``PackedLinear``'s in-memory layout: ``cpu_kernel.ROW_BLOCK`` where it divides ``rows``, the
    layer is for the CPU (or not placed yet: meta) and this machine has the kernel; else 1 (row by row). Why not
    always: without the kernel, ATen's strided byte copies out of the blocks made the rebuild 2-4x slower."""
    if rows % cpu_kernel.ROW_BLOCK or torch.device(device or "cpu").type not in ("cpu", "meta"):
        return 1
    return cpu_kernel.ROW_BLOCK if cpu_kernel.library() is not None else 1


def to_row_blocks(rows: Tensor, block: int) -> Tensor:
    """A (rows, columns) tensor as (rows / block, columns, block), contiguous: each column's ``block`` rows next to
    each other."""
    return rows.reshape(-1, block, rows.shape[-1]).transpose(1, 2).contiguous()


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


def reference_weight(codes: Tensor, scales: Tensor, spec: QuantSpec, shape) -> Tensor:
    """The float64 weight of stored codes and scales (``comera_fx.quantize.dequantize``), for tests and checks."""
    return dequantize(
        unpack(codes, spec.bits, math.prod(shape)) if codes.dtype == torch.uint8 else codes,
        scales,
        spec,
        tuple(shape),
        torch.float64,
    )
