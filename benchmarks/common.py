"""What the benchmarks share, written once: this checkout on ``sys.path``, timing loops, system readings, the header
of a JSON record, loading an example script, and the RMM benchmarks' adapters (comera_fx's RMM calls, the public
fewbit code, the bytes a forward saves for backward).

Every benchmark imports its helpers from here and from no other benchmark, so a script can move or go without
breaking another. Importing this module changes nothing and loads no torch (several scripts set OpenMP's environment
before torch loads); ``use_this_checkout()`` is the one call that edits ``sys.path``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------- paths


#: examples/compress_pretrained.py's settings for the README's compression recipe (stdlib docstrings by length, cut to
#: 64 tokens, half the batches of consecutive docstrings joined into 600-character rows cut to 128 tokens, batches of
#: 32, word embedding frozen; 1000 held-out stdlib texts and 500 numpy + sympy docstrings as the other source): what
#: the issue-46 benches score ``compress_`` on (``argparse.Namespace(**COMPRESS_RECIPE)``).
COMPRESS_RECIPE = dict(
    tiny=False,
    quick=False,
    max_files=None,
    retrieval=500,
    eval_texts=1000,
    train_len=64,
    code_fraction=0.0,
    code_len=128,
    long_fraction=0.5,
    long_chars=600,
    long_len=128,
    reference_fraction=0.0,
    extra_packages=("torch",),
    other_texts=500,
    batch_size=32,
    by_length=True,
    seed=0,
    train_embedding=False,
)


def temporary_inductor_cache(prefix: str) -> str:
    """A fresh directory for ``TORCHINDUCTOR_CACHE_DIR`` (a cold compile), removed when the process exits: a
    benchmark run leaves no compiled kernels behind in the temporary folder."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def use_this_checkout() -> None:
    """Put this checkout's root and ``examples/`` first on ``sys.path``: a script's path starts at its own folder,
    and an editable install of another checkout would otherwise lend its ``comera_fx``; the demo's modules live in
    examples/."""
    for path in (str(REPO / "examples"), str(REPO)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)


def load_example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as a module (registered in ``sys.modules``), without making examples/ a package."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------- timing


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of one call of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def time_rotated(columns: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each column, columns interleaved within every round, the order rotated from
    round to round: a column timed right after dense pays for the memory dense just freed (on the benchmark VM,
    4096² runs 9–15 % slower in that seat), so no column may sit there every round."""
    samples: dict[str, list[float]] = {name: [] for name in columns}
    for fn in columns.values():  # warm-up: plans, allocator, first-touch pages
        fn()
        fn()
    names = list(columns)
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            fn = columns[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(v) for name, v in samples.items()}


def synced(fn: Callable[[], object], device) -> Callable[[], object]:
    """``fn`` followed by a wait for the device, so that a wall-clock timer sees a CUDA call's whole time (``fn``
    itself elsewhere). ``device``: a torch.device or its name."""
    import torch  # here, not at the top: importing this module loads no torch

    device = torch.device(device)
    if device.type != "cuda":
        return fn

    def call():
        fn()
        torch.cuda.synchronize(device)

    return call


# ------------------------------------------------------------------------------------------- system readings


def loadavg() -> str:
    """The 1/5/15-minute load averages, as /proc/loadavg writes them ("unknown" off Linux)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _busy_seconds() -> float:
    """CPU seconds all processes spent busy, from /proc/stat (user nice system irq softirq steal)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class OthersMeter:
    """Cores used by other processes between start() and stop() (this process's live children, such as Inductor's
    compile workers, count as others)."""

    def start(self):
        self.t, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self.t
        others = (_busy_seconds() - self.busy) - (_own_seconds() - self.own)
        return max(others, 0.0) / max(wall, 1e-9)


def minor_faults() -> int:
    """Minor page faults of this process so far: each first touch of memory the allocator got fresh from the kernel
    (glibc hands large freed blocks back and maps them again, ~0.75 µs a 4 KiB page here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def proc_status(key: str) -> int | None:
    """A /proc/self/status memory field in bytes (VmHWM, VmRSS), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def openmp_setting() -> str:
    """The OpenMP wait policy this process runs under, for a report's header (examples/openmp_policy.py, torch-free)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from openmp_policy import current_setting
    finally:
        sys.path.remove(str(REPO / "examples"))
    return current_setting()


def run_header() -> dict:
    """What every JSON record starts with: the command, when, and on what."""
    import torch

    return {
        "argv": sys.argv,
        "date": f"{datetime.now():%Y-%m-%d %H:%M:%S}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "openmp": openmp_setting(),
        "load": loadavg(),
    }


def write_record(path: str | Path, **fields) -> None:
    """A run's JSON record: ``run_header()`` then ``fields`` (a field of the same name replaces the header's)."""
    Path(path).write_text(json.dumps({**run_header(), **fields}, indent=1))


# ------------------------------------------------------------------------------ RMM: the comera_fx adapter
# Every call into comera_fx's RMM API goes through these three functions, so the RMM benchmarks keep working if
# its spelling changes. When the checkout has no RMM, ``rmm_missing()`` says so and the rows are reported skipped.


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
    """comera_fx's functional RMM linear, y = x Wᵀ + b (exact forward, sketched weight gradient)."""
    from comera_fx.rmm import rmm_linear

    return rmm_linear(x, weight, bias, rho=rho, sketch=sketch)


def comera_randomize_backward_(model, rho: float, sketch: str = "gaussian", example_inputs=None, **kwargs):
    """comera_fx.randomize_backward_ in place; returns its summary."""
    import comera_fx

    return comera_fx.randomize_backward_(model, rho=rho, sketch=sketch, example_inputs=example_inputs, **kwargs)


def exact_linear(x, weight, bias, rho=None):
    import torch.nn.functional as F

    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------------- RMM: the public code
# skolai/fewbit: only its pure-Python randomized linear is loaded, from a path given on the command line (``--fewbit
# PATH``, a plain copy of the repository outside this one). Its package ``__init__`` loads a compiled extension
# (``libfewbit.so``) and its activations need it; its linear does not, so the two modules it needs
# (``fewbit/fft.py``, ``fewbit/functional/linear.py``) are loaded under stub parent packages.


def load_fewbit(path: str | Path) -> Callable:
    """fewbit's ``linear_randomized(input, weight, bias, proj_dim_ratio, proj_dim, proj_dim_max, proj_dim_min,
    matmul, generator)`` from a copy of skolai/fewbit at ``path`` (the repository root), without its native
    extension. Raises ``RuntimeError`` naming what is missing."""
    root = Path(path) / "fewbit"
    needed = (root / "fft.py", root / "functional" / "linear.py")
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise RuntimeError(f"--fewbit {path}: not a copy of skolai/fewbit (missing {', '.join(missing)})")
    saved = {
        name: sys.modules.get(name)
        for name in ("fewbit", "fewbit.functional", "fewbit.fft", "fewbit.functional.linear")
    }
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


# ------------------------------------------------------------------------------- bytes saved for backward


def _outermost_call_mode():
    """A TorchFunctionMode naming the outermost torch-level call running now (e.g. ``linear``, ``layer_norm``,
    ``scaled_dot_product_attention``); calls inside it are not seen, as the mode is off while it runs."""
    import torch

    class Where(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.current = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            previous, self.current = self.current, getattr(func, "__name__", str(func))
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.current = previous

    return Where()


def saved_bytes_by_op(run_forward: Callable[[], object], params, attribute: bool = True) -> dict:
    """Run ``run_forward()`` (returning the loss) under ``saved_tensors_hooks`` and group what autograd saves.

    Unique storages (by data pointer, largest size seen), parameter storages counted apart. With ``attribute``
    each storage is labelled, when first saved, ``<innermost module class>:<outermost torch call>`` (a module stack
    from global forward hooks, the call from a ``TorchFunctionMode``; a custom ``autograd.Function`` shows as
    ``<module>:Function``); leave it off under ``torch.compile`` (the compiled graph saves all as one node).
    Nothing saved is unpacked, so checkpointed regions are not recomputed; inside them checkpoint's own hooks
    take over and what they hold (the regions' inputs) is not counted.
    Returns ``{"total": bytes, "params": bytes, "by_op": {label: bytes}, "count": n}``."""
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    sizes: dict[int, int] = {}
    labels: dict[int, str] = {}
    modules: list[str] = []
    where = _outermost_call_mode() if attribute else None

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
    return {
        "total": sum(n for p, n in sizes.items() if p not in param_ptrs),
        "params": sum(n for p, n in sizes.items() if p in param_ptrs),
        "by_op": dict(by_op),
        "count": len(sizes),
    }
