"""Find the large linear-like and embedding ops of a model through a captured graph.

A module-type scan misses ``F.linear`` on raw parameters, GPT-2's ``Conv1D`` (``addmm`` with the weight as an
operand) and weights used twice; the graph sees them all. Each parameter becomes one ``Candidate`` listing every
op that uses it, so a tied embedding + output head is one entry with two uses.
"""

from __future__ import annotations

import enum
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..config import TensorizeConfig
from ..tt.inventory import is_hf_conv1d
from .isolation import untraced

aten = torch.ops.aten


class UseKind(str, enum.Enum):
    """How an op reads a weight P.

    LINEAR: y = x Pᵀ (+ b), P is (out × in). MATMUL: y = x P (+ b), P is (in × out) — ``mm``/``matmul``/``@`` and
    GPT-2's ``addmm``. EMBEDDING: rows of P are gathered. OTHER: anything else (the parameter is then left alone).
    """

    LINEAR = "linear"
    MATMUL = "matmul"
    EMBEDDING = "embedding"
    OTHER = "other"


_LINEAR_TARGETS = {torch._C._nn.linear, F.linear, aten.linear.default}
_MATMUL_TARGETS = {torch.mm, torch.matmul, operator.matmul, aten.mm.default, aten.matmul.default}
_ADDMM_TARGETS = {torch.addmm, aten.addmm.default}
_EMBEDDING_WEIGHT_FIRST = {torch.embedding, aten.embedding.default}  # (weight, indices, ...)


@dataclass(frozen=True)
class Use:
    """One op reading the parameter: its kind and the node's name in the captured graph. ``module``: the path of
    the module whose forward ran the op ("" for the root), where the capture records it (Dynamo's module stack)."""

    kind: UseKind
    node: str
    target: str
    module: str | None = None


@dataclass
class Candidate:
    """A parameter read by linear-like or embedding ops."""

    fqn: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    uses: list[Use] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """'embedding' if any use gathers rows (the TT then stores P itself), else 'linear'."""
        return "embedding" if any(u.kind is UseKind.EMBEDDING for u in self.uses) else "linear"

    @property
    def unsupported_uses(self) -> list[Use]:
        return [u for u in self.uses if u.kind is UseKind.OTHER]


@dataclass
class FindResult:
    """What the finder saw: candidates in first-use order, and how the model was read."""

    candidates: list[Candidate]
    method: str  # "dynamo", "graph" or "module-scan"
    graphs: int = 0
    fallback_reason: str | None = None

    def by_fqn(self) -> dict[str, Candidate]:
        return {c.fqn: c for c in self.candidates}


def classify_use(node: fx.Node, weight: fx.Node) -> UseKind:
    """How ``node`` reads the parameter ``weight`` (a placeholder or get_attr node)."""
    target, args = node.target, node.args
    if node.op == "call_method":
        if target in ("matmul", "mm", "__matmul__") and len(args) == 2 and args[1] is weight and args[0] is not weight:
            return UseKind.MATMUL
        return UseKind.OTHER
    if node.op != "call_function":
        return UseKind.OTHER
    if target in _LINEAR_TARGETS:
        w = args[1] if len(args) > 1 else node.kwargs.get("weight")
        others = list(args[:1]) + list(args[2:]) + list(node.kwargs.values())
        return UseKind.LINEAR if w is weight and weight not in others else UseKind.OTHER
    if target in _MATMUL_TARGETS:
        return UseKind.MATMUL if len(args) == 2 and args[1] is weight and args[0] is not weight else UseKind.OTHER
    if target in _ADDMM_TARGETS:
        plain = not node.kwargs or all(node.kwargs.get(k, 1) == 1 for k in ("beta", "alpha"))
        ok = len(args) == 3 and args[2] is weight and weight not in args[:2] and plain
        return UseKind.MATMUL if ok else UseKind.OTHER
    if target is F.embedding:
        w = args[1] if len(args) > 1 else node.kwargs.get("weight")
        return UseKind.EMBEDDING if w is weight and args[0] is not weight else UseKind.OTHER
    if target in _EMBEDDING_WEIGHT_FIRST:
        return UseKind.EMBEDDING if args[0] is weight and weight not in args[1:] else UseKind.OTHER
    return UseKind.OTHER


def static_tokens(x: fx.Node, features: int) -> int | float:
    """Tokens (rows of ``features`` each) reaching an op through ``x`` when the graph records concrete sizes
    (Dynamo's ``example_value``, or ``val`` from export / make_fx), else infinity.

    A rewritten graph holds one contraction plan and no guard can be added here: without concrete sizes
    (symbolic_trace, dynamic shapes) the planner's large-batch plan is taken, the regime training runs in and where
    the order matters most.
    """
    value = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else None
    shape = getattr(value, "shape", None)
    if shape is None or not all(isinstance(s, int) for s in shape):
        return math.inf
    return math.prod(shape) // features


def collect_uses(
    graph: fx.Graph,
    param_of: Callable[[fx.Node], str | None],
    params: dict[str, tuple[nn.Parameter, tuple[str, ...]]],
    into: dict[str, Candidate],
    module_of: Callable[[fx.Node], str | None] = lambda node: None,
) -> None:
    """Add the uses of every parameter node of ``graph`` (those ``param_of`` maps to an FQN) to ``into``;
    ``module_of(op node)`` names the module whose forward ran each use, where known."""
    for node in graph.nodes:
        fqn = param_of(node)
        if fqn is None or fqn not in params:
            continue
        param, aliases = params[fqn]
        if param.dim() != 2:
            continue
        cand = into.setdefault(fqn, Candidate(fqn, aliases, tuple(param.shape), param.dtype))
        for user in node.users:
            cand.uses.append(Use(classify_use(user, node), user.name, _target_name(user), module_of(user)))


def _target_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def parameter_table(model: nn.Module) -> dict[str, tuple[nn.Parameter, tuple[str, ...]]]:
    """Canonical FQN -> (parameter, every FQN that holds it). The canonical name is the first in module order."""
    first: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return {first[k]: (params[k], tuple(aliases[k])) for k in first}


def capture_graphs(model: nn.Module, example_inputs) -> list[tuple[fx.GraphModule, list]]:
    """Run the model once under Dynamo with a backend that records each graph and its real example inputs.

    Dynamo, unlike ``torch.export(strict=False)``, captures ``transformers`` causal LMs (their output holds a
    DynamicCache); a graph break just yields several graphs. Parameters arrive as placeholders whose example
    inputs are the parameter objects themselves, which maps them back to FQNs without parsing source names.
    The model's buffers, the global RNG state and Dynamo's caches are left as they were (``isolation.untraced``).
    """
    graphs: list[tuple[fx.GraphModule, list]] = []

    def record(gm: fx.GraphModule, inputs):
        graphs.append((gm, list(inputs)))
        return gm.forward

    args, kwargs = split_example_inputs(example_inputs)
    # untraced: the forward must not move BatchNorm statistics, the RNG or the user's Dynamo caches.
    with untraced(model) as compile_model, torch._dynamo.config.patch(**_CAPTURE_DYNAMO_CONFIG), torch.no_grad():
        compile_model(record, dynamic=False)(*args, **kwargs)
    return graphs


# Every capture uses a new backend, so each one compiles the model's frames afresh. Past Dynamo's recompile limit
# (8 per frame) a frame silently runs eagerly and nothing is recorded: the 9th model of one class would appear to
# have no candidates. Lift the limits while capturing, and make a limit that is still hit an error (-> fallback).
_CAPTURE_DYNAMO_CONFIG = dict(
    recompile_limit=2**20, accumulated_recompile_limit=2**20, fail_on_recompile_limit_hit=True
)


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    """(args, kwargs) from example inputs given as a tensor, a tuple/list of positional inputs or a kwargs mapping
    (a dict, or a tokenizer's ``BatchEncoding``, which is a Mapping but not a dict)."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def find_in_model(model: nn.Module, example_inputs=None) -> FindResult:
    """List the parameters read by linear-like / embedding ops of ``model``.

    With ``example_inputs`` (a tensor, a tuple of positional inputs or a dict of keyword inputs) the model is
    captured with Dynamo; without them, or when Dynamo fails on a model that runs eagerly, the modules are scanned
    by type (nn.Linear, nn.Embedding, transformers' Conv1D) and the result says so. Inputs the model itself
    rejects raise ``ValueError``: a scan would hide the mistake.
    """
    params = parameter_table(model)
    if example_inputs is None:
        return _module_scan(model, params, "no example_inputs were given")
    try:
        graphs = capture_graphs(model, example_inputs)
    except Exception as exc:  # capture is best effort; the scan below still finds the common layers
        check_model_accepts(model, example_inputs, exc)
        reason = f"graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return _fallback_scan(model, params, reason)
    if not graphs:  # Dynamo gave up on every frame and ran the model eagerly: the graphs saw nothing
        return _fallback_scan(model, params, "graph capture recorded no graph (Dynamo ran the model eagerly)")
    fqn_of_id = {id(p): fqn for fqn, (p, _) in params.items()}
    path_of_id = {str(id(m)): path for path, m in reversed(list(model.named_modules(remove_duplicate=False)))}
    found: dict[str, Candidate] = {}
    for gm, inputs in graphs:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = {node: fqn_of_id.get(id(value)) for node, value in zip(placeholders, inputs)}
        collect_uses(gm.graph, names.get, params, found, lambda node: _running_module(node, path_of_id))
    return FindResult(_in_model_order(found, params), "dynamo", graphs=len(graphs))


def check_model_accepts(model: nn.Module, example_inputs, capture_error: Exception) -> None:
    """After a failed capture, run ``model`` eagerly on ``example_inputs`` (buffers and RNG restored, no grad):
    if it fails there too, the inputs are wrong, and a ValueError says so with the model's own error; if it runs,
    the capture was Dynamo's problem and the caller falls back to a module scan."""
    args, kwargs = split_example_inputs(example_inputs)
    try:
        with untraced(model), torch.no_grad():
            model(*args, **kwargs)
    except Exception as eager_error:
        raise ValueError(
            f"comera_fx: graph capture failed with the given example_inputs, and model(*example_inputs) fails "
            f"eagerly too: {type(eager_error).__name__}: {eager_error}. Pass example_inputs the model accepts "
            f"(shapes and dtypes of a real batch), or leave example_inputs out to scan module types only"
        ) from capture_error
    return None


def _running_module(node: fx.Node, path_of_id: Mapping[str, str]) -> str | None:
    """The path of the innermost module whose forward ran ``node``: Dynamo's ``nn_module_stack`` is keyed by
    ``str(id(module))``, outermost first. None when the graph does not say."""
    for key in reversed(list(node.meta.get("nn_module_stack") or ())):
        path = path_of_id.get(key)
        if path is not None:
            return path
    return None


def find_in_graph(gm: fx.GraphModule) -> FindResult:
    """List the parameters of a GraphModule (read through ``get_attr``) that linear-like / embedding ops use."""
    params = parameter_table(gm)
    alias_to_fqn = {alias: fqn for fqn, (_, aliases) in params.items() for alias in aliases}

    def param_of(node: fx.Node) -> str | None:
        return alias_to_fqn.get(node.target) if node.op == "get_attr" else None

    found: dict[str, Candidate] = {}
    collect_uses(gm.graph, param_of, params, found)
    return FindResult(_in_model_order(found, params), "graph", graphs=1)


def _in_model_order(found: dict[str, Candidate], params) -> list[Candidate]:
    return [found[fqn] for fqn in params if fqn in found]


def _fallback_scan(model: nn.Module, params, reason: str) -> FindResult:
    warnings.warn(f"comera_fx: {reason}; falling back to a module-type scan", stacklevel=4)
    return _module_scan(model, params, reason)


def _module_scan(model: nn.Module, params, reason: str) -> FindResult:
    found: dict[str, Candidate] = {}
    for name, module in model.named_modules():
        kind = _scan_kind(module)
        weight = getattr(module, "weight", None) if kind is not None else None
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        fqn = next(f for f, (p, _) in params.items() if p is weight)
        cand = found.setdefault(fqn, Candidate(fqn, params[fqn][1], tuple(weight.shape), weight.dtype))
        cand.uses.append(Use(kind, name or "<root>", type(module).__name__))
    return FindResult(_in_model_order(found, params), "module-scan", fallback_reason=reason)


def _scan_kind(module: nn.Module) -> UseKind | None:
    if isinstance(module, nn.Linear):
        return UseKind.LINEAR
    if isinstance(module, nn.Embedding):
        return UseKind.EMBEDDING
    if is_hf_conv1d(module):
        return UseKind.MATMUL  # GPT-2's Conv1D: y = x W + b with W stored (in × out)
    return None


def find(model: nn.Module, example_inputs=None, config: TensorizeConfig | None = None) -> FindResult:
    """Public finder: candidates of a model (or of a GraphModule's get_attr parameters when no inputs are given)."""
    if isinstance(model, fx.GraphModule) and example_inputs is None:
        return find_in_graph(model)
    return find_in_model(model, example_inputs)


def large_candidates(result: FindResult, config: TensorizeConfig) -> Iterable[Candidate]:
    return (c for c in result.candidates if config.is_large(c.shape))
