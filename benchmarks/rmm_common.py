"""Shared pieces of the RMM benchmarks (``bench_rmm_layer.py``, ``bench_rmm_memory.py``, ``bench_rmm_accuracy.py``).

* The **adapter** to comera_fx's RMM API (``comera_fx.rmm.rmm_linear``, ``comera_fx.randomize_backward_``): the one
  place that names those calls, so the harnesses keep working if their spelling changes. When the checkout has no
  RMM yet, ``rmm_missing()`` says so and the harnesses report those rows as skipped instead of failing.
* The **public code** (skolai/fewbit): only its pure-Python randomized linear is loaded, from a path given on the
  command line (``--fewbit PATH``, a plain copy of the repository outside this one). Its package ``__init__`` loads a
  compiled extension (``libfewbit.so``) and its activations need it; its linear does not, so the two modules it needs
  (``fewbit/fft.py``, ``fewbit/functional/linear.py``) are loaded under stub parent packages.
* ``saved_bytes_by_op``: the bytes a forward saves for backward, unique storages, grouped by the module and the
  torch call that saved them.
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


class _Where(torch.overrides.TorchFunctionMode):
    """Names the outermost torch-level call running now (e.g. ``linear``, ``layer_norm``,
    ``scaled_dot_product_attention``); calls inside it are not seen, as the mode is off while it runs."""

    def __init__(self):
        super().__init__()
        self.current = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        previous, self.current = self.current, getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = previous


def saved_bytes_by_op(run_forward: Callable[[], torch.Tensor], params, attribute: bool = True) -> dict:
    """Run ``run_forward()`` (returning the loss) under ``saved_tensors_hooks`` and group what autograd saves.

    Unique storages (by data pointer, largest size seen), parameter storages counted apart. With ``attribute``
    each storage is labelled, when first saved, ``<innermost module class>:<outermost torch call>`` (a module stack
    from global forward hooks, the call from a ``TorchFunctionMode``; a custom ``autograd.Function`` shows as
    ``<module>:Function``); leave it off under ``torch.compile`` (the compiled graph saves all as one node).
    Nothing saved is unpacked, so checkpointed regions are not recomputed; inside them checkpoint's own hooks
    take over and what they hold (the regions' inputs) is not counted.
    Returns ``{"total": bytes, "params": bytes, "by_op": {label: bytes}, "count": n}``."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    sizes: dict[int, int] = {}
    labels: dict[int, str] = {}
    modules: list[str] = []
    where = _Where() if attribute else None

    def pack(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            try:
                st = t.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
                return t
            sizes[ptr] = max(sizes.get(ptr, 0), st.nbytes())
            if ptr not in labels:
                labels[ptr] = f"{modules[-1] if modules else '-'}:{(where and where.current) or 'Function'}"
        return t

    handles = []
    if attribute:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module, args):
            modules.append(type(module).__name__)

        def leave(module, args, output):  # returns None: a forward hook's return value would replace the output
            if modules:
                modules.pop()

        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if where is not None:
                with where:
                    loss = run_forward()
            else:
                loss = run_forward()
    finally:
        for h in handles:
            h.remove()
    del loss
    by_op: dict[str, int] = defaultdict(int)
    for ptr, nbytes in sizes.items():
        if ptr not in param_ptrs:
            by_op[labels.get(ptr, "-")] += nbytes
    return {"total": sum(n for p, n in sizes.items() if p not in param_ptrs),
            "params": sum(n for p, n in sizes.items() if p in param_ptrs), "by_op": dict(by_op),
            "count": len(sizes)}
