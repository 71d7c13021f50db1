"""Take a tensorized model out of the library: ``torch.export`` with dynamic batch / sequence sizes (``export``) and
an AOTInductor package that plain ``torch`` loads and runs (``package``).

Plain ``torch.export`` works too: while it traces, a TT product with a symbolic batch size runs one plan for the
size's declared range (``tt.range_plan``) instead of choosing per interval, which would emit guards. ``export`` pins
one plan per layer for the whole declared range explicitly (``plan_for_range``: the plan whose cost is nearest the
per-size best everywhere in the range, by the planner's inference cost model), then checks the range's ends
eagerly, so a range the model cannot run (positions past a position table, ...) is refused before anything is
deployed. The exported graph holds aten ops only: it is traced under ``no_grad``, where TT products skip their
custom ``autograd.Function``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping

import sympy
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .tt import layers, merged, plan_cache
from .tt import plan as planner
from .tt.range_plan import RangePlan, finite as _finite, plan_for_range

__all__ = [
    "ExportRangeError",
    "RangePlan",
    "batch_range",
    "check_aten_only",
    "export",
    "frozen",
    "package",
    "pinned_plans",
    "plan_for_range",
]


class ExportRangeError(ValueError):
    """The declared range of a dynamic dimension is one the model cannot run on."""


@contextlib.contextmanager
def frozen(model: nn.Module):
    """Serve ``model`` with weights that do not change inside the block: eager no-grad products of few tokens
    (decoding) use each TT matrix's cached merged forms without reading the cores on every call to check them.

    Why: outside this block the cache compares the cores bit for bit on every call, because a fused optimizer step
    or a write through ``param.data`` changes them without bumping their version counters; that read costs about a
    fifth of a GPT-2-small decode step at batch 1. Inside, the forms are keyed on the cores' storage and version
    counters: swapping a tensor in or an in-place write that autograd tracks is still seen; a fused optimizer step
    or a ``.data`` write inside the block is not (train outside it). Entering drops the forms made before, so
    changes made before the block are always seen. Nests; a copy of the model made inside is not frozen.

        with comera_fx.frozen(model):
            out = model.generate(ids, max_new_tokens=32)
    """
    matrices = [m for m in model.modules() if isinstance(m, layers.TTMatrix)]
    for matrix in matrices:
        depth = matrix.__dict__.get(merged.FROZEN, 0)
        if depth == 0:
            matrix.__dict__.pop("_merged", None)
        matrix.__dict__[merged.FROZEN] = depth + 1
    try:
        yield model
    finally:
        for matrix in matrices:
            depth = matrix.__dict__.get(merged.FROZEN, 1) - 1
            if depth:
                matrix.__dict__[merged.FROZEN] = depth
            else:
                matrix.__dict__.pop(merged.FROZEN, None)


def batch_range(batch) -> tuple[int, int]:
    """(lo, hi) of a TT product's batch size: an int's own value, or the bounds of a symbolic size under
    ``torch.export`` (the declared ranges of the input dims it is made of)."""
    if not isinstance(batch, torch.SymInt):
        return int(batch), int(batch)
    node = batch.node
    bounds = node.shape_env.bound_sympy(node.expr)
    if not (_finite(bounds.lower) and _finite(bounds.upper)):
        raise ExportRangeError(
            f"a TT layer's batch size {node.expr} has no finite range ({bounds.lower}, "
            f"{bounds.upper}); give every dynamic dimension a max (torch.export.Dim(name, max=...))"
        )
    return int(bounds.lower), int(bounds.upper)


@contextlib.contextmanager
def pinned_plans(model: nn.Module, chosen: dict | None = None):
    """While active, every TT product of ``model`` runs the ``plan_for_range`` plan of its batch size's range
    instead of choosing per interval; ``chosen`` (a dict) collects ``{(layout, op, lo, hi, launch): RangePlan}``
    (``launch``: the launch cost of the device the product runs on, from the envelope it would have chosen in)."""
    for module in model.modules():
        if isinstance(module, layers.TTMatrix) and not module.is_zero:
            module.prepare_plans()  # a traced call reads the envelope cache, it does not fill it
    chosen = {} if chosen is None else chosen

    def pick(envelope: planner.PlanEnvelope, batch) -> planner.Plan:
        lo, hi = batch_range(batch)
        key = (envelope.network.layout, envelope.network.op, lo, hi, envelope.model.launch)
        if key not in chosen:
            chosen[key] = plan_for_range(*key[:4], launch=key[4])
        return chosen[key].plan

    before, plan_cache.PLAN_OVERRIDE = plan_cache.PLAN_OVERRIDE, pick
    try:
        yield chosen
    finally:
        plan_cache.PLAN_OVERRIDE = before


def export(
    model: nn.Module, example_inputs, kwargs: Mapping | None = None, *, dynamic_shapes=None, check_range: bool = True
) -> torch.export.ExportedProgram:
    """``torch.export`` of a (tensorized, possibly pruned) model for inference, valid at every size in the declared
    ranges.

    Args:
        model: traced as it is (call ``model.eval()`` first for inference), under ``torch.no_grad``.
        example_inputs: a tensor or a tuple of positional inputs; ``kwargs`` the keyword inputs.
        dynamic_shapes: as ``torch.export.export`` takes them, e.g. ``({0: Dim("batch", max=64), 1: Dim("seq",
            max=512)},)``. Every dynamic dimension needs a finite max: each TT layer's plan is chosen for it.
        check_range: run the eager model at both ends of every dynamic dimension's range (the others at the
            example's sizes; the examples are tiled or cut to size) and refuse a range it fails on.

    Raises ``ExportRangeError`` naming the dimension when the range is one the model does not support, and
    ``RuntimeError`` if the graph holds anything but aten ops (a package could not run it). The program itself
    refuses inputs outside the declared ranges, naming the dimension, and inputs of another number of dimensions
    (``rank_checked_inputs``).
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(kwargs or {})
    with torch.no_grad(), pinned_plans(model), rank_checked_inputs(model):
        try:
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except torch._dynamo.exc.UserError as error:
            raise ExportRangeError(f"the model cannot be exported for the declared ranges: {error}") from error
    check_aten_only(program)
    if check_range:
        for name, size, bound, inputs in _range_ends(program, args, kwargs):
            try:
                with torch.no_grad():
                    model(*inputs[0], **inputs[1])
            except Exception as error:
                raise ExportRangeError(
                    f"the model fails when {name} = {size}, the declared {bound} of that "
                    f"dimension: {type(error).__name__}: {error}. Declare a range the model "
                    f"supports"
                ) from error
    return program


@contextlib.contextmanager
def rank_checked_inputs(model: nn.Module):
    """While active, ``model``'s tensor inputs pass through an identity ``permute`` first, so that the exported
    graph refuses an input with another number of dimensions. Why: the guards torch generates for a program's
    ``module()`` check each dimension's size but not how many there are, and a TT product flattens its input's
    leading dimensions by element count, so a (B, 48, 1) input to a graph traced with (B, 48) ran and returned
    (B, out) where ``nn.Linear`` fails. The permute costs nothing (a view) and fails at run time on a wrong rank."""

    def check(_module, args, kwargs):
        def identity(value):
            return value.permute(*range(value.dim())) if isinstance(value, Tensor) else value

        return pytree.tree_map(identity, args), pytree.tree_map(identity, kwargs)

    handle = model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def check_aten_only(program: torch.export.ExportedProgram) -> None:
    """Raise unless every call in the graph is an aten op or symbolic-size arithmetic (what AOTInductor runs
    without Python)."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
            continue
        if getattr(target, "__module__", None) in ("_operator", "operator", "builtins", "math"):
            continue
        raise RuntimeError(
            f"the exported graph calls {target} ({node.name}), which is not an aten op; an "
            f"AOTInductor package could not run it"
        )


def _range_ends(program: torch.export.ExportedProgram, args: tuple, kwargs: dict):
    """For each dynamic size symbol and each end of its range: (a name for the dimension, the size, "min"/"max",
    (args, kwargs) resized to it, other dimensions at the example's sizes)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    placeholders = [
        node
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in program.graph_signature.user_inputs
    ]
    if len(placeholders) != len(leaves):
        return  # an input form this check does not map back; the export itself stands
    example_sizes: dict[sympy.Symbol, int] = {}
    where: dict[sympy.Symbol, str] = {}
    for node, leaf in zip(placeholders, leaves):
        if not isinstance(leaf, Tensor):
            continue
        for dim, size in enumerate(node.meta["val"].shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr not in where:
                example_sizes[expr] = leaf.shape[dim]
                where[expr] = f"{node.name}.size({dim})"
    for symbol, name in where.items():
        bounds = program.range_constraints[symbol]
        for bound, size in (("min", bounds.lower), ("max", bounds.upper)):
            if not _finite(size):
                raise ExportRangeError(f"{name} has no finite {bound}; declare one (torch.export.Dim)")
            values = {**example_sizes, symbol: int(size)}
            resized = [
                _resize(
                    leaf,
                    [
                        int(sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s).subs(values))
                        for s in node.meta["val"].shape
                    ],
                )
                if isinstance(leaf, Tensor)
                else leaf
                for node, leaf in zip(placeholders, leaves)
            ]
            yield name, int(size), bound, pytree.tree_unflatten(resized, spec)


def _resize(tensor: Tensor, shape: list[int]) -> Tensor:
    """``tensor`` tiled or cut along each dim to ``shape``: real example values (valid token ids, masks) at any size."""
    for dim, size in enumerate(shape):
        have = tensor.shape[dim]
        if have == 0:
            tensor = tensor.new_zeros(tensor.shape[:dim] + (size,) + tensor.shape[dim + 1 :])
            continue
        if size > have:
            repeats = [1] * tensor.dim()
            repeats[dim] = math.ceil(size / have)
            tensor = tensor.repeat(repeats)
        tensor = tensor.narrow(dim, 0, size)
    return tensor


def package(program: torch.export.ExportedProgram, path: str | os.PathLike) -> str:
    """Compile an exported program with AOTInductor into one ``.pt2`` file that ``torch._inductor.aoti_load_package``
    loads and runs in any process with the same torch, without comera_fx. Returns the file's path.

    The package checks its inputs' shapes against the declared ranges when the serving process sets
    ``AOTI_RUNTIME_CHECK_INPUTS=1`` (AOTInductor reads it at run time): a size outside them raises, naming the
    input and the dimension. Its lower-bound check is left out when a declared min is below 2, where AOTInductor
    would otherwise refuse sizes 1 (and 0) that the range holds.
    """
    path = os.fspath(path)
    if not path.endswith(".pt2"):
        raise ValueError(f"an AOTInductor package's path must end in .pt2, got {path!r}")
    import torch._inductor  # noqa: F401  (loads Inductor only when packaging)

    small = any(_finite(r.lower) and int(r.lower) < 2 for r in program.range_constraints.values())
    options = {"aot_inductor.check_lowerbound": False} if small else {}
    return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=options)
