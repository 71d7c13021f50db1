"""``torch.compile`` backend: comera_fx's graph passes, then AOTAutograd and Inductor.

Usage::

    model = comera_fx.compile(model, config, example_inputs=x)       # tensorize_ + compile (blocks regionally)
    compiled = torch.compile(model, backend=comera_fx.backend)        # a model already tensorized
    compiled = torch.compile(model, backend="comera_fx")               # the same, by name (entry point)
    compiled = torch.compile(model, backend=comera_fx.make_backend(BackendConfig(inductor=False)))
    comera_fx.compile_regions(model)                                   # each repeated block, one graph for all

What runs, per graph Dynamo captures:

1. on the Dynamo graph (torch-level ops, parameters as inputs): ``passes.contract_reconstructed_tt`` — a linear-like
   op whose weight is rebuilt from TT cores (``tensorize_``'s property for functional parameters) becomes the
   planned contraction of x with the cores; then large dense weights still fed to linear / matmul / embedding ops
   are reported once, naming ``comera_fx.tensorize_``. TT modules need no rewrite here: Dynamo traces their
   forward, which already emits the planner's pairwise reshape / permute / mm steps, with the plan chosen by
   comparisons of the batch size against the breakpoints (one graph per planner interval under dynamic shapes).
   On CPU graphs ``passes.fast_dropout`` draws training-mode dropout masks from bulk random words (CoMERA's softmax +
   dropout site 2.4x faster than with aten's per-element ``bernoulli_``, investigations/bench_cpu_dropout.py;
   ``BackendConfig.fast_dropout``). With ``rmm`` set, ``passes.randomize_backward`` gives the large dense
   linear-like ops a randomized backward (TT layers get theirs from ``comera_fx.randomize_backward_`` on the
   model); ``passes.share_sketches`` always runs, so randomized layers reading one tensor keep one sketch of it.
2. AOTAutograd splits the forward and backward graphs (aten ops); ``BackendConfig.post_aot_passes`` run on each,
   knowing which one it is.
3. Inductor compiles each (C++/OpenMP on CPU, Triton on GPU) — or, with ``inductor=False``, the aten graphs run
   as they are (a fast debugging mode, like ``aot_eager``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import re
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from .config import TensorizeConfig
from .passes.dropout import fast_dropout
from .passes.find import UseKind, classify_use
from .passes.recognize import contract_reconstructed_tt, node_values
from .passes.randomize import randomize_backward, share_sketches
from .rmm import RMMConfig
from .runtime.compiled import mark_compiled, note_graph_inputs
from .tt.layers import prepare_plans_under

GraphPass = Callable[[fx.GraphModule], fx.GraphModule]
# An after-AOTAutograd pass may also take ``is_backward=...`` (see ``BackendConfig.post_aot_passes``).


class DenseWeightsWarning(UserWarning):
    """Large dense weights reached the comera_fx backend untensorized."""


@dataclass(frozen=True)
class BackendConfig:
    """How ``comera_fx.backend`` compiles.

    Attributes:
        inductor: hand the graphs to Inductor (default). False runs the AOTAutograd graphs eagerly: same passes,
            no code generation — for debugging and fast tests.
        contract_reconstructed: rewrite linear-like ops on weights rebuilt from TT cores (step 1 above).
        warn_dense: report large dense weights left in the graph (once per weight per backend).
        large: what counts as large for that report (``TensorizeConfig.min_numel`` / ``min_dim``).
        post_aot_passes: functions GraphModule -> GraphModule run on the forward and the backward aten graphs
            before Inductor; a pass with an ``is_backward`` keyword parameter is told which graph it gets. They run
            when a graph is compiled: a graph that AOTAutograd's on-disk cache returns (a warm start) was compiled
            with them, keyed by each pass's ``uuid()`` or source, and does not call them again. A pass with neither
            (a builtin) turns that cache off.
        inductor_options: Inductor config patches, as ``torch.compile(options=...)`` takes them. On CPU graphs
            the backend adds ``fallback_random=True`` unless given here: random ops (dropout) then run eager's
            aten kernels instead of Inductor's generated RNG, which is slower on CPU (CoMERA's two dropout sites:
            2.3-3.0x eager's time with it, 1.4-1.6x without;
            benchmarks/investigations/bench_cpu_dropout.py), and the masks follow the eager RNG stream. GPU graphs
            keep Inductor's.
        cpu_aten_kernels: ops Inductor would decompose that CPU graphs run as aten's kernels instead. Default:
            ``aten.embedding_dense_backward`` — Inductor's decomposition (a scatter-add loop) took 3x aten's
            kernel for a position embedding's gradient, 2.8x for a TT-matrix lookup's and 1.1x for a dense
            30522 x 768 table's (benchmarks/investigations/bench_embedding_backward.py). ``()`` keeps Inductor's
            decompositions.
        fast_dropout: on CPU graphs, rewrite training-mode dropout with ``passes.fast_dropout`` (default): masks
            from 64-bit random words, four 16-bit lanes each, instead of one ``bernoulli_`` draw per element — the
            drop rate rounded to a multiple of 2**-16, the output's expectation exact, reproducible under
            ``torch.manual_seed`` but not eager's masks. False keeps aten's dropout: with ``fallback_random`` the
            compiled model then drops the units eager drops after the same ``torch.manual_seed``.
        rmm: randomized backward for the large dense linear-like ops in the graph (``RMMConfig``, or a float ρ for
            ``RMMConfig(rho=ρ)``); None (default) keeps every backward exact.
        activation_memory_budget: AOTAutograd's recomputation budget (``torch._functorch.config.
            activation_memory_budget``) for this backend's graphs, in [0, 1]: 1 saves what is fastest, lower
            values recompute cheap ops in backward to keep fewer activations. None leaves the global setting.
    """

    inductor: bool = True
    contract_reconstructed: bool = True
    warn_dense: bool = True
    large: TensorizeConfig = field(default_factory=TensorizeConfig)
    post_aot_passes: tuple[GraphPass, ...] = ()
    inductor_options: Mapping[str, Any] = field(default_factory=dict)
    rmm: RMMConfig | float | None = None
    activation_memory_budget: float | None = None
    fast_dropout: bool = True
    cpu_aten_kernels: tuple = (torch.ops.aten.embedding_dense_backward,)

    def __post_init__(self) -> None:
        budget = self.activation_memory_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1
        ):
            raise ValueError(f"activation_memory_budget must be None or a number in [0, 1], got {budget!r}")
        kernels = self.cpu_aten_kernels
        if not isinstance(kernels, tuple) or not all(
            isinstance(op, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)) for op in kernels
        ):
            raise ValueError(
                "cpu_aten_kernels must be a tuple of aten ops "
                f"(e.g. torch.ops.aten.embedding_dense_backward), got {kernels!r}"
            )
        if self.rmm is not None and not isinstance(self.rmm, RMMConfig):
            if isinstance(self.rmm, bool) or not isinstance(self.rmm, (int, float)):
                raise ValueError(f"rmm must be None, an RMMConfig or a float rho in (0, 1], got {self.rmm!r}")
            object.__setattr__(self, "rmm", RMMConfig(rho=self.rmm))

    def with_options(self, options: Mapping[str, Any] | None) -> "BackendConfig":
        """``torch.compile(..., options={...})``: our field names set fields, anything else goes to Inductor."""
        if not options:
            return self
        ours = {f.name for f in dataclasses.fields(self)} - {"inductor_options"}
        changes = {k: v for k, v in options.items() if k in ours}
        extra = {k: v for k, v in options.items() if k not in ours}
        if "post_aot_passes" in changes:
            changes["post_aot_passes"] = tuple(changes["post_aot_passes"])
        if extra:
            changes["inductor_options"] = {**self.inductor_options, **extra}
        return dataclasses.replace(self, **changes)


@dataclass
class BackendStats:
    """What one backend object did: graphs compiled (one per Dynamo graph, recompiles included) and rewrites.

    ``reconstructed_contracted`` counts rewrites per compile attempt (a restarted attempt counts again)."""

    graphs: int = 0
    reconstructed_contracted: int = 0
    dense_reported: list[str] = field(default_factory=list)
    rmm_rewritten: int = 0  # linear-like ops given a randomized backward by ``BackendConfig.rmm``, and
    dropouts_rewritten: int = 0  # dropouts drawn from random words (``passes.fast_dropout``), successful attempts
    sketches_shared: int = 0  # sketches merged into another of one input (``passes.share_sketches``), in the
    #                                graphs compiled (successful attempts only)
    pass_seconds: float = 0.0  # in comera_fx's own passes (both stages)
    compile_seconds: float = 0.0  # in the backend calls: passes, AOTAutograd, Inductor's forward (Inductor
    #                                lowers the backward lazily, at the first backward call, outside this figure)
    cache_hits: int = 0  # graphs AOTAutograd's on-disk cache returned instead of compiling (warm starts)


class ComeraBackend:
    """The backend object ``torch.compile`` calls as ``backend(gm, example_inputs, mode=..., options=...)``."""

    def __init__(self, config: BackendConfig | None = None):
        self.config = config or BackendConfig()
        self.stats = BackendStats()
        self._reported: dict[int, weakref.ref] = {}  # by id: tensors cannot sit in a WeakSet (== is elementwise)
        self.__name__ = "comera_fx"  # torch.compile names the backend after this in logs and errors

    def __repr__(self) -> str:
        return f"ComeraBackend({self.config})"

    def __call__(
        self, gm: fx.GraphModule, example_inputs, *, mode: str | None = None, options: Mapping[str, Any] | None = None
    ):
        started = time.perf_counter()
        config = self.config.with_options(options)
        note_graph_inputs(example_inputs)  # RankAdaptive then holds these TT matrices' shapes between prunes
        if config.contract_reconstructed:
            gm = contract_reconstructed_tt(gm, example_inputs)
            self.stats.reconstructed_contracted += gm.meta.get("comera_fx_reconstructed", 0)
        if config.warn_dense:
            self._report_dense(gm, example_inputs, config.large)
        if config.fast_dropout and _on_cpu(example_inputs):
            gm = fast_dropout(gm)
        if config.rmm is not None:
            gm = randomize_backward(
                gm, config.rmm.rho, config.rmm.sketch, min_numel=config.rmm.min_numel, example_inputs=example_inputs
            )
        gm = share_sketches(gm)
        self.stats.pass_seconds += time.perf_counter() - started
        budget = (
            {}
            if config.activation_memory_budget is None
            else {"activation_memory_budget": float(config.activation_memory_budget)}
        )
        with torch._functorch.config.patch(**budget):
            hits_before = _autograd_cache_hits()
            compiled = self._compile(gm, example_inputs, config, mode)
            self.stats.cache_hits += _autograd_cache_hits() - hits_before
        # Counted on success only: AOTAutograd may abort a first attempt (e.g. to specialise a float) and Dynamo
        # then calls the backend again for the same frame.
        self.stats.graphs += 1
        self.stats.rmm_rewritten += gm.meta.get("comera_fx_rmm_rewritten", 0)
        self.stats.sketches_shared += gm.meta.get("comera_fx_sketches_shared", 0)
        self.stats.dropouts_rewritten += gm.meta.get("comera_fx_dropouts_rewritten", 0)
        self.stats.compile_seconds += time.perf_counter() - started
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs, config: BackendConfig, mode: str | None):
        if config.inductor:
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {**(list_mode_options(mode) if mode else {}), **config.inductor_options}
            on_cpu = _on_cpu(example_inputs)
            if "fallback_random" not in patches and on_cpu:
                patches["fallback_random"] = True
            decompositions = _aten_kernel_decompositions(config.cpu_aten_kernels, patches) if on_cpu else None
            inner = functools.partial(_inner_compile, passes=config.post_aot_passes, stats=self.stats)
            # AOTAutograd's cache (on disk, across processes) returns the graphs our inner compile made without
            # calling it again: right only if its key holds what that compile depended on beyond the graph, our
            # ``post_aot_passes`` and decomposition table. A no-op Inductor pass carries them into the key
            # (Inductor hashes a custom pass's uuid); where a pass has no stable identity, the cache stays off and
            # Inductor's own graph cache (keyed on the graph after our passes) still spares the C++ builds.
            needs_key = bool(config.post_aot_passes) or decompositions is not None
            tag = _cache_tag(config, patches) if needs_key else None
            if tag is not None:
                patches["post_grad_custom_pre_pass"] = tag
            bypass = needs_key and tag is None
            autograd_cache = (
                {"enable_autograd_cache": False} if bypass else {"autograd_cache_allow_custom_autograd_functions": True}
            )  # the planner's Function: keyed by its graph
            with torch._functorch.config.patch(**autograd_cache):
                return compile_fx(
                    gm,
                    example_inputs,
                    inner_compile=inner,
                    config_patches=patches or None,
                    decompositions=decompositions,
                )
        return _aot_eager(
            gm, example_inputs, config.post_aot_passes, self.stats, min_cut=config.activation_memory_budget is not None
        )

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: forget what was reported, so a fresh compile reports again."""
        self._reported = {}
        self.stats = BackendStats()

    def _report_dense(self, gm: fx.GraphModule, example_inputs, large: TensorizeConfig) -> None:
        found = []
        for node, value in node_values(gm, example_inputs).items():
            if not isinstance(value, nn.Parameter) or value.dim() != 2 or not large.is_large(tuple(value.shape)):
                continue
            kinds = {classify_use(user, node) for user in node.users}
            seen = self._reported.get(id(value))
            if not kinds & {UseKind.LINEAR, UseKind.MATMUL, UseKind.EMBEDDING} or (
                seen is not None and seen() is value
            ):
                continue
            self._reported[id(value)] = weakref.ref(value)
            found.append(f"{_readable_name(node)} {tuple(value.shape)}")
        if found:
            self.stats.dense_reported.extend(found)
            shown = ", ".join(found[:6]) + (f", … ({len(found) - 6} more)" if len(found) > 6 else "")
            warnings.warn(
                f"comera_fx backend: {len(found)} large dense weight(s) run as dense linear/embedding ops: {shown}. "
                "Tensorize the model first: comera_fx.tensorize_(model, config) before torch.compile, or "
                "comera_fx.compile(model, config) for both.",
                DenseWeightsWarning,
                stacklevel=2,
            )


def _readable_name(node: fx.Node) -> str:
    """``fc1.weight`` from Dynamo's source ``L['self']._modules['fc1']._parameters['weight']``."""
    if node.op == "get_attr":
        return str(node.target)
    grapharg = node.meta.get("grapharg")
    source = grapharg.source.name if grapharg is not None and hasattr(grapharg, "source") else None
    if callable(source):
        source = source()
    if isinstance(source, str):
        keys = re.findall(r"\['([^']+)'\]", source)
        if len(keys) > 1 and keys[0] == "self":
            return ".".join(keys[1:])
        if keys:
            return ".".join(keys)
    return node.name


def _aten_kernel_decompositions(ops, patches: Mapping[str, Any]):
    """Inductor's decomposition table (as it would choose it under ``patches``) less the overloads of ``ops``, each
    given an aten-kernel lowering; None (Inductor's own choice) when ``ops`` is empty."""
    if not ops:
        return None
    from torch._inductor.decomposition import select_decomp_table

    with torch._inductor.config.patch(dict(patches)):
        table = dict(select_decomp_table())
    for op in ops:
        overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, n) for n in op.overloads()]
        for overload in overloads:
            table.pop(overload, None)
            _register_aten_fallback(overload)
    return _DecompTable(table, [str(op) for op in ops])


class _DecompTable(dict):
    """Inductor's decomposition table less the ops kept as aten kernels. Inductor pickles the table into its FX
    graph cache key, and the table's C++ functions do not pickle (the cache was bypassed): this one pickles as what
    it is made from (the ops taken out; torch's version and Inductor's config are in the key already)."""

    def __init__(self, table: Mapping, without: list[str]):
        super().__init__(table)
        self.without = tuple(sorted(without))

    def __reduce__(self):
        return (tuple, (("comera_fx: Inductor's decompositions without", *self.without),))


def _register_aten_fallback(overload) -> None:
    """Give Inductor an explicit aten-kernel lowering for an op it would otherwise decompose. Inductor's implicit
    fallback does the same, but raises for an op that has a decomposition when the environment sets ``CI`` (a check
    meant for PyTorch's own CI). Contiguous inputs, as the implicit fallback requires in backward graphs. The
    lowering is only reached where the op was not decomposed, i.e. in this backend's graphs."""
    from torch._inductor.lowering import lowerings, make_fallback, require_contiguous

    if overload not in lowerings:
        make_fallback(overload, layout_constraint=require_contiguous, warn=False, override_decomp=True)


def _takes_is_backward(graph_pass) -> bool:
    """Whether a pass declares an ``is_backward`` parameter (functions, partials and callable objects alike)."""
    try:
        return "is_backward" in inspect.signature(graph_pass).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _apply(passes, gm: fx.GraphModule, is_backward: bool, stats: BackendStats) -> fx.GraphModule:
    started = time.perf_counter()
    for graph_pass in passes:
        gm = graph_pass(gm, is_backward=is_backward) if _takes_is_backward(graph_pass) else graph_pass(gm)
    stats.pass_seconds += time.perf_counter() - started
    return gm


def _autograd_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def _pass_identity(graph_pass) -> str | None:
    """A stable text for a post-AOT pass across processes: its ``uuid()``, or a function's module, name, source,
    defaults and closure values; None (no caching) when it has no source, or closes over or defaults to anything
    but plain values (a threshold in a closure must change the key, and an object's repr may not say what it is)."""
    if hasattr(graph_pass, "uuid"):
        return f"uuid:{graph_pass.uuid()}"
    if isinstance(graph_pass, functools.partial):
        inner = _pass_identity(graph_pass.func)
        bound = (graph_pass.args, tuple(sorted(graph_pass.keywords.items())))
        return None if inner is None or not _plain(bound) else f"partial:{inner}:{bound!r}"
    try:
        source = inspect.getsource(graph_pass)
    except (OSError, TypeError):
        return None
    closure = tuple(cell.cell_contents for cell in getattr(graph_pass, "__closure__", None) or ())
    defaults = (getattr(graph_pass, "__defaults__", None), getattr(graph_pass, "__kwdefaults__", None))
    if not _plain((closure, defaults)):
        return None
    return (
        f"{getattr(graph_pass, '__module__', '')}.{getattr(graph_pass, '__qualname__', '')}:{source}:"
        f"{closure!r}:{defaults!r}"
    )


def _plain(value) -> bool:
    """Numbers, strings, bools, None and tuples / lists / dicts of them: values whose repr says what they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _cache_tag(config: "BackendConfig", patches: Mapping[str, Any]):
    """The no-op Inductor pass that puts this backend's post-AOT passes and aten-kernel ops into AOTAutograd's
    cache key, or None (the cache must stay off): a pass without a stable identity, or a pre-pass of the user's."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    identities = [_pass_identity(p) for p in config.post_aot_passes]
    if (
        any(i is None for i in identities)
        or patches.get("post_grad_custom_pre_pass") is not None
        or torch._inductor.config.post_grad_custom_pre_pass is not None
    ):
        return None
    ops = sorted(str(op) for op in config.cpu_aten_kernels)
    digest = hashlib.sha256("\n".join(["comera_fx backend", *ops, *identities]).encode()).hexdigest()

    class CacheTag(CustomGraphPass):
        """Changes nothing; its uuid is the key material AOTAutograd's cache would otherwise miss."""

        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return digest

    return CacheTag()


def _inner_compile(gm: fx.GraphModule, example_inputs, *, passes, stats: BackendStats, **kwargs):
    """Inductor's per-graph compiler, after our aten-level passes (forward, backward or inference graph)."""
    from torch._inductor.compile_fx import compile_fx_inner

    if passes:
        gm = _apply(passes, gm, bool(kwargs.get("is_backward", False)), stats)
        gm.recompile()
    return compile_fx_inner(gm, example_inputs, **kwargs)


def _aot_eager(gm: fx.GraphModule, example_inputs, passes, stats: BackendStats, min_cut: bool = False):
    """AOTAutograd without code generation; ``min_cut``: Inductor's partitioner (the one that honours an
    activation memory budget) instead of the default one."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(is_backward):
        def compile_graph(graph_module, inputs):
            graph_module = _apply(passes, graph_module, is_backward, stats)
            graph_module.recompile()
            return make_boxed_func(graph_module.forward)

        return compile_graph

    partition = {"partition_fn": min_cut_rematerialization_partition} if min_cut else {}
    return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True), **partition)(gm, example_inputs)


def _on_cpu(example_inputs) -> bool:
    """Every tensor input of the graph (parameters included) on the CPU, and at least one tensor."""
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return devices == {"cpu"}


def make_backend(config: BackendConfig | None = None, **fields) -> ComeraBackend:
    """A backend with its own settings and statistics: ``make_backend(inductor=False)``."""
    config = config or BackendConfig()
    return ComeraBackend(dataclasses.replace(config, **fields) if fields else config)


# The shared default backend, also what ``backend="comera_fx"`` resolves to through the entry point.
backend = ComeraBackend()


def compile(
    model: nn.Module,
    config: TensorizeConfig | None = None,
    *,
    example_inputs=None,
    backend_config: BackendConfig | None = None,
    regional: bool | None = None,
    **compile_kwargs,
):
    """``tensorize_`` the model in place, plan its TT products, then compile it with comera_fx's backend: its
    repeated blocks regionally where it has them, else the whole model.

    Build the optimizer after this call (the cores are new parameters). ``compile_kwargs`` go to
    ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``, ``options``). The tensorize summary is on the result
    as ``.comera_fx_summary``. ``regional``: None (default) compiles each repeated block on its own when the model
    has any (``repeated_blocks``; ``compile_regions``: a TT model's whole-model cold compile costs 1.8x the dense
    model's stock compile on a 6-block LM, one block's compile serves all blocks) and returns ``model`` itself, its
    blocks compiled in place, the rest running eagerly; otherwise, or with ``regional=False``, returns
    ``torch.compile(model, ...)``. True requires repeated blocks. Either way ``RankAdaptive`` learns how the model
    runs and holds its shapes until the last prune point (one recompile).
    """
    from .passes.tensorize import tensorize_

    summary = tensorize_(model, config, example_inputs=example_inputs)
    chosen = make_backend(backend_config) if backend_config is not None else backend
    if regional is None:
        regional = bool(repeated_blocks(model))
    if regional:
        compile_regions(model, backend=chosen, **compile_kwargs)  # plans its regions; the rest runs eagerly
        model.comera_fx_summary = summary
        return model
    prepare_plans_under(model)
    mark_compiled(model)
    compiled = torch.compile(model, backend=chosen, **compile_kwargs)
    compiled.comera_fx_summary = summary
    return compiled


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks a model repeats: the children of every ``nn.ModuleList`` that holds at least two
    modules of one class, each a module with submodules (a transformer's layers), outermost lists only."""
    names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(n + ".") for n in names):
            continue
        counts: dict[type, int] = {}
        for child in module.children():
            counts[type(child)] = counts.get(type(child), 0) + 1
        names += [
            f"{name}.{key}" if name else key
            for key, child in module.named_children()
            if counts[type(child)] >= 2 and next(child.children(), None) is not None
        ]
    return names


def _region_names(model: nn.Module, regions) -> list[str]:
    if regions is None:
        return repeated_blocks(model)
    if isinstance(regions, type) or (isinstance(regions, tuple) and regions and isinstance(regions[0], type)):
        classes = regions if isinstance(regions, tuple) else (regions,)
        names: list[str] = []
        for name, module in model.named_modules():
            if name and isinstance(module, classes) and not any(name.startswith(n + ".") for n in names):
                names.append(name)
        return names
    names = list(regions)
    for name in names:
        model.get_submodule(name)  # AttributeError naming the missing module, before anything is compiled
    return names


def compile_regions(model: nn.Module, regions=None, *, backend: Callable | None = None, **compile_kwargs) -> list[str]:
    """Compile each repeated block of ``model`` on its own, in place (regional compilation); returns their names.

    Blocks of one class share their ``forward``'s code, so Dynamo reuses one compiled graph for every block with
    the same shapes: an N-block model's cold compile costs about one block's instead of growing with N (a TT
    model's blocks are long chains of small contractions, so whole-model compiles of them are slow). The rest of
    the model (embeddings, head, loss) runs eagerly; ``state_dict`` keys do not change.

    ``regions``: a module class or a tuple of classes (every outermost instance is compiled), or module names;
    default: ``repeated_blocks(model)``. ``backend``: default ``comera_fx.backend``; ``compile_kwargs`` go to
    ``torch.compile``.

    The regions' TT matrices are marked compiled (``runtime.compiled.mark_compiled``), so ``RankAdaptive`` holds
    their shapes until its last prune point and then gives the same matrix of every block one shape
    (``same_shape_blocks``, on by default for any compiled model): one recompiled graph serves all blocks. Set
    ``BudgetConfig(same_shape_blocks=False)`` and each block compiles a graph of its own after a physical shrink;
    those graphs all belong to one code object, so this raises Dynamo's ``recompile_limit`` to twice the number of
    regions plus one when it is lower; beyond the limit Dynamo runs a block eagerly, correct but slow.
    """
    names = _region_names(model, regions)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (children of an nn.ModuleList sharing a "
            f"class); pass regions=(YourBlock,) or the names of the modules to compile, or use "
            f"torch.compile(model, backend=comera_fx.backend) for the whole model"
        )
    chosen = backend if backend is not None else _SHARED_BACKEND
    for name in names:
        region = model.get_submodule(name)
        prepare_plans_under(region)
        mark_compiled(region, regional=True)
        region.compile(backend=chosen, **compile_kwargs)
    needed = 2 * len(names) + 1
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
    return names


_SHARED_BACKEND = backend
