"""``assert_rewrite_equivalent``: does a rewrite (a graph pass or a model-level rewrite) keep a model's function?

It compares outputs and gradients of the original and the rewritten model, and when they differ it finds *where*:
both models are re-run recording every intermediate value (an ``fx.Interpreter`` over the graph, or forward hooks
on every module) and the first node of the original, in topological order, whose rewritten counterpart differs is
named in the ``AssertionError``. Needs no Hypothesis.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..passes.find import split_example_inputs

__all__ = ["Divergence", "RewriteMismatch", "assert_rewrite_equivalent", "default_tolerances", "takes_graph_module"]

Rewrite = Callable[[nn.Module], Any]

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


@dataclass
class Divergence:
    """Where the rewritten model first departs from the original.

    what: "forward" (an intermediate or output value), "input gradient", "parameter gradient", "compiled"
    (only the ``torch.compile``d rewrite differs) or "error" (the rewritten model raised).
    node: the original graph's node name (module FQN when the models are compared module by module).
    """

    what: str
    node: str | None = None
    op: str | None = None
    target: str | None = None
    max_abs_error: float | None = None
    original_shape: tuple[int, ...] | None = None
    rewritten_shape: tuple[int, ...] | None = None


class RewriteMismatch(AssertionError):
    """The rewritten model does not compute what the original does; ``str(exc)`` is the report.

    ``divergence`` locates the first difference; ``case`` is set by ``check_pass`` to the (shrunk) example.
    """

    def __init__(self, report: str, divergence: Divergence, case: Any = None):
        super().__init__(report)
        self.report = report
        self.divergence = divergence
        self.case = case

    def with_case(self, case: Any) -> "RewriteMismatch":
        """Prefix the report with the example that failed (``check_pass`` calls this)."""
        self.case = case
        self.report = f"Falsifying case: {case!r}\n{self.report}"
        self.args = (self.report,)
        return self


# ------------------------------------------------------------------------------------------------ the rewrite


def takes_graph_module(rewrite: Rewrite) -> bool | None:
    """True if the rewrite's first parameter is annotated ``fx.GraphModule``, False for another ``nn.Module``
    annotation, None when unannotated (string annotations from ``from __future__ import annotations`` count)."""
    try:
        signature = inspect.signature(rewrite, eval_str=True)
    except Exception:  # unresolvable string annotations: read them as strings below
        try:
            signature = inspect.signature(rewrite)
        except (TypeError, ValueError):
            return None
    positional = [p for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not positional or positional[0].annotation is inspect.Parameter.empty:
        return None
    annotation = positional[0].annotation
    if isinstance(annotation, str):
        name = annotation.rsplit(".", 1)[-1]
        return True if name == "GraphModule" else (False if name in ("Module", "nn.Module") else None)
    if isinstance(annotation, type) and issubclass(annotation, nn.Module):
        return issubclass(annotation, fx.GraphModule)
    return None


def _run_rewrite(rewrite: Rewrite, module: nn.Module) -> nn.Module:
    """A rewrite returns the new module, or edits in place and returns something else (e.g. a summary)."""
    result = rewrite(module)
    return result if isinstance(result, nn.Module) else module


def _trace(module: nn.Module) -> fx.GraphModule:
    return copy.deepcopy(module) if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module)


def apply_rewrite(reference: nn.Module, rewrite: Rewrite, graph: bool | None) -> tuple[nn.Module, bool]:
    """Rewrite a copy of ``reference``; returns (rewritten module, whether it was rewritten as a GraphModule).

    ``graph=None`` asks ``takes_graph_module``; still undecided, the rewrite is tried on the module and, if that
    raises, on its ``symbolic_trace``.
    """
    if graph is None:
        graph = takes_graph_module(rewrite)
    if graph:
        return _run_rewrite(rewrite, _trace(copy.deepcopy(reference))), True
    if graph is False or isinstance(reference, fx.GraphModule):
        return _run_rewrite(rewrite, copy.deepcopy(reference)), isinstance(reference, fx.GraphModule)
    try:
        return _run_rewrite(rewrite, copy.deepcopy(reference)), False
    except Exception as module_error:
        try:
            return _run_rewrite(rewrite, _trace(copy.deepcopy(reference))), True
        except Exception:
            raise module_error from None


# ------------------------------------------------------------------------------------------------- running


@dataclass
class _Run:
    outputs: list[Any]
    output_spec: Any
    input_grads: dict[str, Tensor]
    param_grads: dict[str, Tensor]


def _cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Float tensors to ``dtype``; a tensor already in ``dtype`` is kept as is (strides included)."""
    def cast(x):
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.detach().to(dtype)
        return x.detach() if isinstance(x, Tensor) else x
    return pytree.tree_map(cast, (args, kwargs))


def _input_name(path) -> str:
    """'args[0]' or "kwargs['mask']" for a leaf of (args, kwargs)."""
    return ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])


def _cotangents(outputs: list[Tensor]) -> list[Tensor]:
    """A fixed random output gradient: a plain sum would hide errors (LayerNorm's output sums to a constant)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.dtype).to(o.device)
            for o in outputs]


def _run(model: nn.Module, args: tuple, kwargs: dict, grads: bool) -> _Run:
    """Run once; with ``grads``, backpropagate a fixed random cotangent to the float inputs and the parameters."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    fresh, grad_inputs = [], {}
    for path, leaf in leaves:
        if grads and isinstance(leaf, Tensor) and leaf.is_floating_point():
            leaf = leaf.detach().requires_grad_(True)  # a new leaf, same storage and strides
            grad_inputs[_input_name(path)] = leaf
        fresh.append(leaf)
    call_args, call_kwargs = pytree.tree_unflatten(fresh, spec)
    with torch.set_grad_enabled(grads):
        out = model(*call_args, **call_kwargs)
    outputs, output_spec = pytree.tree_flatten(out)
    run = _Run([_detach(o) for o in outputs], output_spec, {}, {})
    if not grads:
        return run
    differentiable = [o for o in outputs if isinstance(o, Tensor) and o.requires_grad]
    # Every parameter gets a gradient entry; a frozen one gets zeros, so a rewrite that freezes a weight shows.
    named = list(model.named_parameters(remove_duplicate=False))
    unique = list({id(p): p for _, p in named if p.requires_grad}.values())
    wrt = list(grad_inputs.values()) + unique
    if differentiable and wrt:
        got = torch.autograd.grad(differentiable, wrt, _cotangents(differentiable), allow_unused=True)
    else:
        got = [None] * len(wrt)
    got = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, got)]
    run.input_grads = dict(zip(grad_inputs, got[: len(grad_inputs)]))
    by_id = {id(p): g for p, g in zip(unique, got[len(grad_inputs):])}
    run.param_grads = {n: by_id.get(id(p), torch.zeros_like(p)) for n, p in named}
    return run


def _detach(value):
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, value)


# ---------------------------------------------------------------------------------------------- comparing


@dataclass
class _Difference:
    max_abs_error: float | None
    original_shape: tuple[int, ...] | None
    rewritten_shape: tuple[int, ...] | None
    reason: str


def _shape(x) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, Tensor) else None


def _compare(original, rewritten, rtol: float, atol: float) -> _Difference | None:
    """None if ``rewritten`` matches ``original`` (allclose for floats, equality otherwise), else what differs."""
    a_leaves, a_spec = pytree.tree_flatten(original)
    b_leaves, b_spec = pytree.tree_flatten(rewritten)
    if a_spec != b_spec:
        return _Difference(None, None, None, f"structure differs: {a_spec} vs {b_spec}")
    worst = None
    for a, b in zip(a_leaves, b_leaves):
        if isinstance(a, Tensor) != isinstance(b, Tensor):
            return _Difference(None, _shape(a), _shape(b), f"{type(a).__name__} vs {type(b).__name__}")
        if not isinstance(a, Tensor):
            try:
                same = bool(a == b)
            except Exception:  # objects without a usable ==: nothing to compare
                same = True
            if not same:
                return _Difference(None, None, None, f"{a!r} vs {b!r}")
            continue
        if a.shape != b.shape:
            return _Difference(None, tuple(a.shape), tuple(b.shape), "shapes differ")
        if a.dtype != b.dtype:
            return _Difference(None, tuple(a.shape), tuple(b.shape), f"dtypes differ: {a.dtype} vs {b.dtype}")
        if not a.is_floating_point() and not a.is_complex():
            if not torch.equal(a, b.to(a.device)):
                error = float((a.double() - b.to(a.device).double()).abs().max())
                return _Difference(error, tuple(a.shape), tuple(b.shape), "values differ")
            continue
        b = b.to(a.device)
        if a.numel() == 0 or torch.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
            continue
        error = float(torch.nan_to_num((a - b).abs(), nan=float("inf")).max())
        if worst is None or error > worst.max_abs_error:
            worst = _Difference(error, tuple(a.shape), tuple(b.shape), "values differ")
    return worst


# ------------------------------------------------------------------------------------- locating divergence


class _RecordingInterpreter(fx.Interpreter):
    """Runs a GraphModule node by node, keeping every node's value by name (and call_module values by FQN)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.by_name: dict[str, Any] = {}
        self.by_module: dict[str, list[Any]] = defaultdict(list)
        self.failed_node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception:
            self.failed_node = n
            raise
        self.by_name[n.name] = _detach(result)
        if n.op == "call_module":
            self.by_module[n.target].append(self.by_name[n.name])
        return result


def _positional(gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple:
    """Placeholders take positional values; bind keyword inputs through the generated forward's signature."""
    if not kwargs:
        return args
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args)


def _record_modules(model: nn.Module, args: tuple, kwargs: dict) -> tuple[dict, list]:
    """Outputs of every module call by FQN (a module called twice has two entries), in completion order."""
    by_module: dict[str, list[Any]] = defaultdict(list)
    order: list[tuple[str, int]] = []
    handles = []

    def hook_for(name: str):
        def hook(module, inputs, output):
            order.append((name, len(by_module[name])))
            by_module[name].append(_detach(output))
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook_for(name)))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return by_module, order


def _first_divergence_in_graphs(reference: nn.Module, rewritten: fx.GraphModule, args, kwargs, rtol, atol,
                                lines: list[str]) -> Divergence | None:
    """Walk the original's graph in topological order; compare each node with the rewritten node of the same name
    (or, for call_module, the same module FQN and call index). Returns the first that differs."""
    original_gm = _trace(reference)
    original = _RecordingInterpreter(original_gm)
    with torch.no_grad():
        original.run(*_positional(original_gm, args, kwargs))
    candidate = _RecordingInterpreter(rewritten)
    try:
        with torch.no_grad():
            candidate.run(*_positional(rewritten, args, kwargs))
    except Exception as exc:
        n = candidate.failed_node
        where = f"node %{n.name} ({n.op} {_target_str(n)})" if n is not None else "an unknown node"
        lines.append(f"The rewritten graph raised at {where}: {type(exc).__name__}: {exc}")
        return Divergence("error", n.name if n is not None else None, n.op if n is not None else None,
                          _target_str(n) if n is not None else None)
    rewritten_nodes = {n.name: n for n in rewritten.graph.nodes}
    original_names = {n.name for n in original_gm.graph.nodes}
    replacements = _replacements(original_gm, rewritten_nodes, original_names)
    module_calls: dict[str, int] = defaultdict(int)
    agreeing, last_agreeing, unmatched = 0, None, []
    for node in original_gm.graph.nodes:
        value = original.by_name.get(node.name)
        twin, other, found = _counterpart(node, value, rewritten_nodes, candidate, module_calls, replacements)
        if node.op == "call_module":
            module_calls[node.target] += 1
        if not found:
            unmatched.append(node.name)
            continue
        difference = _compare(value, other, rtol, atol)
        if difference is None:
            agreeing, last_agreeing = agreeing + 1, node
            continue
        divergence = Divergence("forward", node.name, node.op, _target_str(node), difference.max_abs_error,
                                difference.original_shape, difference.rewritten_shape)
        lines.append(_describe_node_difference(node, twin, difference, rtol, atol, original_names, set(unmatched)))
        if node.op == "call_module" and twin is not None and twin.name == node.name:
            before_module, after_module = repr(original_gm.get_submodule(node.target)), _module_repr(rewritten, node)
            if after_module is not None and after_module != before_module:
                lines.append(f"  original module : {before_module}\n  rewritten module: {after_module}")
            changed = _changed_state(original_gm, rewritten, node.target)
            if changed:
                lines.append(f"  its parameters/buffers changed: {changed}")
        before = f" (last: %{last_agreeing.name})" if last_agreeing is not None else ""
        replaced = (f"; {len(unmatched)} original node(s) have no counterpart in the rewrite{_list(unmatched)}"
                    if unmatched else "")
        lines.append(f"  {agreeing} matched node(s) before it agree{before}{replaced}.")
        return divergence
    return None


def _replacements(original_gm: fx.GraphModule, rewritten_nodes: dict[str, fx.Node],
                  original_names: set[str]) -> dict[str, str]:
    """Original node -> the rewritten node that took its place, read off the nodes both graphs kept.

    If a kept node (same name and op in both) read original input %a where the rewrite reads a new node %b at the
    same position, then %b replaced %a (e.g. a linear swapped for its TT contraction ending in %add_3).
    """
    mapping: dict[str, str] = {}
    for node in original_gm.graph.nodes:
        twin = rewritten_nodes.get(node.name)
        if twin is None or twin.op != node.op:
            continue
        for old, new in zip(node.all_input_nodes, twin.all_input_nodes):
            kept = old.name in rewritten_nodes and rewritten_nodes[old.name].op == old.op
            if not kept and new.name not in original_names:
                mapping.setdefault(old.name, new.name)
    return mapping


def _counterpart(node: fx.Node, value: Any, rewritten_nodes: dict[str, fx.Node], candidate: _RecordingInterpreter,
                 module_calls: dict[str, int], replacements: dict[str, str]) -> tuple[fx.Node | None, Any, bool]:
    """(rewritten node or None, its value, found?): same name and op, else same module call, else replacement."""
    twin = rewritten_nodes.get(node.name)
    if twin is not None and twin.op == node.op and node.name in candidate.by_name:
        return twin, candidate.by_name[node.name], True
    if node.op == "call_module" and module_calls[node.target] < len(candidate.by_module.get(node.target, ())):
        return None, candidate.by_module[node.target][module_calls[node.target]], True
    replacement = replacements.get(node.name)
    if replacement is not None and replacement in candidate.by_name:
        other = candidate.by_name[replacement]
        if _same_layout(value, other):  # else the inference was wrong; a later kept node will tell
            return rewritten_nodes[replacement], other, True
    return None, None, False


def _same_layout(a: Any, b: Any) -> bool:
    a_leaves, a_spec = pytree.tree_flatten(a)
    b_leaves, b_spec = pytree.tree_flatten(b)
    return a_spec == b_spec and all(
        (x.shape, x.dtype) == (y.shape, y.dtype) if isinstance(x, Tensor) and isinstance(y, Tensor)
        else type(x) is type(y) for x, y in zip(a_leaves, b_leaves))


def _first_divergence_in_modules(reference: nn.Module, rewritten: nn.Module, args, kwargs, rtol, atol,
                                 lines: list[str]) -> Divergence | None:
    """Module-level comparison (for rewrites of the module tree): forward hooks on both, matched by FQN."""
    original, order = _record_modules(reference, args, kwargs)
    try:
        candidate, _ = _record_modules(rewritten, args, kwargs)
    except Exception as exc:
        lines.append(f"The rewritten model raised: {type(exc).__name__}: {exc}")
        return Divergence("error")
    agreeing, last_agreeing, unmatched = 0, None, []
    for name, index in order:
        if index >= len(candidate.get(name, ())):
            unmatched.append(name or "<root>")
            continue
        difference = _compare(original[name][index], candidate[name][index], rtol, atol)
        if difference is None:
            agreeing, last_agreeing = agreeing + 1, name
            continue
        label = name or "<root>"
        call = f" (call {index + 1})" if len(original[name]) > 1 else ""
        kind = type(reference.get_submodule(name)).__name__
        new_kind = type(rewritten.get_submodule(name)).__name__ if name in dict(rewritten.named_modules()) else "?"
        lines.append(f"First diverging module: {label}{call} ({kind} -> {new_kind} in the rewrite)")
        lines.append(_shapes_line(difference, rtol, atol))
        before = f" (last: {last_agreeing or '<root>'})" if last_agreeing is not None else ""
        replaced = (f"; {len(unmatched)} original module call(s) have no counterpart{_list(unmatched)}"
                    if unmatched else "")
        lines.append(f"  {agreeing} module call(s) before it agree{before}{replaced}.")
        return Divergence("forward", label, "call_module", kind, difference.max_abs_error,
                          difference.original_shape, difference.rewritten_shape)
    return None


def _changed_state(original: nn.Module, rewritten: nn.Module, path: str) -> str:
    """Which direct parameters/buffers of module ``path`` the rewrite changed, e.g. 'weight (max abs diff 0.1)'."""
    try:
        before, after = original.get_submodule(path), rewritten.get_submodule(path)
    except AttributeError:
        return ""
    old = dict(before.named_parameters(recurse=False)) | dict(before.named_buffers(recurse=False))
    new = dict(after.named_parameters(recurse=False)) | dict(after.named_buffers(recurse=False))
    changes = []
    for name in old.keys() | new.keys():
        if name not in new or new[name] is None:
            changes.append(f"{name} (gone)")
        elif name not in old or old[name] is None:
            changes.append(f"{name} (new)")
        elif old[name].shape != new[name].shape:
            changes.append(f"{name} (shape {tuple(old[name].shape)} -> {tuple(new[name].shape)})")
        elif not torch.equal(old[name], new[name].to(old[name].device)):
            diff = float((old[name].detach() - new[name].detach().to(old[name].device)).abs().max())
            changes.append(f"{name} (max abs diff {diff:.3g})")
    return ", ".join(sorted(changes))


def _broken_ties(reference: nn.Module, rewritten: nn.Module) -> list[tuple[str, ...]]:
    """Names that hold one parameter in the original but, all still present, several in the rewrite.

    (A rewrite that replaces a tied weight by something else, as tensorize does, removes the names: not broken.)
    """
    names: dict[int, list[str]] = defaultdict(list)
    for name, p in reference.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    after = dict(rewritten.named_parameters(remove_duplicate=False))
    return [tuple(group) for group in names.values()
            if len(group) > 1 and all(n in after for n in group) and len({id(after[n]) for n in group}) > 1]


def _module_repr(gm: fx.GraphModule, node: fx.Node) -> str | None:
    try:
        return repr(gm.get_submodule(node.target))
    except AttributeError:
        return None


def _list(names: list[str], limit: int = 8) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f": {shown}"


def _target_str(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def _shapes_line(difference: _Difference, rtol: float, atol: float) -> str:
    error = f"max abs error {difference.max_abs_error:.3g}" if difference.max_abs_error is not None else \
        difference.reason
    return (f"  original shape {difference.original_shape}, rewritten shape {difference.rewritten_shape}: {error} "
            f"(allowed: {atol:g} + {rtol:g}·|original|)")


def _node_kind(node: fx.Node) -> str:
    if node.op == "output":
        return "the graph's output"
    if node.op == "placeholder":
        return "an input"
    return f"{node.op} {_target_str(node)}"


def _describe_node_difference(node: fx.Node, twin: fx.Node | None, difference: _Difference, rtol, atol,
                              original_names: set[str], replaced: set[str]) -> str:
    lines = [f"First diverging node: %{node.name} ({_node_kind(node)})", _shapes_line(difference, rtol, atol),
             f"  original : {node.format_node()}"]
    if twin is not None and twin.name != node.name:
        lines[0] += f", replaced in the rewrite by %{twin.name} ({_node_kind(twin)})"
    if twin is not None:
        lines.append(f"  rewritten: {twin.format_node()}")
        new_inputs = [n.name for n in twin.all_input_nodes if n.name not in original_names]
        if new_inputs:
            lines.append(f"  it reads node(s) the rewrite added: {', '.join('%' + n for n in new_inputs)}")
    else:
        lines.append("  (matched to the rewritten graph by module FQN)")
    replaced_inputs = [n.name for n in node.all_input_nodes if n.name in replaced]
    if replaced_inputs:
        lines.append(f"  its original input(s) {', '.join('%' + n for n in replaced_inputs)} have no counterpart in "
                     f"the rewrite: the difference arises in what replaced them")
    return "\n".join(lines)


def _readers_of(reference: nn.Module, fqn: str) -> list[str]:
    """Nodes of the original's graph (or module FQNs) that read parameter ``fqn``."""
    owner = fqn.rpartition(".")[0]
    try:
        gm = _trace(reference)
    except Exception:
        return [owner or "<root>"]
    readers = [n.name for n in gm.graph.nodes
               if (n.op == "get_attr" and n.target == fqn) or (n.op == "call_module" and n.target == owner)]
    return readers or [owner or "<root>"]


# ------------------------------------------------------------------------------------------------ public


def assert_rewrite_equivalent(
    model: nn.Module,
    rewrite: Rewrite,
    example_inputs,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    grads: bool = True,
    dtype: torch.dtype = torch.float64,
    compile_backend: str | Callable | None = None,
    graph: bool | None = None,
    locate: bool = True,
) -> nn.Module:
    """Check that ``rewrite`` keeps ``model``'s function; raise ``RewriteMismatch`` (an AssertionError) if not.

    The model is deep-copied and cast to ``dtype`` (float64 by default, so genuine bugs are not lost in rounding),
    the copy is rewritten, and both are run on ``example_inputs`` (a tensor, a tuple of positional inputs or a
    dict of keyword inputs; float inputs are cast to ``dtype``). Compared: outputs, and with ``grads`` the
    gradients of a fixed random projection of the outputs w.r.t. float inputs and w.r.t. every parameter present
    under the same FQN and shape in both models (all aliases of a tied parameter are checked, so an untied copy
    shows up). With ``compile_backend`` the rewritten model is also run through ``torch.compile``.

    ``rewrite`` maps a module to a module — or edits it in place and returns anything else. ``graph=True``: it is
    a ``GraphModule -> GraphModule`` pass and gets ``fx.symbolic_trace`` of the copy; ``graph=False``: it gets
    the ``nn.Module``; ``graph=None``: decided by the annotation of its first parameter (``fx.GraphModule``),
    failing that by trying the module first and its trace second.

    Tolerances default to ``default_tolerances(dtype)``. Returns the rewritten module. The report names the
    first diverging node of the original graph (or module, for module-level rewrites) with its shapes and max
    abs error; ``locate=False`` skips that search (a re-run of both models), as ``check_pass`` does while
    Hypothesis shrinks. Models with dropout or other randomness must be in ``eval()`` mode.
    """
    default_rtol, default_atol = default_tolerances(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    args, kwargs = _cast_inputs(*split_example_inputs(example_inputs), dtype)
    reference = copy.deepcopy(model).to(dtype)
    rewritten, as_graph = apply_rewrite(reference, rewrite, graph)

    expected = _run(reference, args, kwargs, grads)
    try:
        actual = _run(rewritten, args, kwargs, grads)
    except Exception as exc:
        _fail(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate,
              f"The rewritten model raised {type(exc).__name__}: {exc}", "error", cause=exc)

    difference = _compare(expected.outputs, actual.outputs, rtol, atol)
    if difference is not None:
        _fail(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate,
              f"The rewrite changed the model's output: {_summary(difference)}.", "forward")
    if grads:
        _check_gradients(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate, expected, actual)
    if compile_backend is not None:
        _check_compiled(reference, rewritten, args, kwargs, rtol, atol, grads, expected, compile_backend)
    return rewritten


def _summary(difference: _Difference) -> str:
    if difference.max_abs_error is not None:
        return (f"max abs error {difference.max_abs_error:.3g} (shape {difference.original_shape})")
    return f"{difference.reason} (original {difference.original_shape}, rewritten {difference.rewritten_shape})"


def _check_gradients(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate, expected: _Run, actual: _Run):
    for name, grad in expected.input_grads.items():
        difference = _compare(grad, actual.input_grads.get(name), rtol, atol)
        if difference is not None:
            _fail(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate,
                  f"The gradient w.r.t. {name} differs: {_summary(difference)}.", "input gradient",
                  input_name=name, difference=difference)
    shared = [n for n, g in expected.param_grads.items()
              if n in actual.param_grads and actual.param_grads[n].shape == g.shape]
    for name in shared:
        difference = _compare(expected.param_grads[name], actual.param_grads[name], rtol, atol)
        if difference is not None:
            others = [n for n in shared if n != name and
                      _compare(expected.param_grads[n], actual.param_grads[n], rtol, atol) is not None]
            also = f" (also: {', '.join(others[:6])})" if others else ""
            _fail(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate,
                  f"The gradient w.r.t. parameter {name} differs: {_summary(difference)}{also}.",
                  "parameter gradient", parameter=name, difference=difference)


def _check_compiled(reference, rewritten, args, kwargs, rtol, atol, grads, expected: _Run, backend):
    # A fresh Dynamo cache: many small models share one forward's code object, and after Dynamo's recompile
    # limit it would silently run them eagerly instead of compiling.
    torch._dynamo.reset()
    compiled = torch.compile(rewritten, backend=backend)
    actual = _run(compiled, args, kwargs, grads)
    for label, want, got in [("output", expected.outputs, actual.outputs)] + [
        (f"gradient w.r.t. {n}", g, actual.input_grads.get(n)) for n, g in expected.input_grads.items()
    ] + [(f"gradient w.r.t. parameter {n}", g, actual.param_grads[n]) for n, g in expected.param_grads.items()
         if n in actual.param_grads and actual.param_grads[n].shape == g.shape]:
        difference = _compare(want, got, rtol, atol)
        if difference is not None:
            report = (f"The rewritten model compiled with torch.compile(backend={backend!r}) differs from the "
                      f"original: {label}: {_summary(difference)}. The eager rewritten model agrees, so the "
                      f"difference comes from compiling it.")
            raise RewriteMismatch(report, Divergence("compiled", None, None, None, difference.max_abs_error,
                                                     difference.original_shape, difference.rewritten_shape))


def _fail(reference, rewritten, as_graph, args, kwargs, rtol, atol, locate, headline: str, what: str, *,
          parameter: str | None = None, input_name: str | None = None, difference: _Difference | None = None,
          cause: BaseException | None = None):
    """Locate the first divergence and raise the report."""
    lines = [headline]
    if not locate:
        raise RewriteMismatch(headline + "\n(divergence not located: locate=False)", Divergence(what)) from cause
    divergence = None
    try:
        if as_graph and isinstance(rewritten, fx.GraphModule):
            divergence = _first_divergence_in_graphs(reference, rewritten, args, kwargs, rtol, atol, lines)
        else:
            divergence = _first_divergence_in_modules(reference, rewritten, args, kwargs, rtol, atol, lines)
    except Exception as exc:  # locating is a diagnosis: it must never hide the mismatch itself
        lines.append(f"(could not locate the divergence: {type(exc).__name__}: {exc})")
    if divergence is None and what in ("forward", "error"):
        lines.append("No matched intermediate value differs; the difference arises in nodes the rewrite replaced "
                     "or added.")
        divergence = Divergence(what)
    elif divergence is None and what == "parameter gradient":
        readers = _readers_of(reference, parameter)
        lines.append(f"Every matched forward value agrees; the parameter is read by "
                     f"{', '.join('%' + r for r in readers)}. A broken tie, a frozen weight or a detached use "
                     f"changes gradients but not outputs.")
        was = dict(reference.named_parameters(remove_duplicate=False))[parameter].requires_grad
        now = dict(rewritten.named_parameters(remove_duplicate=False))[parameter].requires_grad
        if was != now:
            lines.append(f"{parameter}.requires_grad is {was} in the original and {now} in the rewrite.")
        divergence = Divergence(what, readers[0], None, parameter, difference.max_abs_error,
                                difference.original_shape, difference.rewritten_shape)
    elif divergence is None:
        node = _placeholder_for(reference, input_name)
        lines.append("Every matched forward value agrees; the rewrite changes how gradients flow (e.g. a detach) "
                     "rather than the values.")
        divergence = Divergence(what, node, "placeholder" if node else None, input_name, difference.max_abs_error,
                                difference.original_shape, difference.rewritten_shape)
    for group in _broken_ties(reference, rewritten):
        lines.append(f"Note: the original holds one parameter as {', '.join(group)}; the rewrite holds separate "
                     f"ones (the tie is broken).")
    raise RewriteMismatch("\n".join(lines), divergence) from cause


def _placeholder_for(reference: nn.Module, input_name: str | None) -> str | None:
    """The original graph's placeholder receiving input 'args[i]' / "kwargs['k']" (None if not traceable)."""
    try:
        placeholders = [n.name for n in _trace(reference).graph.nodes if n.op == "placeholder"]
    except Exception:
        return None
    if input_name and input_name.startswith("args["):
        index = int(input_name[5:].split("]")[0])
        return placeholders[index] if index < len(placeholders) else None
    if input_name and input_name.startswith("kwargs['"):
        key = input_name[8:].split("'")[0]
        return key if key in placeholders else None
    return None
