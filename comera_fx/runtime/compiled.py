"""Which TT matrices run inside compiled code, and how: what lets ``RankAdaptive`` choose its shape policy itself.

A prune that changes a core's shape makes every compiled graph holding it recompile. Eagerly, shrinking at every
prune is what pays (smaller cores, faster steps); compiled, each shrink is a recompile, so the hook holds the stored
shapes until the last prune point (and, for regionally compiled blocks, gives the same matrix of every block one
shape). It learns that the model is compiled from two places:

* ``comera_fx.backend`` notes every parameter a graph it compiles takes as input (``note_graph_inputs``);
* ``comera_fx.compile_regions`` / ``comera_fx.compile`` mark the TT matrices of what they compile (``mark_compiled``),
  whatever the backend;
* stock compiles the hook can see (``note_stock_compiles``): it was handed ``torch.compile(model)`` (an
  ``OptimizedModule``), or the model or some of its submodules were compiled in place (``module.compile()`` sets
  ``_compiled_call_impl``; several compiled submodules count as regional blocks), or a submodule was replaced by
  ``torch.compile(submodule)``. A compile it cannot see, ``compiled = torch.compile(model)`` with the hook given
  ``model``, needs ``mark_compiled(model)`` (or ``BudgetConfig.shrink_slack`` / ``same_shape_blocks``).

Weak references only: nothing here keeps a model or a parameter alive.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from ..tt.layers import TTMatrix

WHOLE, REGIONAL = "whole", "regional"

_graph_params: dict[int, weakref.ref] = {}  # by id: tensors cannot sit in a WeakSet (== is elementwise)
_marked: "weakref.WeakKeyDictionary[TTMatrix, str]" = weakref.WeakKeyDictionary()


def note_graph_inputs(inputs: Iterable) -> None:
    """Called by comera_fx's backend with a compiled graph's inputs: remembers its parameters."""
    for value in inputs:
        if isinstance(value, nn.Parameter):
            _graph_params[id(value)] = weakref.ref(value, lambda _, key=id(value): _graph_params.pop(key, None))


def mark_compiled(model: nn.Module, regional: bool = False) -> None:
    """Tell ``RankAdaptive`` that ``model``'s TT matrices run compiled: as a whole model (``regional=False``) or as
    repeated blocks sharing one compiled graph (``regional=True``: the blocks then need one shape)."""
    for module in model.modules():
        if isinstance(module, TTMatrix):
            _marked[module] = REGIONAL if regional else _marked.get(module, WHOLE)


def note_stock_compiles(model: nn.Module) -> bool:
    """Mark the TT matrices of ``model``'s stock compiles that show on the module tree (see the module docstring):
    whole for the model itself (or its ``torch.compile`` wrapper's module), regional for two or more compiled
    submodules (blocks compiled one by one share one graph), whole for a single one, regional for a torch.nn
    container compiled in place (below). Returns whether any showed.
    One walk over the modules, no tracing."""
    from torch._dynamo.eval_frame import OptimizedModule

    roots, found = {id(model)}, []  # found: (compiled module, compiled in place)
    for module in model.modules():
        if isinstance(module, OptimizedModule):
            found.append((module._orig_mod, False))
            if module is model:
                roots.add(id(module._orig_mod))
        elif getattr(module, "_compiled_call_impl", None) is not None:
            found.append((module, True))
    inner = sum(id(module) not in roots for module, _ in found)
    for module, in_place in found:
        # A torch.nn container compiled in place (``nn.Sequential(...).compile()``): Dynamo skips torch.nn's code and
        # compiles each child's forward as a frame of its own, shared by same-class children: regional
        torch_nn_frames = in_place and type(module).__module__.startswith("torch.nn.")
        mark_compiled(module, regional=(id(module) not in roots and inner > 1) or torch_nn_frames)
    return bool(found)


def recompile_extras(model: nn.Module, device_type: str) -> str:
    """What a recompile of ``model``'s stock compiles costs besides compiling, in words for a warning: CUDA graphs
    recorded again (``mode="reduce-overhead"`` or ``"max-autotune"``, ``options={"triton.cudagraphs": True}``,
    ``backend="cudagraphs"``; on ``device_type`` "cuda" only, elsewhere Inductor skips them), kernels tuned again
    (max-autotune); "" when none shows. Read from torch's private compile wrappers, best effort: where they look
    otherwise (another torch), "" and the warnings say less."""
    costs = set()
    for backend in _stock_backends(model):
        config = getattr(backend, "config", None)
        config = config if isinstance(config, dict) else {}
        graphs = config.get("triton.cudagraphs") or getattr(backend, "compiler_name", None) == "cudagraphs"
        if graphs and device_type == "cuda":
            costs.add("its CUDA graphs are recorded again")
        if config.get("max_autotune"):
            costs.add("max-autotune tunes its kernels again")
    return "; ".join(sorted(costs))


def _stock_backends(model: nn.Module) -> list:
    """The backends (the ``torch.compile`` wrapper objects) of the stock compiles on ``model``'s module tree."""
    from torch._dynamo.eval_frame import OptimizedModule

    callbacks = []
    for module in model.modules():
        if isinstance(module, OptimizedModule):
            callbacks.append(getattr(getattr(module, "dynamo_ctx", None), "callback", None))
        elif (compiled := getattr(module, "_compiled_call_impl", None)) is not None:
            cells = [cell.cell_contents for cell in getattr(compiled, "__closure__", None) or ()]
            callbacks += [c for c in cells if hasattr(c, "_torchdynamo_orig_backend")]
    backends = []
    for backend in callbacks:
        for _ in range(8):  # ConvertFrame -> WrapBackendDebug -> the compile wrapper: a short chain
            if not hasattr(backend, "_torchdynamo_orig_backend"):
                break
            backend = backend._torchdynamo_orig_backend
        backends.append(backend)
    return backends


def compiled_module(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper runs (layer names without its ``_orig_mod.``), else ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def compile_state(matrices: Sequence[TTMatrix]) -> str | None:
    """How ``matrices`` (a model's TT matrices) run: None (no sign of a compile), ``"whole"`` or ``"regional"``.

    Regional where ``compile_regions`` marked any of them, or where the backend saw some but not all of them: blocks
    compiled one by one (``block.compile(backend=comera_fx.backend)``) share one graph, so only the first block's
    parameters reach the backend."""
    marks = {_marked.get(tt) for tt in matrices}
    if REGIONAL in marks:
        return REGIONAL
    seen = [tt in _marked or any(_in_graph(p) for p in tt.parameters()) for tt in matrices]
    if not any(seen):
        return None
    return WHOLE if all(seen) else REGIONAL


def _in_graph(param: Tensor) -> bool:
    ref = _graph_params.get(id(param))
    return ref is not None and ref() is param


class ShapePolicy:
    """``RankAdaptive``'s choice of when a prune changes stored shapes, from how the model runs (``compile_state``,
    looked up until a compile is found, then kept for the run) and the ``BudgetConfig`` overrides."""

    def __init__(self, matrices: Sequence[TTMatrix], model: nn.Module | None = None):
        self.matrices = list(matrices)
        self._model = weakref.ref(model) if model is not None else None  # looked at for stock compiles
        self.eager = False  # shrink_eagerly(): the run no longer compiles
        self._found: str | None = None
        self._physical, self._warned = 0, False
        self._warned_every_prune = False

    @property
    def compiled_as(self) -> str | None:
        if self._found is None and not self.eager:
            model = self._model() if self._model is not None else None
            if model is not None:
                note_stock_compiles(model)
            self._found = compile_state(self.matrices)
        return None if self.eager else self._found

    def same_shape_blocks(self, given: bool | None) -> bool:
        """As given, else on whenever the model runs compiled: regional blocks then share one recompiled graph, and
        in a whole-model graph the blocks' kernels are the same code, which Inductor compiles once (a 2-block LM at
        max rank 32: the recompile 0.82x the first compile against 1.21-1.24x with each block at its own widths)."""
        return bool(given) if given is not None else self.compiled_as is not None

    def compacts(self, slack: float | None, stored: int, live_after: int) -> bool:
        """Does a prune shrink physically? With a slack, when the stored size would exceed it × the live size after
        the prune; without, unless the model runs compiled (then only the last prune point does)."""
        if slack is None:
            return self.compiled_as is None
        return stored > slack * live_after

    def shrunk_physically(self, slack: float | None, same_shape_given: bool | None) -> None:
        """A physical shrink of a compiled model is a recompile: warn, naming the setting, from the second one on
        (from the first for regional blocks stored at their own widths: a recompiled graph per block)."""
        compiled = self.compiled_as
        if compiled is None or self._warned:
            return
        self._physical += 1
        per_block = compiled == REGIONAL and not self.same_shape_blocks(same_shape_given)
        if self._physical < 2 and not per_block:
            return
        self._warned = True
        why = (
            "same_shape_blocks=False stores each block's matrices at their own widths (a recompiled graph per block)"
            if per_block
            else f"shrink_slack={slack} shrinks the cores physically again ({self._physical} physical shrinks so far, "
            f"a recompile each)"
        )
        warnings.warn(
            f"RankAdaptive: the model runs compiled ({compiled}{self._extras()}) and {why}; leave "
            f"BudgetConfig.shrink_slack and same_shape_blocks unset (None): the hook then holds the shapes until "
            f"the last prune point and recompiles once",
            stacklevel=5,
        )

    def shrinks_at_every_prune(self) -> None:
        """CoMERA's prunes always shrink physically: compiled, each is a recompile (and Dynamo falls back to eager
        after ``recompile_limit`` of them). Warn once, at the first, naming the schedules that avoid it."""
        compiled = self.compiled_as
        if compiled is None or self._warned_every_prune:
            return
        self._warned_every_prune = True
        warnings.warn(
            f"RankAdaptive: the model runs compiled ({compiled}{self._extras()}) and CoMERA's prunes shrink the "
            f"cores physically at every prune, each a recompile; use BudgetConfig (it holds the shapes until its "
            f"last prune point: one recompile), or CoMERAConfig(prune_every=None) and hook.prune() once after "
            f"training",
            stacklevel=5,
        )

    def _extras(self) -> str:
        model = self._model() if self._model is not None else None
        device_type = self.matrices[0].device.type if self.matrices else "cpu"
        extras = recompile_extras(model, device_type) if model is not None else ""
        return f"; at each recompile {extras}" if extras else ""
