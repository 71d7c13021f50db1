"""The planner's envelopes per (TT layout, product, device type), made once and shared by every TT matrix of that
layout: planning runs a subset DP and sympy, which eager calls do and compiled code only reads. Also the choice of
a plan for a batch size (``choose_plan``), which must emit no guard a compile or an export cannot keep."""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import plan as planner
from .layout import TTLayout
from .plan.cost import device_launch


#: How many (layout, op, device type) envelopes ``planned_envelope`` keeps. Every pruned layout is a new key, so
#: an unbounded cache would grow for the whole of a rank-adaptive run; 1024 covers both products of 512 live
#: layouts on one device type (a 24-layer transformer has ~150 TT matrices). The least recently planned or used
#: entry goes first.
ENVELOPE_CACHE_SIZE = 1024

# Plans per (layout, op, device type), shared by every TTMatrix of that layout on a device of that type (the
# type sets the cost model's launch term, ``planner.DEVICE_LAUNCH``). Planning runs a subset DP and sympy, which a
# compiled graph must not trace; eager calls (or ``prepare_plans``) fill this, compiled code only reads it.
# Evicting is safe: an evicted layout is planned again on its next eager call, and a region compiled while its
# layout is absent runs CoMERA's fixed order (``TTMatrix._planned_product``). Dynamo guards on this dict's keys,
# so an insertion or eviction recompiles the regions that read it; a hit (``move_to_end``) does not.
_ENVELOPES: "OrderedDict[tuple[TTLayout, str, str], planner.PlanEnvelope]" = OrderedDict()

#: How many forward-only envelopes (``backward=False``) ``planned_envelope`` keeps: ``comera_fx.rmm`` runs its
#: full-batch forward and dX products, which save nothing, in orders planned for inference. Every pruned layout adds
#: entries here too.
INFERENCE_ENVELOPE_CACHE_SIZE = 256

# Forward-only envelopes per (layout, op, device type), the same LRU as ``_ENVELOPES``.
_INFERENCE_ENVELOPES: "OrderedDict[tuple[TTLayout, str, str], planner.PlanEnvelope]" = OrderedDict()


def planned_envelope(layout: TTLayout, op: str, *, device, backward: bool = True) -> "planner.PlanEnvelope":
    """The planner's envelope for ``x @ M`` / ``x @ Mᵀ`` of this layout on ``device`` (a ``torch.device`` or a
    string; the cores' device: its type sets the launch cost, ``planner.DEVICE_LAUNCH``), made once and cached
    (LRU, at most ``ENVELOPE_CACHE_SIZE`` entries; ``INFERENCE_ENVELOPE_CACHE_SIZE`` for the forward-only plans of
    ``backward=False``). Each plan's program, runner and autograd.Function are made with it."""
    cache, size = (
        (_ENVELOPES, ENVELOPE_CACHE_SIZE) if backward else (_INFERENCE_ENVELOPES, INFERENCE_ENVELOPE_CACHE_SIZE)
    )
    key = (layout, op, planner.device_type(device))
    envelope = cache.get(key)
    if envelope is not None:
        cache.move_to_end(key)
        return envelope
    envelope = planner.plan(layout, op=op, backward=backward, launch=device_launch(device))
    for piece in envelope.pieces:
        planner.prepare_plan(piece.plan)  # its program, runner and autograd.Function now, outside any traced region
    cache[key] = envelope
    while len(cache) > size:
        cache.popitem(last=False)
    return envelope


def cached_envelope(layout: TTLayout, op: str, *, device, backward: bool = True) -> "planner.PlanEnvelope | None":
    """The envelope ``planned_envelope`` made for (layout, op) on a device of ``device``'s type, or None. Never
    plans and leaves the LRU order alone: what code running under ``torch.compile`` may read."""
    return (_ENVELOPES if backward else _INFERENCE_ENVELOPES).get((layout, op, planner.device_type(device)))


def planned_ops(layout: TTLayout, *, device) -> list[str]:
    """The products ("matmul", "matmul_t") already planned for ``layout`` on a device of ``device``'s type."""
    return [op for op in planner.OPS if (layout, op, planner.device_type(device)) in _ENVELOPES]


#: ``(envelope, batch) -> Plan`` that replaces the choice by batch interval while set (a plain global: Dynamo
#: guards on it being None); ``comera_fx.export`` sets it to pin one plan per layer for a declared range of sizes,
#: so the choice emits no guard on the batch size.
PLAN_OVERRIDE = None


def choose_plan(envelope: "planner.PlanEnvelope", batch) -> "planner.Plan":
    """The envelope's plan for ``batch`` using comparisons only: under ``torch.compile(dynamic=True)`` each one is
    a guard at a breakpoint, so there is one graph per planner interval, not per batch size."""
    if PLAN_OVERRIDE is not None:
        return PLAN_OVERRIDE(envelope, batch)
    if isinstance(batch, torch.SymInt) and torch.compiler.is_exporting():
        # stock torch.export: a comparison here would be a guard export refuses; one plan for the declared range
        from .range_plan import export_plan

        return export_plan(envelope, batch)
    for piece in envelope.pieces[:-1]:
        if piece.last is not None and batch <= piece.last:
            return piece.plan
    return envelope.pieces[-1].plan
