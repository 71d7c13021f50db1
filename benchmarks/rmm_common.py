"""Shared pieces of the RMM benchmarks (``bench_rmm_layer.py``, ``bench_rmm_memory.py``, ``bench_rmm_accuracy.py``).

* The **adapter** to comera_fx's RMM API (``comera_fx.rmm.rmm_linear``, ``comera_fx.randomize_backward_``): the one
  place that names those calls, so the harnesses keep working if their spelling changes. When the checkout has no
  RMM yet, ``rmm_missing()`` says so and the harnesses report those rows as skipped instead of failing.
* The **public code** (skolai/fewbit): only its pure-Python randomized linear is loaded, from a path given on the
  command line (``--fewbit PATH``, a plain copy of the repository outside this one). Its package ``__init__`` loads a
  compiled extension (``libfewbit.so``) and its activations need it; its linear does not, so the two modules it needs
  (``fewbit/fft.py``, ``fewbit/functional/linear.py``) are loaded under stub parent packages.
* ``saved_bytes_by_op``: the bytes a forward saves for backward, unique storages, grouped by the autograd node that
  saved them.
* System readings (VmRSS / VmHWM / load average), reused from ``bench_equal_time.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------ comera_fx adapter
# ADAPTER: every call into comera_fx's RMM API goes through these three functions.


def rmm_missing() -> str | None:
    """None when this checkout's comera_fx has the RMM API, else why not (for a 'skipped' row)."""
    try:
        import comera_fx
        from comera_fx import rmm
    except ImportError as exc:
        return f"comera_fx.rmm not importable ({exc}); merge main for the RMM op"
    if not Path(rmm.__file__).resolve().is_relative_to(Path(comera_fx.__file__).resolve().parent):
        # an editable install can lend a submodule from another checkout: never time that by mistake
        return f"comera_fx.rmm comes from {rmm.__file__}, not this checkout; merge main"
    if not hasattr(comera_fx, "randomize_backward_"):
        return "comera_fx.randomize_backward_ missing in this checkout; merge main"
    return None


def comera_rmm_linear(x, weight, bias, rho: float, sketch: str):
    """ADAPTER: comera_fx's functional RMM linear, y = x Wᵀ + b (exact forward, sketched weight gradient)."""
    from comera_fx.rmm import rmm_linear

    return rmm_linear(x, weight, bias, rho=rho, sketch=sketch)


def comera_randomize_backward_(model, rho: float, sketch: str = "gaussian", example_inputs=None, **kwargs):
    """ADAPTER: comera_fx.randomize_backward_ in place; returns its summary."""
    import comera_fx

    return comera_fx.randomize_backward_(model, rho=rho, sketch=sketch, example_inputs=example_inputs, **kwargs)


# --------------------------------------------------------------------------------------- the public RMM code


def load_fewbit(path: str | Path) -> Callable:
    """fewbit's ``linear_randomized(input, weight, bias, proj_dim_ratio, proj_dim, proj_dim_max, proj_dim_min,
    matmul, generator)`` from a copy of skolai/fewbit at ``path`` (the repository root), without its native
    extension. Raises ``RuntimeError`` naming what is missing."""
    root = Path(path) / "fewbit"
    needed = (root / "fft.py", root / "functional" / "linear.py")
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise RuntimeError(f"--fewbit {path}: not a copy of skolai/fewbit (missing {', '.join(missing)})")
    saved = {name: sys.modules.get(name) for name in ("fewbit", "fewbit.functional", "fewbit.fft",
                                                       "fewbit.functional.linear")}
    try:
        for name, folder in (("fewbit", root), ("fewbit.functional", root / "functional")):
            stub = types.ModuleType(name)
            stub.__path__ = [str(folder)]
            sys.modules[name] = stub
        modules = {}
        for name, file in (("fewbit.fft", needed[0]), ("fewbit.functional.linear", needed[1])):
            spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules[name] = module
        return modules["fewbit.functional.linear"].linear_randomized
    finally:  # leave no stub packages behind for anyone importing a real fewbit later
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def fewbit_linear(fn: Callable, matmul: str) -> Callable:
    """``f(x, w, b, rho)`` calling fewbit's randomized linear with its global-generator default."""

    def call(x, weight, bias, rho):
        return fn(x, weight, bias, rho, None, None, None, matmul, None)

    return call


def exact_linear(x, weight, bias, rho=None):
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------ bytes saved for backward


def _is_linear_node(name: str) -> bool:
    return any(k in name for k in ("Addmm", "Mm", "Linear", "Rmm", "RMM", "Sketch"))


def saved_bytes_by_op(run_forward: Callable[[], torch.Tensor], params) -> dict:
    """Run ``run_forward()`` (returning the loss) under ``saved_tensors_hooks`` and group what it saves.

    Totals come from the pack hook (every tensor autograd saves, unique storages by data pointer; parameter
    storages counted apart). The grouping walks the autograd graph from the loss: each node's ``_saved_*``
    attributes (built-in nodes) or ``saved_tensors`` / tensor attributes (custom Functions) name the storages
    it holds; a storage held by several nodes is reported under all their names joined by '+'. Returns
    ``{"total": bytes, "params": bytes, "by_op": {name: bytes}, "unattributed": bytes, "count": n}``."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    packed: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            try:
                st = t.untyped_storage()
                packed[st.data_ptr()] = max(packed.get(st.data_ptr(), 0), st.nbytes())
            except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
                pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run_forward()

    holders: dict[int, set[str]] = defaultdict(set)

    def note(value, name):
        if isinstance(value, torch.Tensor):
            try:
                holders[value.untyped_storage().data_ptr()].add(name)
            except (RuntimeError, NotImplementedError):
                pass
        elif isinstance(value, (list, tuple)):
            for v in value:
                note(v, name)

    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    note(getattr(node, attr), name)
                except RuntimeError:  # already freed / not accessible
                    pass
        if hasattr(node, "saved_tensors"):  # custom autograd.Function (its ctx is the node)
            try:
                note(node.saved_tensors, name)
            except RuntimeError:
                pass
            for value in getattr(node, "__dict__", {}).values():
                note(value, name)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)

    by_op: dict[str, int] = defaultdict(int)
    unattributed = 0
    for ptr, nbytes in packed.items():
        if ptr in param_ptrs:
            continue
        names = holders.get(ptr)
        if names:
            by_op["+".join(sorted(names))] += nbytes
        else:
            unattributed += nbytes
    activations = sum(n for p, n in packed.items() if p not in param_ptrs)
    params_saved = sum(n for p, n in packed.items() if p in param_ptrs)
    del loss
    return {"total": activations, "params": params_saved, "by_op": dict(by_op), "unattributed": unattributed,
            "count": len(packed)}


def group_by_kind(by_op: dict[str, int]) -> dict[str, int]:
    """Coarser groups of ``saved_bytes_by_op``'s names: a storage any linear-like node holds is 'linear inputs'."""
    out: dict[str, int] = defaultdict(int)
    for name, nbytes in by_op.items():
        parts = name.split("+")
        if any(_is_linear_node(p) for p in parts):
            key = "linear-like (" + "+".join(sorted({p for p in parts if _is_linear_node(p)})) + ")"
        else:
            key = name
        out[key] += nbytes
    return dict(out)
