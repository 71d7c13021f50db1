"""Run a capture without leaving a trace: the model's buffers, the global RNGs and Dynamo's caches.

Capture runs the model's real forward once under Dynamo. Left alone, that forward updates BatchNorm's running
statistics (and ``num_batches_tracked``), consumes the global RNG (dropout), and leaves Dynamo state behind that
changes the user's own ``torch.compile`` later: cache entries on the model's code objects (each one counts
against Dynamo's recompile limit and is checked on every call), the recording backend (which holds the captured
graphs) and the automatic-dynamic profile (a later compile at another batch size would start with dynamic shapes).
``untraced(model)`` restores all of these on exit, whatever happened inside.

The Dynamo part uses private APIs (``torch._dynamo.eval_frame``, ``pgo``): ``torch._dynamo.reset()`` would wipe
the user's compiled code too. Each step is best effort; tests/test_silent_failures.py checks the result.
"""

from __future__ import annotations

import contextlib
import copy
import random
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def untraced(model: nn.Module) -> Iterator[Callable[..., Callable]]:
    """Yield ``compile_model(backend, **options)``, a ``torch.compile`` of a call to ``model``; on exit, restore
    ``model``'s buffers, the torch (CPU and initialised CUDA) and Python RNG states, and drop the Dynamo state
    those compiles added.

    Each compile traces a throwaway function (its own code object) in its own ``isolate_recompiles`` region, so
    its cache entries neither sit on the user's code when the model has no graph break nor count against the
    recompile limit of the user's own compiles of it; the entries Dynamo still puts on the model's code (frames
    after a graph break) are removed on exit.
    """
    buffers = _snapshot_buffers(model)
    python_rng = random.getstate()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    dynamo = _DynamoState()

    def compile_model(backend, **options) -> Callable:
        compiled = torch.compile(_fresh_call(model), backend=backend, isolate_recompiles=True, **options)
        dynamo.regions.add(compiled._isolate_recompiles_id)
        return compiled

    try:
        with torch.random.fork_rng(devices=devices):
            yield compile_model
    finally:
        random.setstate(python_rng)
        _restore_buffers(buffers)
        dynamo.restore()


def _fresh_call(model: nn.Module) -> Callable:
    """``lambda *a, **k: model(*a, **k)`` with a code object of its own (Dynamo keys its caches on code)."""

    def call(*args, **kwargs):
        return model(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__)


def _snapshot_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    return [
        (module, name, buf, buf.detach().clone())
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    ]


def _restore_buffers(saved) -> None:
    with torch.no_grad():
        for module, name, original, value in saved:
            module._buffers[name] = original  # a forward may rebind a buffer instead of updating it
            original.copy_(value)


class _DynamoState:
    """What Dynamo holds between compiles, read before a capture so that ``restore`` can drop what it added."""

    def __init__(self) -> None:
        from torch._dynamo import eval_frame, pgo, utils

        self.regions: set[int] = set()
        self.backend_ids = set(eval_frame.cached_backends)
        self.code_state = copy.deepcopy(dict(pgo.get_code_state()))
        self.counters = copy.deepcopy(utils.counters)

    def restore(self) -> None:
        from torch._dynamo import eval_frame, pgo, utils

        for key in set(eval_frame.cached_backends) - self.backend_ids:
            eval_frame.cached_backends.pop(key, None)  # the recording backend holds the captured graphs
        if self.regions:
            _drop_cache_entries(self.regions)
        state = pgo.get_code_state()  # automatic-dynamic sizes seen per frame
        state.clear()
        state.update(self.code_state)
        utils.counters.clear()
        utils.counters.update(self.counters)


def _drop_cache_entries(regions: set[int]) -> None:
    """Remove the cache entries of the ``isolate_recompiles`` regions ``regions`` from every code object Dynamo
    has seen. A code holding nothing else is reset; on a code that also holds other entries, ours are
    invalidated (Dynamo keeps them as always-failing entries at the end of the list, in our region)."""
    from torch._dynamo import convert_frame, eval_frame
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    for weak_code in list(convert_frame.input_codes.seen):
        code = weak_code()
        if code is None:
            continue
        entries = eval_frame._debug_get_cache_entry_list(code)
        ours = [e for e in entries if e.isolate_recompiles_id in regions]
        if not ours:
            continue
        removable = [
            e
            for e in entries
            if e.isolate_recompiles_id in regions or isinstance(e.guard_manager, DeletedGuardManagerWrapper)
        ]
        if len(removable) == len(entries):
            torch._C._dynamo.eval_frame.reset_code(code)
            continue
        for entry in ours:
            extra_state = getattr(entry.guard_manager, "extra_state", None)
            if extra_state is not None:
                extra_state.invalidate(entry, DeletedGuardManagerWrapper("comera_fx: capture entry removed"))
