"""Weight quantization that composes with tensorization: TT cores (and dense linears, if asked) stored as int8,
int4 or int3 with one fp32 scale per group of consecutive weights.

TT cores and low-rank factors are small dense matrices, so structure and precision multiply: a TT student at a
quarter of the parameters with int8 cores takes about 1/16 of the fp32 dense bytes. ``quantize_`` rounds the
chosen weights onto their grid in place (the model keeps running in float with exactly the values the quantized
storage holds, so it is evaluated, fine-tuned or compiled by the same code), and records the grid on the module
that owns each weight. ``save_tensorized`` then writes those weights as integer codes plus scales, and
``load_tensorized`` restores them, bit for bit, as float tensors: the loaded model runs with plain torch ops.

The grid is symmetric round-to-nearest: a group of ``group_size`` consecutive row-major weights (``None``: the
whole tensor) shares the scale max|w| / qmax, qmax = 2^(bits-1) - 1, and each weight becomes an integer in
[-qmax, qmax] times it, moving by at most half a scale. Given the importance of each input feature (a layer's
calibrated input mean squares), a group's scale is instead the ``CLIP_RATIOS`` multiple of max|w| / qmax that
minimizes the importance-weighted squared error: clipping a few large weights (they move by more) buys a finer
grid for the rest (all-MiniLM-L6-v2's 36 encoder linears at int4: 22 % less calibrated error in groups of 64,
37 % with one scale per row; benchmarks/bench_grid_scales.py). Either way a group's largest code is ±qmax, so
rounding the result again by max|w| keeps it bit for bit: storing, packing and ``requantize_`` need no record of
the clipping.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .tt.layers import TTMatrix

#: Attribute of a module that owns quantized parameters: {parameter name: QuantSpec}.
SPEC_ATTR = "_comera_fx_quantized"


#: The int grids' widths: codes in [-qmax, qmax], qmax = 2^(bits-1) - 1 (int3: seven levels, -3..3).
GRID_BITS = (8, 4, 3)


@dataclass(frozen=True)
class QuantSpec:
    """How a weight is stored: ``bits`` (8, 4 or 3) per weight, one fp32 scale per ``group_size`` consecutive
    row-major weights (``None``: one scale for the tensor)."""

    bits: int = 8
    group_size: int | None = 64

    def __post_init__(self) -> None:
        if self.bits not in GRID_BITS:
            raise ValueError(f"bits must be one of {GRID_BITS}, got {self.bits!r}")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size!r}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups(self, numel: int) -> int:
        return 1 if self.group_size is None else math.ceil(numel / self.group_size)

    def nbytes(self, numel: int, scale_bytes: int = 4) -> int:
        """Bytes of ``numel`` weights stored on this grid: the codes plus one scale per group."""
        return quantized_bytes(numel, self.bits, self.group_size, scale_bytes)


def quantized_bytes(numel: int, bits: int, group_size: int | None = None, scale_bytes: int = 4) -> int:
    """Bytes of ``numel`` weights stored at ``bits`` bits each plus one ``scale_bytes`` scale per group of
    ``group_size`` consecutive weights (``None``: one scale for the whole tensor). ``bits >= 16`` is float storage:
    no scales."""
    if bits >= 16:
        return numel * bits // 8
    groups = 1 if group_size is None else math.ceil(numel / group_size)
    return math.ceil(numel * bits / 8) + groups * scale_bytes


def _grouped(weight: Tensor, spec: QuantSpec) -> Tensor:
    """``weight`` flattened row-major, zero-padded to whole groups, as (groups, group size)."""
    flat = weight.detach().reshape(-1)
    size = max(flat.numel(), 1) if spec.group_size is None else spec.group_size
    pad = (-flat.numel()) % size
    return torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, size)


#: The multiples of max|w| / qmax that rounding with importance tries as a group's scale (1.0 first: it wins ties,
#: so a group already on its grid keeps its scale). ``(1.0,)`` turns the search off.
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(17))


def _nonzero(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _round(groups: Tensor, scale: Tensor, qmax: int) -> Tensor:
    return torch.clamp(torch.round(groups / scale), -qmax, qmax)


def clipped_scales(groups: Tensor, importance: Tensor, qmax: int, ratios=None) -> Tensor:
    """Per row of ``groups`` (groups × group size), the scale r · max|w| / qmax over ``ratios`` (default
    ``CLIP_RATIOS``) that minimizes Σ importance · (w - q(w))² (``importance``: the same shape, ≥ 0): the part of
    a linear layer's output error that rounding each weight independently adds, when ``importance`` holds each
    weight's input mean square."""
    ratios = CLIP_RATIOS if ratios is None else ratios
    if not ratios or not all(0 < r <= 1 for r in ratios):
        # a ratio above 1 leaves a group's largest code below qmax: re-rounding by max|w| (a save) would move it
        raise ValueError(f"clipping ratios must lie in (0, 1], got {tuple(ratios)!r}")
    amax = groups.abs().amax(1, keepdim=True)
    best_scale, best_error = None, None
    for ratio in ratios:
        scale = _nonzero(amax * ratio / qmax)
        error = ((_round(groups, scale, qmax) * scale - groups).square() * importance).sum(1, keepdim=True)
        if best_scale is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    return best_scale


def _check_importance(weight: Tensor, importance: Tensor) -> None:
    if weight.dim() < 1 or importance.shape != weight.shape[-1:]:
        raise ValueError(
            f"importance must hold one weight per input feature ({weight.shape[-1:]}), got shape "
            f"{tuple(importance.shape)}"
        )
    if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
        raise ValueError("importance must be finite and non-negative (input mean squares)")


def _importance_groups(weight: Tensor, importance: Tensor, spec: QuantSpec) -> Tensor:
    _check_importance(weight, importance)
    return _grouped(importance.detach().float().to(weight.device).expand(weight.shape), spec)


def quantize_groups(weight: Tensor, spec: QuantSpec, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(int8 codes of the ``weight.numel()`` weights, fp32 scales, one per group). An all-zero group has scale 1.
    ``importance`` (one non-negative weight per input feature, the last dimension): each group's scale is searched
    (``clipped_scales``) instead of max|w| / qmax.

    Quantizing a tensor that is already on its grid gives back the same codes and scales (its largest value is
    qmax · s, and fl(fl(qmax · s) / qmax) = s for these small qmax), so a save after ``quantize_`` loses nothing;
    tests/test_quantize.py checks it over magnitudes from 1e-6 to 1e3. With ``importance`` the largest code is still
    ±qmax (the ratios are ≤ 1), so the same holds for the searched grid."""
    groups = _grouped(weight, spec)
    if importance is None:
        scale = _nonzero(groups.abs().amax(1, keepdim=True) / spec.qmax)
    else:
        scale = clipped_scales(groups.float(), _importance_groups(weight, importance, spec), spec.qmax)
        scale = scale.to(groups.dtype)
    codes = _round(groups, scale, spec.qmax)
    return codes.reshape(-1)[: weight.numel()].to(torch.int8), scale.reshape(-1).float()


def dequantize(codes: Tensor, scales: Tensor, spec: QuantSpec, shape, dtype: torch.dtype) -> Tensor:
    """The float tensor of ``shape`` that ``codes`` (as ``quantize_groups`` returns them) and ``scales`` stand for."""
    numel = math.prod(shape)
    size = max(numel, 1) if spec.group_size is None else spec.group_size
    pad = (-numel) % size
    grid = torch.cat([codes.to(dtype), codes.new_zeros(pad, dtype=dtype)]).reshape(-1, size)
    return (grid * scales.to(dtype)[:, None]).reshape(-1)[:numel].reshape(shape)


def fake_quant(weight: Tensor, bits: int, group_size: int | None = None, importance: Tensor | None = None) -> Tensor:
    """``weight`` rounded onto the grid of ``QuantSpec(bits, group_size)``, in its dtype and shape (``importance``:
    see ``quantize_groups``)."""
    spec = QuantSpec(bits, group_size)
    codes, scales = quantize_groups(weight, spec, importance)
    return dequantize(codes, scales, spec, weight.shape, weight.dtype)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Codes as stored: int8 as they are; int4 two to a byte (code + 8 in each nibble, low nibble first); int3 eight
    to three bytes (code + 4 in each 3-bit field, the first code in the lowest bits of a little-endian 24-bit word;
    ceil(3 n / 8) bytes in all)."""
    if bits == 8:
        return codes.to(torch.int8)
    if bits == 3:
        fields = (codes.to(torch.int32) + 4).reshape(-1)
        numel = fields.numel()
        fields = torch.cat([fields, fields.new_full(((-numel) % 8,), 4)]).reshape(-1, 8)
        words = (fields << torch.arange(0, 24, 3, dtype=torch.int32)).sum(1, dtype=torch.int32)
        stored = torch.stack([(words >> shift) & 0xFF for shift in (0, 8, 16)], 1).reshape(-1).to(torch.uint8)
        return stored[: math.ceil(numel * 3 / 8)]  # the last word's bytes that hold no code are not stored
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack(stored: Tensor, bits: int, numel: int) -> Tensor:
    """The int8 codes ``pack`` stored."""
    if bits == 8:
        return stored.to(torch.int8)
    if bits == 3:
        triples = stored.to(torch.int32)
        triples = torch.cat([triples, triples.new_zeros((-triples.numel()) % 3)]).reshape(-1, 3)
        words = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        fields = (words[:, None] >> torch.arange(0, 24, 3, dtype=torch.int32)) & 7
        return (fields.reshape(-1)[:numel] - 4).to(torch.int8)
    low, high = stored & 0xF, stored >> 4
    return (torch.stack([low, high], 1).reshape(-1)[:numel].to(torch.int16) - 8).to(torch.int8)


@dataclass(frozen=True)
class QuantizeSummary:
    """What ``quantize_`` did: the weights it put on a grid, and their bytes before (as stored) and after."""

    quantized: tuple[str, ...]
    bytes_before: int
    bytes_after: int

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"quantize_: {len(self.quantized)} weights, {self.bytes_before:,} -> {self.bytes_after:,} bytes "
            f"({ratio:.3f}x)"
        )


def _selected(model: nn.Module, dense_linears: bool, include: str | None) -> dict[int, nn.Parameter]:
    """The parameters ``quantize_`` acts on, by identity: every TT core, and nn.Linear weights if asked, under
    modules whose name matches ``include``."""
    chosen: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules():
        if include is not None and not re.search(include, path):
            continue
        if isinstance(module, TTMatrix):
            chosen.update((id(core), core) for core in module.cores)
        elif dense_linears and isinstance(module, nn.Linear):
            chosen[id(module.weight)] = module.weight
    return chosen


def _owners(model: nn.Module):
    """(owning module, parameter name, full name, parameter) for every registration of every parameter."""
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, f"{path}.{name}" if path else name, param


@torch.no_grad()
def quantize_(
    model: nn.Module,
    bits: int = 8,
    group_size: int | None = 64,
    *,
    dense_linears: bool = False,
    include: str | None = None,
    importance: Tensor | None = None,
) -> QuantizeSummary:
    """Round every TT core of ``model`` (and every ``nn.Linear`` weight with ``dense_linears=True``) onto a
    ``bits``-bit grid with a scale per ``group_size`` weights, in place, and record the grid so that
    ``save_tensorized`` stores the codes. ``include``: a regex; only modules whose name matches it (``re.search``).
    ``importance``: one non-negative weight per input feature of the selected ``nn.Linear`` layers (e.g. the
    diagonal of a ``calibrate`` second moment): their groups' scales are searched to minimize the error weighted
    by it (module docstring); TT cores keep max|w| scales.

    Parameters stay the same objects (an optimizer built before keeps working; ``requires_grad`` is untouched).
    Quantize after training: a weight that moves off its grid (a later optimizer step, a rank shrink) is
    re-quantized from its new values when saved. ``comera_fx.quantize.stored_bytes`` counts the bytes."""
    spec = QuantSpec(bits, group_size)
    chosen = _selected(model, dense_linears, include)
    if not chosen:
        what = "TT cores or nn.Linear weights" if dense_linears else "TT cores (pass dense_linears=True for nn.Linear)"
        where = f" under modules matching {include!r}" if include is not None else ""
        raise ValueError(f"quantize_ found no {what}{where}; tensorize_ the model first")
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    if importance is not None:
        if not dense_linears:
            raise ValueError("importance weighs nn.Linear inputs: pass dense_linears=True with it")
        for param in chosen.values():  # all checked before any weight changes
            if id(param) in linear_weights:
                _check_importance(param, importance)
    before = stored_bytes(model, only=chosen)
    names = []
    for module, name, full, param in _owners(model):
        if id(param) not in chosen:
            continue
        if chosen[id(param)] is not None:
            weighted = importance if id(param) in linear_weights else None
            param.copy_(fake_quant(param, bits, group_size, weighted))
            chosen[id(param)] = None  # once per tensor, however many names it has
            names.append(full)
        specs = dict(getattr(module, SPEC_ATTR, {}))
        specs[name] = spec
        setattr(module, SPEC_ATTR, specs)
    return QuantizeSummary(tuple(names), before, stored_bytes(model, only={i: None for i in chosen}))


def _recorded_grids(model: nn.Module) -> list[tuple[nn.Parameter, QuantSpec]]:
    """(parameter, its grid) for every weight ``quantize_`` recorded, each tensor once (a tied weight has several
    registrations; the first one's grid counts)."""
    found, seen = [], set()
    for module, name, _, param in _owners(model):
        spec = getattr(module, SPEC_ATTR, {}).get(name)
        if spec is not None and id(param) not in seen:
            seen.add(id(param))
            found.append((param, spec))
    return found


@torch.no_grad()
def requantize_(model: nn.Module) -> int:
    """Round every weight ``quantize_`` recorded back onto its own grid (after fine-tuning moved it off: what
    training in float and then storing quantized gives); returns how many tensors were rounded."""
    grids = _recorded_grids(model)
    for param, spec in grids:
        param.copy_(fake_quant(param, spec.bits, spec.group_size))
    return len(grids)


@contextlib.contextmanager
def on_grid(model: nn.Module):
    """Within the block every weight ``quantize_`` recorded holds its grid values; on leaving, its float values
    come back (gradients are kept). Run forward and backward inside and ``optimizer.step()`` after: the gradient
    taken at the rounded weights updates the float ones (quantization-aware training with the straight-through
    estimator), so training learns weights that survive the final ``requantize_``. Yields the number of weights
    rounded; a backward run after leaving the block raises autograd's in-place error instead of using the wrong
    weights."""
    kept: list[tuple[Tensor, Tensor]] = []
    with torch.no_grad():
        for param, spec in _recorded_grids(model):
            kept.append((param, param.detach().clone()))
            param.copy_(fake_quant(param, spec.bits, spec.group_size))
    try:
        yield len(kept)
    finally:
        with torch.no_grad():
            for param, value in kept:
                param.copy_(value)


def quantized_specs(model: nn.Module) -> dict[str, QuantSpec]:
    """{full parameter name: its grid} for every registration of a quantized parameter (``state_dict`` keys)."""
    found = {}
    for module, name, full, _ in _owners(model):
        spec = getattr(module, SPEC_ATTR, {}).get(name)
        if spec is not None:
            found[full] = spec
    return found


def set_spec(model: nn.Module, full_name: str, spec: QuantSpec) -> None:
    """Record ``spec`` for the parameter ``full_name`` on its owning module (what ``load_tensorized`` restores)."""
    path, _, name = full_name.rpartition(".")
    module = model.get_submodule(path)
    setattr(module, SPEC_ATTR, {**getattr(module, SPEC_ATTR, {}), name: spec})


def stored_bytes(model: nn.Module, prefix: str = "", *, only: dict | None = None) -> int:
    """Bytes of the weights (parameters with two or more dimensions, each tensor once) under ``prefix`` as
    ``save_tensorized`` stores them: quantized ones at their grid's bytes, the rest at their dtype's size, and the
    modules whose weight is not a parameter (``PackedLinear`` / ``PackedTTLinear``: codes and scales) at what their
    ``stored_nbytes()`` says. ``only``: count just these parameters (by ``id``; such modules then do not count)."""
    specs = {}
    for module, name, _, param in _owners(model):
        spec = getattr(module, SPEC_ATTR, {}).get(name)
        if spec is not None:
            specs[id(param)] = spec
    total, seen = 0, set()
    for name, param in model.named_parameters():
        if not name.startswith(prefix) or param.dim() < 2 or id(param) in seen:
            continue
        if only is not None and id(param) not in only:
            continue
        seen.add(id(param))
        spec = specs.get(id(param))
        total += spec.nbytes(param.numel()) if spec is not None else param.numel() * param.element_size()
    if only is None:
        for path, m in model.named_modules():
            if hasattr(m, "stored_nbytes") and f"{path}.".startswith(prefix):
                total += m.stored_nbytes()
    return total
