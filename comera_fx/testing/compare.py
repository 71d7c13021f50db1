"""Comparing two runs' values: tolerances, element-wise or norm-wise, over any nesting of outputs.

Values are flattened with ``torch.utils._pytree`` (tuples, lists, dicts, namedtuples and registered types such as
``transformers``' ``ModelOutput``); a dataclass that is not registered is opened field by field, so tensors inside
it are compared and differentiated too. Python floats are compared with the tolerance, other leaves with ``==``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["Tolerance", "default_tolerances"]

# (rtol, atol) by dtype: a correct rewrite reorders float operations, so exact equality is never asked for.
_TOLERANCES = {
    torch.float64: (1e-6, 1e-8),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) used when none are given: tight in float64, looser as precision drops."""
    return _TOLERANCES.get(dtype, (1e-4, 1e-5))


@dataclass(frozen=True)
class Tolerance:
    """When a float tensor ``b`` (rewritten) counts as equal to ``a`` (original).

    Element-wise (``norm_rtol`` None): ``|b - a| <= atol + rtol·|a|`` everywhere (``torch.allclose``). Norm-wise
    (``norm_rtol`` given): ``||b - a|| <= norm_rtol·||a|| + atol`` in the Frobenius norm of each tensor, the bound
    a reordered or truncated contraction satisfies, where elements near zero carry the rounding error of the
    whole sum (``rtol`` is then unused).
    """

    rtol: float
    atol: float
    norm_rtol: float | None = None

    def __post_init__(self) -> None:
        for name in ("rtol", "atol", "norm_rtol"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a float >= 0, got {value!r}")

    def allows(self, a: Tensor, b: Tensor) -> bool:
        if self.norm_rtol is None:
            return torch.allclose(b, a, rtol=self.rtol, atol=self.atol, equal_nan=True)
        if torch.isnan(a).ne(torch.isnan(b)).any():
            return False
        a, b = torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
        return (
            float(torch.linalg.vector_norm((b - a).double()))
            <= self.norm_rtol * float(torch.linalg.vector_norm(a.double())) + self.atol
        )

    def allows_float(self, a: float, b: float) -> bool:
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        relative = self.rtol if self.norm_rtol is None else self.norm_rtol
        return abs(b - a) <= self.atol + relative * abs(a)

    def describe(self) -> str:
        if self.norm_rtol is None:
            return f"{self.atol:g} + {self.rtol:g}·|original| element-wise"
        return f"||difference|| <= {self.norm_rtol:g}·||original|| + {self.atol:g}"


@dataclass
class Difference:
    """What differs between two values; ``max_abs_error`` is None when the difference is not numeric."""

    max_abs_error: float | None
    original_shape: tuple[int, ...] | None
    rewritten_shape: tuple[int, ...] | None
    reason: str
    relative_norm_error: float | None = None


def detach(value):
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, value)


def _is_unregistered_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def open_dataclasses(value):
    """``value`` with every unregistered dataclass instance replaced by (type name, dict of its fields), so that
    pytree sees the tensors inside it (recursively)."""

    def opened(x):
        if _is_unregistered_dataclass(x):
            fields = {f.name: open_dataclasses(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return (type(x).__qualname__, fields)
        return x

    return pytree.tree_map(opened, value)


def _shape(x) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, Tensor) else None


def _leaf_difference(a, b, strict: bool, tol: Tolerance) -> Difference | None:
    """A non-tensor leaf: floats within the tolerance, others by ``==``. ``strict``: a leaf whose ``==`` cannot
    be read as a bool is a difference (it would otherwise go unchecked); else it is skipped."""
    if isinstance(a, float) and isinstance(b, float):
        if tol.allows_float(a, b):
            return None
        return Difference(abs(b - a), None, None, f"{a!r} vs {b!r}")
    try:
        same = bool(a == b)
    except Exception:
        if not strict:  # an intermediate value the locator cannot compare: not evidence either way
            return None
        return Difference(
            None,
            None,
            None,
            f"values of type {type(a).__qualname__} cannot be compared (their == "
            f"gives no bool): register the type with torch.utils._pytree",
        )
    return None if same else Difference(None, None, None, f"{a!r} vs {b!r}")


def compare(original, rewritten, tol: Tolerance, *, strict: bool = True) -> Difference | None:
    """None if ``rewritten`` matches ``original`` (float tensors within ``tol``, other tensors equal, other leaves
    as ``_leaf_difference`` says), else the worst difference."""
    a_leaves, a_spec = pytree.tree_flatten(open_dataclasses(original))
    b_leaves, b_spec = pytree.tree_flatten(open_dataclasses(rewritten))
    if a_spec != b_spec:
        return Difference(None, None, None, f"structure differs: {a_spec} vs {b_spec}")
    worst = None
    for a, b in zip(a_leaves, b_leaves):
        if isinstance(a, Tensor) != isinstance(b, Tensor):
            return Difference(None, _shape(a), _shape(b), f"{type(a).__name__} vs {type(b).__name__}")
        if not isinstance(a, Tensor):
            difference = _leaf_difference(a, b, strict, tol)
            if difference is not None:
                return difference
            continue
        if a.shape != b.shape:
            return Difference(None, tuple(a.shape), tuple(b.shape), "shapes differ")
        if a.dtype != b.dtype:
            return Difference(None, tuple(a.shape), tuple(b.shape), f"dtypes differ: {a.dtype} vs {b.dtype}")
        b = b.to(a.device)
        if not a.is_floating_point() and not a.is_complex():
            if not torch.equal(a, b):
                error = float((a.double() - b.double()).abs().max())
                return Difference(error, tuple(a.shape), tuple(b.shape), "values differ")
            continue
        if a.numel() == 0 or tol.allows(a, b):
            continue
        error = float(torch.nan_to_num((a - b).abs(), nan=float("inf")).max())
        norm = float(torch.linalg.vector_norm(a.double()))
        relative = (
            float(torch.linalg.vector_norm(torch.nan_to_num((a - b).double(), nan=float("inf")))) / norm
            if norm > 0
            else None
        )
        if worst is None or error > worst.max_abs_error:
            worst = Difference(error, tuple(a.shape), tuple(b.shape), "values differ", relative)
    return worst


def summary(difference: Difference) -> str:
    """'max abs error 0.1 (shape (2, 3))' — with the relative norm error when known."""
    if difference.max_abs_error is None:
        return f"{difference.reason} (original {difference.original_shape}, rewritten {difference.rewritten_shape})"
    relative = (
        f", relative norm error {difference.relative_norm_error:.3g}"
        if difference.relative_norm_error is not None
        else ""
    )
    shape = (
        f" (shape {difference.original_shape})" if difference.original_shape is not None else f" ({difference.reason})"
    )
    return f"max abs error {difference.max_abs_error:.3g}{relative}{shape}"
