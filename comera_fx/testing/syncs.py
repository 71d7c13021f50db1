"""Count the places a piece of code reads tensor values back to the host (``host_reads``).

On a GPU each such read waits for the device (a synchronisation), and inside a CUDA graph
(``torch.compile(mode="reduce-overhead")``) it is not allowed at all. They are counted on the CPU as well, where
they cost nothing, so a test can assert their absence without a GPU:

* ops that hand a value to Python: ``aten._local_scalar_dense`` (``.item()``, ``float()``, ``int()``, ``bool()``
  of a tensor), ``aten.is_nonzero``, ``aten.equal``;
* the reads that dispatch no op on a CPU tensor: ``Tensor.tolist`` and ``Tensor.numpy``, caught by wrapping those
  methods while active.

A copy to the CPU (``.cpu()``, ``.to("cpu")``) is not counted by itself: on a CPU it cannot be told from a copy
within the device, and its values reach Python only through one of the above.

Each read is recorded with the innermost frame under ``comera_fx`` that made it, so a failure names the line.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The ops through which a tensor's value reaches Python.
SYNC_OPS = ("_local_scalar_dense", "item", "is_nonzero", "equal")

_PACKAGE = str(Path(__file__).resolve().parents[1])


@dataclass(frozen=True)
class HostRead:
    """One read: ``what`` (the op or method), ``where`` (``file:line (function)`` of the innermost comera_fx frame
    on the stack, else of the innermost frame outside torch) and ``by_comera_fx`` (was a comera_fx frame on it)."""

    what: str
    where: str
    by_comera_fx: bool


@dataclass
class HostReads:
    """What ``host_reads`` saw, in order."""

    reads: list[HostRead] = field(default_factory=list)

    def by_comera_fx(self) -> list[HostRead]:
        """The reads comera_fx made (not the caller's own, nor the optimizer's)."""
        return [read for read in self.reads if read.by_comera_fx]

    def clear(self) -> None:
        self.reads.clear()

    def __len__(self) -> int:
        return len(self.reads)

    def __str__(self) -> str:
        return "\n".join(f"{r.what} at {r.where}" for r in self.reads) or "no host reads"


def _read(what: str) -> HostRead:
    frames = traceback.extract_stack()
    outside_torch = [f for f in frames if "/torch/" not in f.filename and f.filename != __file__]
    ours = [f for f in outside_torch if f.filename.startswith(_PACKAGE)]
    chosen = (ours or outside_torch or frames)[-1]
    return HostRead(what, f"{Path(chosen.filename).name}:{chosen.lineno} ({chosen.name})", bool(ours))


class _SyncOps(TorchDispatchMode):
    def __init__(self, found: HostReads):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.found.reads.append(_read(f"aten.{func.overloadpacket.__name__}"))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads():
    """While active, record every read of tensor values to the host (see the module docstring); yields the
    ``HostReads`` being filled."""
    found = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            found.reads.append(_read(f"Tensor.{name}"))
            return original(self, *args, **kwargs)

        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        with _SyncOps(found):
            yield found
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
