"""Where a rewrite first departs from the original: the node (or module) named in ``RewriteMismatch``'s report.

Both models are re-run recording every intermediate value (an ``fx.Interpreter`` over the graph, or forward hooks
on every module) and the first node of the original, in topological order, whose rewritten counterpart differs is
described: its shapes, the error, the node that replaced it, the parameters the rewrite changed, broken ties.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from .compare import Difference, Tolerance, compare, detach

__all__ = ["Divergence", "RewriteMismatch", "fail", "trace"]


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


def trace(module: nn.Module) -> fx.GraphModule:
    """``fx.symbolic_trace`` of ``module`` (a copy of it when it already is a GraphModule)."""
    return copy.deepcopy(module) if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module)


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
        self.by_name[n.name] = detach(result)
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
            by_module[name].append(detach(output))

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


def _first_divergence_in_graphs(
    reference: nn.Module, rewritten: fx.GraphModule, args, kwargs, tol, lines: list[str]
) -> Divergence | None:
    """Walk the original's graph in topological order; compare each node with the rewritten node of the same name
    (or, for call_module, the same module FQN and call index). Returns the first that differs."""
    original_gm = trace(reference)
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
        return Divergence(
            "error",
            n.name if n is not None else None,
            n.op if n is not None else None,
            _target_str(n) if n is not None else None,
        )
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
        difference = compare(value, other, tol, strict=False)
        if difference is None:
            agreeing, last_agreeing = agreeing + 1, node
            continue
        divergence = Divergence(
            "forward",
            node.name,
            node.op,
            _target_str(node),
            difference.max_abs_error,
            difference.original_shape,
            difference.rewritten_shape,
        )
        lines.append(_describe_node_difference(node, twin, difference, tol, original_names, set(unmatched)))
        if node.op == "call_module" and twin is not None and twin.name == node.name:
            before_module, after_module = repr(original_gm.get_submodule(node.target)), _module_repr(rewritten, node)
            if after_module is not None and after_module != before_module:
                lines.append(f"  original module : {before_module}\n  rewritten module: {after_module}")
            changed = _changed_state(original_gm, rewritten, node.target)
            if changed:
                lines.append(f"  its parameters/buffers changed: {changed}")
        before = f" (last: %{last_agreeing.name})" if last_agreeing is not None else ""
        replaced = (
            f"; {len(unmatched)} original node(s) have no counterpart in the rewrite{_list(unmatched)}"
            if unmatched
            else ""
        )
        lines.append(f"  {agreeing} matched node(s) before it agree{before}{replaced}.")
        return divergence
    return None


def _replacements(
    original_gm: fx.GraphModule, rewritten_nodes: dict[str, fx.Node], original_names: set[str]
) -> dict[str, str]:
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


def _counterpart(
    node: fx.Node,
    value: Any,
    rewritten_nodes: dict[str, fx.Node],
    candidate: _RecordingInterpreter,
    module_calls: dict[str, int],
    replacements: dict[str, str],
) -> tuple[fx.Node | None, Any, bool]:
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
        (x.shape, x.dtype) == (y.shape, y.dtype)
        if isinstance(x, Tensor) and isinstance(y, Tensor)
        else type(x) is type(y)
        for x, y in zip(a_leaves, b_leaves)
    )


def _first_divergence_in_modules(
    reference: nn.Module, rewritten: nn.Module, args, kwargs, tol, lines: list[str]
) -> Divergence | None:
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
        difference = compare(original[name][index], candidate[name][index], tol, strict=False)
        if difference is None:
            agreeing, last_agreeing = agreeing + 1, name
            continue
        label = name or "<root>"
        call = f" (call {index + 1})" if len(original[name]) > 1 else ""
        kind = type(reference.get_submodule(name)).__name__
        new_kind = type(rewritten.get_submodule(name)).__name__ if name in dict(rewritten.named_modules()) else "?"
        lines.append(f"First diverging module: {label}{call} ({kind} -> {new_kind} in the rewrite)")
        lines.append(_shapes_line(difference, tol))
        before = f" (last: {last_agreeing or '<root>'})" if last_agreeing is not None else ""
        replaced = (
            f"; {len(unmatched)} original module call(s) have no counterpart{_list(unmatched)}" if unmatched else ""
        )
        lines.append(f"  {agreeing} module call(s) before it agree{before}{replaced}.")
        return Divergence(
            "forward",
            label,
            "call_module",
            kind,
            difference.max_abs_error,
            difference.original_shape,
            difference.rewritten_shape,
        )
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
    return [
        tuple(group)
        for group in names.values()
        if len(group) > 1 and all(n in after for n in group) and len({id(after[n]) for n in group}) > 1
    ]


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


def _shapes_line(difference: Difference, tol: Tolerance) -> str:
    error = (
        f"max abs error {difference.max_abs_error:.3g}" if difference.max_abs_error is not None else difference.reason
    )
    return (
        f"  original shape {difference.original_shape}, rewritten shape {difference.rewritten_shape}: {error} "
        f"(allowed: {tol.describe()})"
    )


def _node_kind(node: fx.Node) -> str:
    if node.op == "output":
        return "the graph's output"
    if node.op == "placeholder":
        return "an input"
    return f"{node.op} {_target_str(node)}"


def _describe_node_difference(
    node: fx.Node,
    twin: fx.Node | None,
    difference: Difference,
    tol: Tolerance,
    original_names: set[str],
    replaced: set[str],
) -> str:
    lines = [
        f"First diverging node: %{node.name} ({_node_kind(node)})",
        _shapes_line(difference, tol),
        f"  original : {node.format_node()}",
    ]
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
        lines.append(
            f"  its original input(s) {', '.join('%' + n for n in replaced_inputs)} have no counterpart in "
            f"the rewrite: the difference arises in what replaced them"
        )
    return "\n".join(lines)


def _readers_of(reference: nn.Module, fqn: str) -> list[str]:
    """Nodes of the original's graph (or module FQNs) that read parameter ``fqn``."""
    owner = fqn.rpartition(".")[0]
    try:
        gm = trace(reference)
    except Exception:
        return [owner or "<root>"]
    readers = [
        n.name
        for n in gm.graph.nodes
        if (n.op == "get_attr" and n.target == fqn) or (n.op == "call_module" and n.target == owner)
    ]
    return readers or [owner or "<root>"]


def fail(
    reference,
    rewritten,
    as_graph,
    args,
    kwargs,
    tol,
    locate,
    headline: str,
    what: str,
    *,
    parameter: str | None = None,
    input_name: str | None = None,
    difference: Difference | None = None,
    cause: BaseException | None = None,
):
    """Locate the first divergence and raise the report."""
    lines = [headline]
    if not locate:
        raise RewriteMismatch(headline + "\n(divergence not located: locate=False)", Divergence(what)) from cause
    divergence = None
    try:
        if as_graph and isinstance(rewritten, fx.GraphModule):
            divergence = _first_divergence_in_graphs(reference, rewritten, args, kwargs, tol, lines)
        else:
            divergence = _first_divergence_in_modules(reference, rewritten, args, kwargs, tol, lines)
    except Exception as exc:  # locating is a diagnosis: it must never hide the mismatch itself
        lines.append(f"(could not locate the divergence: {type(exc).__name__}: {exc})")
    if divergence is None and what in ("forward", "error"):
        lines.append(
            "No matched intermediate value differs; the difference arises in nodes the rewrite replaced or added."
        )
        divergence = Divergence(what)
    elif divergence is None and what == "parameter gradient":
        readers = _readers_of(reference, parameter)
        lines.append(
            f"Every matched forward value agrees; the parameter is read by "
            f"{', '.join('%' + r for r in readers)}. A broken tie, a frozen weight or a detached use "
            f"changes gradients but not outputs."
        )
        was = dict(reference.named_parameters(remove_duplicate=False))[parameter].requires_grad
        now = dict(rewritten.named_parameters(remove_duplicate=False))[parameter].requires_grad
        if was != now:
            lines.append(f"{parameter}.requires_grad is {was} in the original and {now} in the rewrite.")
        divergence = Divergence(
            what,
            readers[0],
            None,
            parameter,
            difference.max_abs_error,
            difference.original_shape,
            difference.rewritten_shape,
        )
    elif divergence is None:
        node = _placeholder_for(reference, input_name)
        lines.append(
            "Every matched forward value agrees; the rewrite changes how gradients flow (e.g. a detach) "
            "rather than the values."
        )
        divergence = Divergence(
            what,
            node,
            "placeholder" if node else None,
            input_name,
            difference.max_abs_error,
            difference.original_shape,
            difference.rewritten_shape,
        )
    for group in _broken_ties(reference, rewritten):
        lines.append(
            f"Note: the original holds one parameter as {', '.join(group)}; the rewrite holds separate "
            f"ones (the tie is broken)."
        )
    raise RewriteMismatch("\n".join(lines), divergence) from cause


def _placeholder_for(reference: nn.Module, input_name: str | None) -> str | None:
    """The original graph's placeholder receiving input 'args[i]' / "kwargs['k']" (None if not traceable)."""
    try:
        placeholders = [n.name for n in trace(reference).graph.nodes if n.op == "placeholder"]
    except Exception:
        return None
    if input_name and input_name.startswith("args["):
        index = int(input_name[5:].split("]")[0])
        return placeholders[index] if index < len(placeholders) else None
    if input_name and input_name.startswith("kwargs['"):
        key = input_name[8:].split("'")[0]
        return key if key in placeholders else None
    return None
