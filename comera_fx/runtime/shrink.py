"""Physical removal of rank slices from a TT matrix: cores, gates, gradients and the optimizer's state shrink
together, and the new parameters take the old ones' places in the optimizer.

``shrink_`` removes the dead slices (|g| <= threshold, CoMERA's rule); ``remove_slices_`` removes whichever
slices the caller chooses; ``round_to_ranks_`` TT-rounds to given ranks (the budget schedule). All return a
``ShrinkRecord``.

``round_to_ranks_(..., in_place=True)`` writes the rounded cores into the stored ones instead, zero past the new
ranks (gates too): the stored shapes and the parameter objects stay, so a compiled graph that holds the matrix
runs on without a recompile, and the zero slices get exactly zero gradients (each is multiplied by a zero gate
or a zero slice of the neighbouring core), so no optimizer moves them. ``compact_`` later removes them
physically, all matrices at once (``RankAdaptive(shrink_slack=...)``: one recompile for many prunes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..tt.inventory import DEFAULT_GATE_THRESHOLD, physical_params
from ..tt.layers import TTMatrix
from ..tt.plan_cache import planned_ops


def params_at_ranks(tt: TTMatrix, internal_ranks: Sequence[int]) -> int:
    """Cores + gates of ``tt`` if its bonds had ``internal_ranks``; 0 once a bond is 0 (the matrix is zero and
    pruning empties every core)."""
    if any(r == 0 for r in internal_ranks):
        return 0
    return tt.layout.with_ranks((1, *internal_ranks, 1)).num_params  # num_params counts the gates too


def live_params(tt: TTMatrix) -> int:
    """Cores + gates at the live ranks: the matrix's true size (``physical_params`` unless held wider)."""
    if tt.live_internal_ranks is None:
        return physical_params(tt)
    return params_at_ranks(tt, tt.live_internal_ranks)


@dataclass(frozen=True)
class ShrinkRecord:
    """What one shrink did to one matrix. ``zeroed``: a bond lost every slice, so the whole matrix is zero and
    every core is now empty (the layer keeps only its bias). ``kept[k]``: the indices of bond k's slices that were
    kept (all of them when the bond did not change; none when the matrix was zeroed)."""

    name: str
    old_ranks: tuple[int, ...]
    new_ranks: tuple[int, ...]
    params_before: int
    params_after: int
    zeroed: bool
    kept: tuple[tuple[int, ...], ...] = ()


def _take(t: Tensor, first: Tensor | None, last: Tensor | None) -> Tensor:
    """Keep the given indices on the first and/or last axis (index_select copies, so the result owns its memory)."""
    if first is not None:
        t = t.index_select(0, first)
    if last is not None:
        t = t.index_select(t.dim() - 1, last)
    return t


def _slice_state(state: dict[str, Any], old: Tensor, fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """Slice every per-element optimizer state tensor (Adam's moments, SGD's momentum) like the parameter; keep
    scalars (``step``). Any other shape means a factored state we cannot slice safely, so refuse."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != old.shape:
                raise NotImplementedError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                    f"parameter's {tuple(old.shape)}; RankAdaptive can only slice "
                    f"elementwise optimizer states (Adam, AdamW, SGD, RMSprop, ...)"
                )
            value = fn(value)
        out[key] = value
    return out


def swap_parameter_(
    optimizer: torch.optim.Optimizer | None, old: nn.Parameter, new: nn.Parameter, fn: Callable[[Tensor], Tensor]
) -> None:
    """Put ``new`` at ``old``'s position in every param group and move ``old``'s state over, sliced by ``fn``."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if p is old:
                params[i] = new
    if old in optimizer.state:
        optimizer.state[new] = _slice_state(optimizer.state.pop(old), old, fn)


def _replace_(
    plist: nn.ParameterList, k: int, fn: Callable[[Tensor], Tensor], optimizer: torch.optim.Optimizer | None
) -> None:
    old = plist[k]
    new = nn.Parameter(fn(old.detach()), requires_grad=old.requires_grad)
    if old.grad is not None:  # keep accumulated gradients of a loop that does not zero them right after step
        new.grad = fn(old.grad)
    plist[k] = new
    swap_parameter_(optimizer, old, new, fn)


def remove_slices_(
    tt: TTMatrix, masks: Sequence[Tensor], *, optimizer: torch.optim.Optimizer | None = None, name: str = ""
) -> ShrinkRecord | None:
    """Keep, on every bond k, the slices where ``masks[k]`` (bool, one entry per slice) is True; remove the others.

    Gate k sits between core k (last axis) and core k+1 (first axis): its removed entries are dropped from all
    three, and the new parameters replace the old ones in ``tt``'s ParameterLists and in ``optimizer`` (same
    positions, state sliced to match). If a bond keeps nothing the matrix is zero and every core becomes empty
    (``TTMatrix.is_zero``). Returns None when nothing is removed.
    """
    if not tt.gates or tt.stored_empty:
        return None
    if [tuple(m.shape) for m in masks] != [tuple(g.shape) for g in tt.gates]:
        raise ValueError(
            f"{name or 'TTMatrix'}: masks of shapes {[tuple(m.shape) for m in masks]} do not match "
            f"the gates' {[tuple(g.shape) for g in tt.gates]}"
        )
    masks = [m.to(torch.bool) for m in masks]
    counts = torch.stack([m.sum().to(masks[0].device) for m in masks]).tolist()
    sizes = [m.numel() for m in masks]
    if counts == sizes:
        return None
    old_ranks, before, was_zero = tt.ranks, live_params(tt), tt.is_zero
    was_planned = planned_ops(tt.layout, device=tt.device)
    zeroed = 0 in counts
    if zeroed:
        masks = [torch.zeros_like(m) for m in masks]
    keep = [m.nonzero().squeeze(1) for m in masks]
    changed = [zeroed or c != s for c, s in zip(counts, sizes)]
    n = len(tt.cores)
    for k in range(n):
        first = keep[k - 1] if k > 0 and changed[k - 1] else None
        last = keep[k] if k < n - 1 and changed[k] else None
        if first is not None or last is not None:
            _replace_(tt.cores, k, lambda t, f=first, l=last: _take(t, f, l), optimizer)
    for k in range(n - 1):
        if changed[k]:
            _replace_(tt.gates, k, lambda t, i=keep[k]: t.index_select(0, i), optimizer)
    tt.live_internal_ranks = None  # stored = live from here on
    if not tt.is_zero:
        # Plan the new ranks now for what was planned before: a compiled model retraces after the shapes change,
        # and a traced graph can only read plans (without one it would run the fixed fallback order).
        tt.prepare_plans(was_planned)
    kept = tuple(tuple(k.tolist()) for k in keep)
    return ShrinkRecord(name, old_ranks, tt.ranks, before, physical_params(tt), zeroed and not was_zero, kept)


def shrink_(
    tt: TTMatrix,
    *,
    threshold: float = DEFAULT_GATE_THRESHOLD,
    optimizer: torch.optim.Optimizer | None = None,
    name: str = "",
) -> ShrinkRecord | None:
    """Remove the slices of ``tt`` whose gate entry is dead (|g| <= threshold), physically (``remove_slices_``).

    Exact when the dead entries are exactly 0; otherwise it drops terms of size <= threshold, as CoMERA's masking
    does. Returns None when nothing is dead.
    """
    if not tt.gates or tt.stored_empty:
        return None
    return remove_slices_(tt, [g.detach().abs() > threshold for g in tt.gates], optimizer=optimizer, name=name)


def compact_(tt: TTMatrix, *, optimizer: torch.optim.Optimizer | None = None, name: str = "") -> ShrinkRecord | None:
    """Remove the zero slices a matrix held wider keeps past its live ranks (``round_to_ranks_(in_place=True)``),
    physically: new parameters in the old ones' places in ``optimizer``. A live rank of 0 empties every core.
    Returns None when ``tt`` is not held wider."""
    live = tt.live_internal_ranks
    if live is None:
        return None
    masks = [torch.arange(g.numel(), device=g.device) < r for g, r in zip(tt.gates, live)]
    record = remove_slices_(tt, masks, optimizer=optimizer, name=name)
    tt.live_internal_ranks = None
    return record


def _fit(t: Tensor, axis: int, size: int) -> Tensor:
    """``t`` cut or zero-padded along ``axis`` to ``size`` (a copy: the result owns its memory)."""
    have = t.shape[axis]
    if have >= size:
        return t.narrow(axis, 0, size).clone()
    pad = list(t.shape)
    pad[axis] = size - have
    return torch.cat([t, t.new_zeros(pad)], dim=axis)


def resize_bonds_(
    tt: TTMatrix, widths: Sequence[int], *, optimizer: torch.optim.Optimizer | None = None, name: str = ""
) -> ShrinkRecord | None:
    """Store every bond k of ``tt`` at ``widths[k]`` slices (>= its live rank), physically: the live slices
    first, zeros (cores and gates) past them, cut or padded as needed; optimizer state and gradients follow, new
    parameters in the old ones' places. The matrix is then held wider wherever a width exceeds the live rank.
    Used to give the same matrix of repeated blocks one stored shape (``BudgetConfig.same_shape_blocks``); a zero
    matrix still stored (cut to rank 0 in place) is held at the widths, all zero. Returns None when every bond
    already has its width, or when the matrix stores nothing."""
    live = tuple(tt.live_internal_ranks or tt.layout.internal_ranks)
    widths = tuple(int(w) for w in widths)
    if len(widths) != len(live) or any(w < r for w, r in zip(widths, live)):
        raise ValueError(f"{name or 'TTMatrix'}: widths {widths} must give every bond at least its live rank {live}")
    if not tt.gates or tt.stored_empty:
        return None
    stored = tt.layout.internal_ranks
    if widths == stored:
        return None
    before, old_ranks, was_planned = live_params(tt), tt.ranks, planned_ops(tt.layout, device=tt.device)
    n = len(tt.cores)
    for k in range(n):
        first = widths[k - 1] if k > 0 and widths[k - 1] != stored[k - 1] else None
        last = widths[k] if k < n - 1 and widths[k] != stored[k] else None
        if first is not None or last is not None:

            def fit(t, f=first, l=last):
                t = _fit(t, 0, f) if f is not None else t
                return _fit(t, t.dim() - 1, l) if l is not None else t

            _replace_(tt.cores, k, fit, optimizer)
    for k in range(n - 1):
        if widths[k] != stored[k]:
            _replace_(tt.gates, k, lambda t, w=widths[k]: _fit(t, 0, w), optimizer)
    tt.live_internal_ranks = None if widths == live else live
    tt.prepare_plans(was_planned)
    return ShrinkRecord(name, old_ranks, tt.ranks, before, live_params(tt), False, ())


def block_role(name: str) -> str:
    """A matrix's name with every numeric component replaced by ``#``: the same matrix of every repeated block
    (``blocks.0.attn.q.tt`` and ``blocks.5.attn.q.tt``) has one role."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def same_shape_widths(named: Sequence[tuple[str, TTMatrix]]) -> dict[str, tuple[int, ...]]:
    """{name: stored width per bond} for matrices sharing a role (``block_role``) and modes with at least one
    other: the widest live rank of the group on each bond. A member cut to rank 0 but still stored gets the widths
    too (held all zero: a block whose layer went to rank 0 keeps the others' shape, so one graph still serves every
    block); members storing nothing, groups of zero matrices and lone matrices are left out."""
    groups: dict[tuple, list[tuple[str, TTMatrix]]] = {}
    for name, tt in named:
        if tt.gates and not tt.stored_empty:
            key = (block_role(name), tt.format, tt.rows, tt.cols, tt.row_modes, tt.col_modes)
            groups.setdefault(key, []).append((name, tt))
    widths = {}
    for members in groups.values():
        live = [tt.live_internal_ranks or tt.layout.internal_ranks for _, tt in members if not tt.is_zero]
        if len(members) > 1 and live:
            widest = tuple(max(bond) for bond in zip(*live))
            widths.update((name, widest) for name, _ in members)
    return widths


# ------------------------------------------------------------------------------------------------ TT rounding


def _fold_gates(tt: TTMatrix) -> list[Tensor]:
    """The live cores with their gates folded in (detached)."""
    cores, gates = [c.detach() for c in tt.live_cores()], tt.live_gates()
    return (
        [c * g.detach() if k < len(gates) else c for k, (c, g) in enumerate(zip(cores, [*gates, None]))]
        if gates
        else cores
    )


def tt_round(cores: Sequence[Tensor], ranks: Sequence[int] | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """TT rounding (Oseledets 2011, Alg. 2) of ungated cores: left-orthogonalise with QR, then sweep right to
    left with SVDs, keeping ``ranks[k]`` singular directions at bond k (None: all). Returns (new cores,
    singular values of every bond before truncation). The singular values are those of the matrix unfolding
    across the bond, so they do not depend on the gauge the cores happen to be in; truncating bond k alone
    changes the matrix by the discarded singular values (Frobenius), and all bonds together by at most the
    root of the sum of their squares."""
    dtype = cores[0].dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # QR/SVD need float32 at least
    cores = [c.to(work, copy=True) for c in cores]
    n = len(cores)
    for k in range(n - 1):
        shape = cores[k].shape
        q, r = torch.linalg.qr(cores[k].reshape(-1, shape[-1]))
        cores[k] = q.reshape(*shape[:-1], q.shape[1])
        nxt = cores[k + 1]
        cores[k + 1] = (r @ nxt.reshape(nxt.shape[0], -1)).reshape(r.shape[0], *nxt.shape[1:])
    sigmas: list[Tensor] = [torch.empty(0)] * (n - 1)
    for k in range(n - 1, 0, -1):
        shape = cores[k].shape
        u, s, vh = torch.linalg.svd(cores[k].reshape(shape[0], -1), full_matrices=False)
        sigmas[k - 1] = s
        keep = len(s) if ranks is None else max(1, min(ranks[k - 1], len(s)))
        u, s, vh = u[:, :keep], s[:keep], vh[:keep]
        cores[k] = vh.reshape(keep, *shape[1:])
        prev = cores[k - 1]
        cores[k - 1] = (prev.reshape(-1, prev.shape[-1]) @ (u * s)).reshape(*prev.shape[:-1], keep)
    return [c.to(dtype) for c in cores], sigmas


def bond_singular_values(tt: TTMatrix) -> list[Tensor]:
    """The singular values of every bond of ``tt`` (gates folded in), largest first; fewer than the bond's rank
    when the bond is larger than the matrix needs."""
    with torch.no_grad():
        return tt_round(_fold_gates(tt))[1]


def round_to_ranks_(
    tt: TTMatrix,
    internal_ranks: Sequence[int],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    name: str = "",
    in_place: bool = False,
) -> ShrinkRecord | None:
    """Reduce ``tt`` to ``internal_ranks`` by TT rounding: the best directions of every bond are kept (not the
    stored slices), gates reset to 1. A rank of 0 anywhere zeroes the matrix. The new cores are new parameters in
    the old ones' places in ``optimizer``; their optimizer state is dropped (the moments refer to a basis that no
    longer exists) and starts afresh at the next step. Returns None when no live rank falls.

    ``in_place``: keep the stored shapes and parameter objects (the matrix is held wider, see the module
    docstring); the rounded cores are written into the first ``internal_ranks`` slices, zeros past them, and the
    optimizer's state of the matrix is dropped likewise."""
    live = tt.ranks[1:-1]
    if not tt.gates or tt.is_zero or all(new >= old for new, old in zip(internal_ranks, live)):
        return None
    internal_ranks = tuple(min(new, old) for new, old in zip(internal_ranks, live))
    old_ranks, before = tt.ranks, live_params(tt)
    if in_place:
        _write_in_place_(tt, internal_ranks, optimizer)
        return ShrinkRecord(name, old_ranks, tt.ranks, before, live_params(tt), tt.is_zero, ())
    if any(r == 0 for r in internal_ranks):
        return remove_slices_(
            tt, [torch.zeros_like(g, dtype=torch.bool) for g in tt.gates], optimizer=optimizer, name=name
        )
    was_planned = planned_ops(tt.layout, device=tt.device)
    with torch.no_grad():
        cores, _ = tt_round(_fold_gates(tt), internal_ranks)
    for plist, new_values in ((tt.cores, cores), (tt.gates, [c.new_ones(c.shape[-1]) for c in cores[:-1]])):
        for k, value in enumerate(new_values):
            old = plist[k]
            new = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
            plist[k] = new
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["params"][:] = [new if p is old else p for p in group["params"]]
                optimizer.state.pop(old, None)
    tt.live_internal_ranks = None  # every core and gate is new, at the new ranks
    tt.prepare_plans(was_planned)
    return ShrinkRecord(name, old_ranks, tt.ranks, before, physical_params(tt), False, ())


def _write_in_place_(tt: TTMatrix, internal_ranks: Sequence[int], optimizer: torch.optim.Optimizer | None) -> None:
    """TT-round ``tt`` to ``internal_ranks`` into its stored cores: the rounded values in the leading slices,
    zeros (cores and gates) past them; gradients and optimizer state of the matrix dropped. A rank of 0 anywhere
    zeroes every core and gate (the products then compute an exact zero until ``compact_`` empties them)."""
    zeroed = any(r == 0 for r in internal_ranks)
    with torch.no_grad():
        if zeroed:
            cores, internal_ranks = [None] * len(tt.cores), (0,) * len(tt.gates)
        else:
            cores, _ = tt_round(_fold_gates(tt), internal_ranks)
            internal_ranks = tuple(c.shape[-1] for c in cores[:-1])  # a bond holds at most what it needs
        for plist, values in ((tt.cores, cores), (tt.gates, [None] * len(tt.gates))):
            for k, value in enumerate(values):
                param = plist[k]
                param.zero_()
                if plist is tt.gates:
                    param[: internal_ranks[k]] = 1
                elif value is not None:
                    param[tuple(slice(0, n) for n in value.shape)] = value
                param.grad = None
                if optimizer is not None:
                    optimizer.state.pop(param, None)
    tt.live_internal_ranks = tuple(internal_ranks)
