"""Running a plan: its program (``plan_program``: each step's operand views, worked out once) and ``execute``.

A ``Plan`` is a description; what running it needs is derived here, from outside, and kept on the plan object
(``_kept``) so it is made once — before any traced region (``tt.layers.planned_envelope`` does it).
``execute`` uses only reshape / permute / t / mm / pad / slicing, so it runs eagerly and on ``torch.fx`` proxies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from .. import ops
from ..layout import TTLayout
from .network import _B
from .plans import Plan
from .views import _step_views

_T = TypeVar("_T")


def _kept(chosen: Plan, key: str, make: Callable[[Plan], _T]) -> _T:
    """``make(chosen)``, made on first use and kept on the plan object (as ``functools.cached_property`` would, from
    outside the class: the plan is frozen data and knows nothing of its runners). Later reads are one attribute
    lookup, which ``torch.compile`` traces as a constant."""
    value = getattr(chosen, key, None)
    if value is None:
        value = make(chosen)
        object.__setattr__(chosen, key, value)  # the dataclass is frozen; its instance dict still takes the cache
    return value


@dataclass(frozen=True)
class _Instruction:
    """How one step sees its stored operands as matrices: views (see ``_operand_view``) and stored dims (no b)."""

    left_view: tuple
    right_view: tuple
    left_dims: tuple[int, ...]
    right_dims: tuple[int, ...]


@dataclass(frozen=True)
class _Program:
    """A plan made runnable: one instruction per step, then the permutation (if any) into the output's order."""

    instructions: tuple[_Instruction, ...]
    final_dims: tuple[int, ...]
    final_perm: tuple[int, ...] | None


def plan_program(chosen: Plan) -> _Program:
    """How ``execute`` runs ``chosen``'s steps: operand views and index orders (pure data), made once per plan."""
    return _kept(chosen, "_program", _compile)


def _compile(chosen: Plan) -> _Program:
    """Track each stored tensor's index order through the steps and pick copy-free views where they exist.

    A GEMM's result is stored as (b?, left's free indices, right's free indices); the next step reads it as is,
    transposed, or through a permute (a copy) — whichever order of the shared indices needs fewer copies.
    """
    net = chosen.network
    orders: list[tuple[int, ...]] = list(net.tensor_indices)
    instructions = []
    for step in chosen.steps:
        a, b = orders[step.left], orders[step.right]
        view_a, view_b, order, _, _ = _step_views(net, a, b, step.batched)
        orders.append(order)
        instructions.append(
            _Instruction(view_a, view_b, tuple(net.sizes[i] for i in a if i != _B), tuple(net.sizes[i] for i in b))
        )
    final = orders[-1]
    perm = None if final == net.output else tuple(final.index(i) for i in net.output)
    return _Program(tuple(instructions), tuple(net.sizes[i] for i in final if i != _B), perm)


def _as_matrix(t, view: tuple, dims: tuple[int, ...], rows: int, cols: int, batched: bool):
    """The stored tensor ``t`` as a (rows × cols) matrix (rows = -1, i.e. b·rows, when batched)."""
    if view[0] == "view":
        return t.reshape(-1 if batched else rows, cols)
    if view[0] == "t":
        return t.reshape(cols, rows).t()
    lead = (-1,) if batched else ()
    return t.reshape(lead + dims).permute(view[1]).reshape(-1 if batched else rows, cols)


def _check_operands(chosen: Plan, cores: Sequence, layout: TTLayout) -> None:
    """Refuse cores of another layout than the plan's: after pruning, a stale plan would misread them."""
    if layout != chosen.network.layout:
        raise ValueError(
            f"the plan was made for {chosen.network.layout}, not {layout}; plan again for the new "
            f"layout (ranks change when a TT is pruned)"
        )
    if len(cores) != layout.n_cores:
        raise ValueError(f"expected {layout.n_cores} cores for this layout, got {len(cores)}")


def execute(chosen: Plan, x, cores: Sequence, layout: TTLayout, bias=None):
    """Run ``chosen`` on x (..., in) and the (gated) cores -> (..., out), like ``ops.matmul`` / ``ops.matmul_t``,
    plus ``bias`` (n_out,) if given (a plain add: on proxies the dtypes that decide an addmm fold are unknown).

    Only reshape / permute / t / mm / pad / slicing; every size comes from ``layout`` and the batch is always -1,
    so it traces on ``torch.fx.Proxy`` objects as well as running eagerly.
    """
    net = chosen.network
    _check_operands(chosen, cores, layout)
    n_in, n_out = (layout.rows, layout.cols) if net.op == "matmul" else (layout.cols, layout.rows)
    pad_in, pad_out = math.prod(net.in_modes), math.prod(net.out_modes)
    x2 = x.reshape(-1, n_in)
    if pad_in != n_in:
        x2 = F.pad(x2, (0, pad_in - n_in))
    stored = [x2, *cores]
    program = plan_program(chosen)
    for step, inst in zip(chosen.steps, program.instructions):
        left = _as_matrix(stored[step.left], inst.left_view, inst.left_dims, step.m, step.k, step.batched)
        right = _as_matrix(stored[step.right], inst.right_view, inst.right_dims, step.k, step.n, False)
        stored.append(torch.mm(left, right))
    out = stored[-1]
    if program.final_perm is not None:
        out = out.reshape((-1,) + program.final_dims).permute(program.final_perm)
    out = ops._trim_cols(out.reshape(-1, pad_out), n_out, pad_out)
    if bias is not None:
        out = out + bias
    return out.reshape(x.shape[:-1] + (n_out,))
