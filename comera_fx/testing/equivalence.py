"""``assert_rewrite_equivalent``: does a rewrite (a graph pass or a model-level rewrite) keep a model's function?

It compares outputs and gradients of the original and the rewritten model on one or more example inputs, and when
they differ it finds *where* (``locate.py``): the first node of the original, in topological order, whose
rewritten counterpart differs is named in the ``AssertionError``. Needs no Hypothesis.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..passes.find import split_example_inputs
from .compare import Tolerance, compare, default_tolerances, detach, open_dataclasses, summary
from .locate import Divergence, RewriteMismatch, fail, trace

__all__ = ["Divergence", "RewriteMismatch", "assert_rewrite_equivalent", "default_tolerances", "takes_graph_module"]

Rewrite = Callable[[nn.Module], Any]

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
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
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


def apply_rewrite(reference: nn.Module, rewrite: Rewrite, graph: bool | None) -> tuple[nn.Module, bool]:
    """Rewrite a copy of ``reference``; returns (rewritten module, whether it was rewritten as a GraphModule).

    ``graph=None`` asks ``takes_graph_module``; still undecided, the rewrite is tried on the module and, if that
    raises, on its ``symbolic_trace``.
    """
    if graph is None:
        graph = takes_graph_module(rewrite)
    if graph:
        return _run_rewrite(rewrite, trace(copy.deepcopy(reference))), True
    if graph is False or isinstance(reference, fx.GraphModule):
        return _run_rewrite(rewrite, copy.deepcopy(reference)), isinstance(reference, fx.GraphModule)
    try:
        return _run_rewrite(rewrite, copy.deepcopy(reference)), False
    except Exception as module_error:
        try:
            return _run_rewrite(rewrite, trace(copy.deepcopy(reference))), True
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
    return [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.dtype).to(o.device) for o in outputs]


def _run(model: nn.Module, args: tuple, kwargs: dict, grads: bool, call: Callable | None = None) -> _Run:
    """Run ``call`` (default: ``model``) once; with ``grads``, backpropagate a fixed random cotangent to the float
    inputs and to ``model``'s parameters (by ``model``'s names, whatever wrapper ``call`` is)."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    fresh, grad_inputs = [], {}
    for path, leaf in leaves:
        if grads and isinstance(leaf, Tensor) and leaf.is_floating_point():
            leaf = leaf.detach().requires_grad_(True)  # a new leaf, same storage and strides
            grad_inputs[_input_name(path)] = leaf
        fresh.append(leaf)
    call_args, call_kwargs = pytree.tree_unflatten(fresh, spec)
    with torch.set_grad_enabled(grads):
        out = (model if call is None else call)(*call_args, **call_kwargs)
    outputs, output_spec = pytree.tree_flatten(open_dataclasses(out))
    run = _Run([detach(o) for o in outputs], output_spec, {}, {})
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
    by_id = {id(p): g for p, g in zip(unique, got[len(grad_inputs) :])}
    run.param_grads = {n: by_id.get(id(p), torch.zeros_like(p)) for n, p in named}
    return run


# ------------------------------------------------------------------------------------------------ public


def assert_rewrite_equivalent(
    model: nn.Module,
    rewrite: Rewrite,
    example_inputs,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    norm_rtol: float | None = None,
    grads: bool = True,
    dtype: torch.dtype = torch.float64,
    compile_backend: str | Callable | None = None,
    graph: bool | None = None,
    locate: bool = True,
    extra_inputs: Sequence = (),
) -> nn.Module:
    """Check that ``rewrite`` keeps ``model``'s function; raise ``RewriteMismatch`` (an AssertionError) if not.

    The model is deep-copied and cast to ``dtype`` (float64 by default, so genuine bugs are not lost in rounding),
    the copy is rewritten once, and both are run on ``example_inputs`` (a tensor, a tuple of positional inputs or
    a dict of keyword inputs; float inputs are cast to ``dtype``) and then on each of ``extra_inputs`` (same
    forms: other batch sizes, other layouts). Compared: outputs (tensors, and Python values inside tuples, dicts,
    registered pytree types or dataclasses), and with ``grads`` the gradients of a fixed random projection of the
    outputs w.r.t. float inputs and w.r.t. every parameter present under the same FQN and shape in both models
    (all aliases of a tied parameter are checked, so an untied copy shows up). With ``compile_backend`` the
    rewritten model is also run through ``torch.compile``, outputs and gradients compared again.

    ``rewrite`` maps a module to a module — or edits it in place and returns anything else. ``graph=True``: it is
    a ``GraphModule -> GraphModule`` pass and gets ``fx.symbolic_trace`` of the copy; ``graph=False``: it gets
    the ``nn.Module``; ``graph=None``: decided by the annotation of its first parameter (``fx.GraphModule``),
    failing that by trying the module first and its trace second.

    Tolerances: ``rtol``/``atol`` element-wise, defaulting to ``default_tolerances(dtype)``; or ``norm_rtol``,
    which compares each tensor norm-wise (``||rewritten - original|| <= norm_rtol·||original|| + atol``) — the
    right bound for a rewrite that reorders or truncates a contraction. Returns the rewritten module. The report
    names the first diverging node of the original graph (or module, for module-level rewrites) with its shapes
    and max abs error; ``locate=False`` skips that search (a re-run of both models), as ``check_pass`` does while
    Hypothesis shrinks. Models with dropout or other randomness must be in ``eval()`` mode.

    The compiled check leaves the caller's compiled code alone: it compiles a call through a code object made
    for this check only, so Dynamo's caches (and recompile limits) of the user's functions are untouched and no
    ``torch._dynamo.reset()`` is done; it raises if Dynamo compiled no graph (it ran the model eagerly).
    """
    default_rtol, default_atol = default_tolerances(dtype)
    tol = Tolerance(default_rtol if rtol is None else rtol, default_atol if atol is None else atol, norm_rtol)
    inputs = [_cast_inputs(*split_example_inputs(x), dtype) for x in [example_inputs, *extra_inputs]]
    reference = copy.deepcopy(model).to(dtype)
    rewritten, as_graph = apply_rewrite(reference, rewrite, graph)

    for number, (args, kwargs) in enumerate(inputs):
        where = f" on extra input {number}" if number else ""
        expected = _run(reference, args, kwargs, grads)
        try:
            actual = _run(rewritten, args, kwargs, grads)
        except Exception as exc:
            fail(
                reference,
                rewritten,
                as_graph,
                args,
                kwargs,
                tol,
                locate,
                f"The rewritten model raised{where} {type(exc).__name__}: {exc}",
                "error",
                cause=exc,
            )
        difference = compare(expected.outputs, actual.outputs, tol)
        if difference is not None:
            fail(
                reference,
                rewritten,
                as_graph,
                args,
                kwargs,
                tol,
                locate,
                f"The rewrite changed the model's output{where}: {summary(difference)}.",
                "forward",
            )
        if grads:
            _check_gradients(reference, rewritten, as_graph, args, kwargs, tol, locate, expected, actual, where)
    if compile_backend is not None:
        _check_compiled(reference, rewritten, inputs, tol, grads, compile_backend)
    return rewritten


def _check_gradients(
    reference, rewritten, as_graph, args, kwargs, tol: Tolerance, locate, expected: _Run, actual: _Run, where: str = ""
):
    for name, grad in expected.input_grads.items():
        difference = compare(grad, actual.input_grads.get(name), tol)
        if difference is not None:
            fail(
                reference,
                rewritten,
                as_graph,
                args,
                kwargs,
                tol,
                locate,
                f"The gradient w.r.t. {name} differs{where}: {summary(difference)}.",
                "input gradient",
                input_name=name,
                difference=difference,
            )
    shared = [
        n for n, g in expected.param_grads.items() if n in actual.param_grads and actual.param_grads[n].shape == g.shape
    ]
    for name in shared:
        difference = compare(expected.param_grads[name], actual.param_grads[name], tol)
        if difference is not None:
            others = [
                n
                for n in shared
                if n != name and compare(expected.param_grads[n], actual.param_grads[n], tol) is not None
            ]
            also = f" (also: {', '.join(others[:6])})" if others else ""
            fail(
                reference,
                rewritten,
                as_graph,
                args,
                kwargs,
                tol,
                locate,
                f"The gradient w.r.t. parameter {name} differs{where}: {summary(difference)}{also}.",
                "parameter gradient",
                parameter=name,
                difference=difference,
            )


def _compiled_call(module: nn.Module, backend) -> tuple[Callable, list[int]]:
    """``torch.compile`` of a call into ``module`` through a code object of its own, and a list that counts the
    graphs the backend compiled.

    Dynamo keeps its compiled code per code object. Many models share one ``forward`` (every ``RandomModel``), so
    compiling them directly would pile entries onto that code object until Dynamo's recompile limit silently runs
    them eagerly — and the usual cure, ``torch._dynamo.reset()``, wipes the user's compiled code too. A fresh
    code object starts with an empty cache and takes its entries with it when the check is done.
    """
    compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    graphs: list[int] = []

    def counting_backend(gm, example_inputs, **kwargs):
        graphs.append(1)
        return compiler(gm, example_inputs, **kwargs)

    def call(*args, **kwargs):
        return module(*args, **kwargs)

    code = call.__code__.replace()  # a new code object (same bytecode): its own, empty Dynamo cache
    fresh = types.FunctionType(code, call.__globals__, call.__name__, call.__defaults__, call.__closure__)
    return torch.compile(fresh, backend=counting_backend), graphs


def _check_compiled(reference, rewritten, inputs, tol: Tolerance, grads, backend):
    compiled, graphs = _compiled_call(rewritten, backend)
    for number, (args, kwargs) in enumerate(inputs):
        expected = _run(reference, args, kwargs, grads)
        actual = _run(rewritten, args, kwargs, grads, call=compiled)
        if not graphs:
            raise RewriteMismatch(
                f"torch.compile(backend={backend!r}) compiled no graph of the rewritten model "
                f"(Dynamo ran it eagerly), so the compiled check checked nothing",
                Divergence("compiled"),
            )
        where = f" on extra input {number}" if number else ""
        for label, want, got in (
            [("output", expected.outputs, actual.outputs)]
            + [(f"gradient w.r.t. {n}", g, actual.input_grads.get(n)) for n, g in expected.input_grads.items()]
            + [
                (f"gradient w.r.t. parameter {n}", g, actual.param_grads[n])
                for n, g in expected.param_grads.items()
                if n in actual.param_grads and actual.param_grads[n].shape == g.shape
            ]
        ):
            difference = compare(want, got, tol)
            if difference is not None:
                report = (
                    f"The rewritten model compiled with torch.compile(backend={backend!r}) differs from the "
                    f"original{where}: {label}: {summary(difference)}. The eager rewritten model agrees, "
                    f"so the difference comes from compiling it."
                )
                raise RewriteMismatch(
                    report,
                    Divergence(
                        "compiled",
                        None,
                        None,
                        None,
                        difference.max_abs_error,
                        difference.original_shape,
                        difference.rewritten_shape,
                    ),
                )
