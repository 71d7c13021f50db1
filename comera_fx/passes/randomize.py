"""Randomized backward (RMM) for large linear layers: the model-level transform and the graph passes.

* ``randomize_backward_(model, rho, sketch, ...)`` swaps the classes of the model's large nn.Linear, transformers
  Conv1D and TTLinear modules for randomized ones (``comera_fx.rmm.modules``), in place; with ``example_inputs``
  also of the modules whose own forward reads a large raw parameter with F.linear / addmm / matmul
  (``comera_fx.rmm.uses``). ``restore_backward_`` undoes it. Parameters, buffers, hooks and state_dict keys are
  untouched.
* ``randomize_backward(gm, ...)``: GraphModule -> GraphModule. Every linear-like op (linear, addmm, mm / matmul /
  @) whose weight is a large trainable parameter runs through ``rmm``'s op; the ops reading one input share one
  sketch node. This is what ``BackendConfig(rmm=...)`` runs on Dynamo's graph.
* ``share_sketches(gm)``: merges the sketches Dynamo traced separately from randomized modules reading the same
  tensor (Q, K and V), so a compiled model keeps one sketch per input like the eager one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..moe.rmm import randomize_banks, restore_banks
from ..rmm.functions import RandomizedLinearFunction, prepare_rmm_plans, shared_sketch
from ..rmm.modules import RMMConfig, randomize_module, restore_module, supported_kind
from ..rmm.recompute import Selector, checkpoint_modules, restore_checkpointed
from ..rmm.sketch import check_sketch, projected_rows, rho_ratio
from ..rmm.uses import randomize_uses, restore_uses
from .find import Candidate, UseKind, classify_use, find
from .recognize import node_values

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class RMMDecision:
    fqn: str
    kind: str
    shape: tuple[int, ...]
    randomized: bool
    reason: str | None = None


@dataclass
class RandomizeSummary:
    """Returned by ``randomize_backward_``: every linear-like layer seen, randomized or not (and why)."""

    config: RMMConfig
    layers: list[RMMDecision] = field(default_factory=list)
    method: str = "module-scan"
    checkpointed: list[str] = field(default_factory=list)

    @property
    def randomized(self) -> list[RMMDecision]:
        return [d for d in self.layers if d.randomized]

    @property
    def skipped(self) -> list[RMMDecision]:
        return [d for d in self.layers if not d.randomized]

    def __str__(self) -> str:
        lines = [
            f"comera_fx.randomize_backward_ ({self.config.describe()}): {len(self.randomized)} of "
            f"{len(self.layers)} linear-like layers randomized (found by {self.method})"
        ]
        for d in self.layers:
            what = "randomized" if d.randomized else f"exact     : {d.reason}"
            lines.append(f"  {d.fqn or '<root>'} [{d.kind} {d.shape}] {what}")
        if self.checkpointed:
            blocks = ", ".join(f or "<root>" for f in self.checkpointed)
            lines.append(f"  recomputed in backward (torch.utils.checkpoint): {blocks}")
        return "\n".join(lines)


def _weight_shape(module: nn.Module, kind: str) -> tuple[int, int]:
    if kind == "tt_linear":
        return (module.out_features, module.in_features)
    weight = module.weight
    return tuple(weight.shape) if kind == "linear" else (weight.shape[1], weight.shape[0])


def _trainable(module: nn.Module, kind: str) -> bool:
    if kind == "tt_linear":
        return any(p.requires_grad for p in module.tt.parameters())
    return module.weight.requires_grad


def randomize_backward_(
    model: nn.Module,
    rho: float = 0.25,
    sketch: str = "gaussian",
    example_inputs=None,
    filter_fn: FilterFn | None = None,
    min_numel: int = 65536,
    checkpoint: Selector | None = None,
) -> RandomizeSummary:
    """Give the large linear layers of ``model`` a randomized backward, in place.

    Forward outputs stay exact. In training mode with grad enabled each randomized layer keeps, for backward, a
    sketch of ρ of its input's tokens (B_proj = max(1, ⌊ρ·B⌋) rows, B = all leading dims) instead of the input;
    dX and the bias gradient stay exact and the weight (or TT core) gradient is an unbiased estimate. Layers that
    read the same tensor share one sketch. Eval mode and ``torch.no_grad()`` run the original forward.

    Args:
        rho: fraction of tokens the sketch keeps, in (0, 1].
        sketch: "gaussian" (default), "rademacher" or "srht" (subsampled randomized Hadamard: far cheaper to apply).
        example_inputs: capture the model with Dynamo and randomize only the layers its graph runs, and also a
            large raw parameter that the model's own code reads with F.linear / addmm / matmul (its weight
            operand): the module whose forward runs those ops gets a forward that sends exactly them to
            ``rmm_linear`` (``comera_fx.rmm.uses``), while the model is called as a whole or that module is.
            Without them, a module scan.
        filter_fn: ``filter_fn(module, fqn) -> bool``; False keeps that layer exact. For a raw parameter: the
            module holding it and the parameter's FQN.
        min_numel: layers whose weight has fewer entries stay exact.
        checkpoint: blocks to recompute in backward (``torch.utils.checkpoint``, non-reentrant): a module class, a
            tuple of classes or ``fn(module, fqn) -> bool`` — e.g. the model's transformer layer class. Then only
            the blocks' inputs stay alive between forward and backward; randomized layers inside redraw the
            same sketch when recomputed.
    Returns a ``RandomizeSummary``; ``comera_fx.report(model)`` lists ρ per layer; ``restore_backward_`` undoes it.
    """
    config = RMMConfig(rho=rho, sketch=sketch, min_numel=min_numel)
    summary = RandomizeSummary(config)
    seen_in_graph: set[int] | None = None
    holders = {
        id(m.weight)
        for m in model.modules()
        if supported_kind(m) in ("linear", "conv1d") and isinstance(getattr(m, "weight", None), nn.Parameter)
    }
    functional: dict[str, list[str]] = {}  # module path -> the parameters (paths below it) its forward reads
    if example_inputs is not None:
        found = find(model, example_inputs)
        summary.method = found.method
        if found.method == "dynamo":
            params = dict(model.named_parameters(remove_duplicate=False))
            seen_in_graph = set()
            for cand in found.candidates:
                param = params[cand.fqn]
                if any(u.kind in (UseKind.LINEAR, UseKind.MATMUL) for u in cand.uses):
                    seen_in_graph.add(id(param))
                    if id(param) not in holders:
                        decision = _functional_decision(model, cand, param, min_numel, filter_fn)
                        summary.layers.append(decision)
                        if decision.randomized:
                            for path, name in _readers(cand):
                                functional.setdefault(path, []).append(name)
    for path, names in functional.items():
        randomize_uses(model.get_submodule(path), names, config)
    for fqn, module in model.named_modules():
        kind = supported_kind(module)
        if kind is None:
            continue
        shape = _weight_shape(module, kind)
        reason = None
        if seen_in_graph is not None and kind != "tt_linear" and id(module.weight) not in seen_in_graph:
            reason = "not run by the captured forward"
        elif shape[0] * shape[1] < min_numel:
            reason = f"{shape[0] * shape[1]:,} weight entries < min_numel={min_numel:,}"
        elif not _trainable(module, kind):
            reason = "frozen weight: its backward keeps no input for a weight gradient anyway"
        elif filter_fn is not None and not filter_fn(module, fqn):
            reason = "filter_fn rejected it"
        summary.layers.append(RMMDecision(fqn, kind, shape, reason is None, reason))
        if reason is None:
            randomize_module(module, config)
            if kind == "tt_linear" and not module.tt.is_zero:
                prepare_rmm_plans(module.tt)  # a compiled model reads plans, it does not make them
    summary.layers.extend(randomize_banks(model, config, filter_fn, RMMDecision))  # MoE: each expert's products
    if checkpoint is not None:
        summary.checkpointed = checkpoint_modules(model, checkpoint)
    return summary


def _functional_decision(
    model: nn.Module, cand: Candidate, param: nn.Parameter, min_numel: int, filter_fn: FilterFn | None
) -> RMMDecision:
    """Whether a raw parameter read by the model's own linear-like ops gets a randomized backward, and why not."""
    shape = tuple(param.shape)
    reason = None
    if param.numel() < min_numel:
        reason = f"{param.numel():,} weight entries < min_numel={min_numel:,}"
    elif any(u.kind is UseKind.EMBEDDING for u in cand.uses):
        reason = "also gathered as an embedding table (a tied weight): its linear uses stay exact"
    elif not param.requires_grad:
        reason = "frozen weight: its backward keeps no input for a weight gradient anyway"
    elif filter_fn is not None and not filter_fn(model.get_submodule(cand.fqn.rpartition(".")[0]), cand.fqn):
        reason = "filter_fn rejected it"
    return RMMDecision(cand.fqn, "functional", shape, reason is None, reason)


def _readers(cand: Candidate) -> list[tuple[str, str]]:
    """(module path, parameter path below it) for each module whose forward runs a linear-like use of ``cand``:
    Dynamo's module stack says which; the root (which runs everything when the model is called) where it does
    not, or where the parameter is not below that module under any of its names."""
    found = {}
    for use in cand.uses:
        if use.kind not in (UseKind.LINEAR, UseKind.MATMUL):
            continue
        path = use.module if use.module is not None else ""
        prefix = f"{path}." if path else ""
        name = next((a[len(prefix) :] for a in (cand.fqn, *cand.aliases) if a.startswith(prefix)), None)
        if name is None:
            path, name = "", cand.fqn
        found[(path, name)] = None
    return list(found)


def restore_backward_(model: nn.Module) -> int:
    """Give every randomized layer of ``model`` its exact backward again and end the recomputation of
    checkpointed blocks; returns how many modules were restored."""
    count = restore_checkpointed(model) + restore_banks(model)
    return count + sum(restore_module(module) or restore_uses(module) for module in model.modules())


# -- graph level ----------------------------------------------------------------------------------------------------


def graph_sketch(x, features: int, rho_num: int, rho_den: int, kind: str):
    """(S·x, seed) for the linears of a rewritten graph reading ``x``; None without grad (nothing to keep)."""
    if not torch.is_grad_enabled():
        return None
    x2d = x.reshape(-1, features)
    return shared_sketch(x2d, projected_rows(x2d.shape[0], (rho_num, rho_den)), kind)  # no user: a fresh draw


def graph_linear(x, weight, bias, sketched, kind: str, weight_is_in_by_out: bool):
    """linear / addmm / mm of a rewritten graph: the randomized op when ``sketched`` holds (S·x, seed)."""
    w = weight.t() if weight_is_in_by_out else weight
    if sketched is None or not weight.requires_grad:
        return F.linear(x, w, bias)
    x_sketch, seed = sketched
    return RandomizedLinearFunction.apply(x, w, bias, x_sketch, seed, kind)


def _linear_operands(node: fx.Node, kind: UseKind):
    """(x, bias, weight stored in × out) of a linear-like node classified as ``kind``."""
    if kind is UseKind.LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], bias, False
    if node.target in (torch.addmm, torch.ops.aten.addmm.default):
        return node.args[1], node.args[0], True
    return node.args[0], None, True


def _large_trainable(value, min_numel: int) -> bool:
    return isinstance(value, nn.Parameter) and value.dim() == 2 and value.requires_grad and value.numel() >= min_numel


def _linear_like(gm: fx.GraphModule, node: fx.Node, values: dict, min_numel: int):
    """(x, bias, weight node, weight stored in × out) if ``node`` is a linear-like op on a large trainable
    parameter; an nn.Linear leaf module (``symbolic_trace`` keeps them as call_module) gets get_attr nodes."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if supported_kind(module) != "linear" or not _large_trainable(module.weight, min_numel) or node.kwargs:
            return None
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
        return node.args[0], bias, weight, False
    if node.op not in ("call_function", "call_method"):
        return None
    for weight in node.all_input_nodes:
        if not _large_trainable(values.get(weight), min_numel):
            continue
        kind = classify_use(node, weight)
        if kind in (UseKind.LINEAR, UseKind.MATMUL):
            x, bias, in_by_out = _linear_operands(node, kind)
            return x, bias, weight, in_by_out
    return None


def randomize_backward(
    gm: fx.GraphModule, rho: float = 0.25, sketch: str = "gaussian", *, min_numel: int = 65536, example_inputs=None
) -> fx.GraphModule:
    """Rewrite every linear-like op of ``gm`` on a large trainable 2-D parameter (get_attr, a placeholder whose
    example input is a parameter as in Dynamo's graphs, or an nn.Linear leaf module) to the randomized-backward
    op; the ops reading one input share one sketch. Forward values are unchanged."""
    rho_num, rho_den = rho_ratio(rho)
    check_sketch(sketch)
    values = node_values(gm, example_inputs)
    graph = gm.graph
    sketches: dict[tuple[fx.Node, int], fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        found = _linear_like(gm, node, values, min_numel)
        if found is None:
            continue
        x, bias, weight, in_by_out = found
        value = values.get(weight) if weight in values else gm.get_parameter(weight.target)
        features = value.shape[0] if in_by_out else value.shape[1]
        key = (x, features)
        if key not in sketches:  # before the first linear reading x: the later ones come after it
            with graph.inserting_before(node):
                sketches[key] = graph.call_function(graph_sketch, (x, features, rho_num, rho_den, sketch))
        with graph.inserting_before(node):
            new = graph.call_function(graph_linear, (x, weight, bias, sketches[key], sketch, in_by_out))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    graph.lint()
    gm.recompile()
    gm.meta["comera_fx_rmm_rewritten"] = rewritten
    return gm


_SKETCH_OPS = (torch.ops.comera_fx.sketch_rows.default, torch.ops.comera_fx.sketch_rows)


def _root(node):
    """The tensor a chain of detach / reshape / view nodes starts from, and the shapes along the way."""
    chain = []
    while (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and (getattr(node.target, "__name__", node.target) in ("detach", "reshape", "view"))
    ):
        chain.append((str(node.target), tuple(_value_key(a) for a in node.args[1:])))
        node = node.args[0]
    return node, tuple(chain)


def _value_key(arg):
    """What an argument stands for: a constant, a symbolic size by its expression (Dynamo gives each module's
    ``x.size(-1)`` its own node), or else the node itself."""
    if isinstance(arg, fx.Node):
        example = arg.meta.get("example_value")
        if isinstance(example, (int, torch.SymInt)):
            return ("size", str(example))
        return ("node", arg)
    if isinstance(arg, (tuple, list)):
        return tuple(_value_key(a) for a in arg)
    return ("const", arg)


def share_sketches(gm: fx.GraphModule) -> fx.GraphModule:
    """One sketch per input tensor: later ``sketch_rows`` calls on the same tensor (through detach / reshape) with
    the same rows and kind reuse the first one and its seed. Leaves graphs without sketches untouched."""
    graph = gm.graph
    first: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SKETCH_OPS:
            continue
        x, seed, rows, kind = node.args
        root, chain = _root(x)
        key = (root, chain, _value_key(rows), kind)
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        kept_seed = kept.args[1]
        node.replace_all_uses_with(kept)
        if isinstance(seed, fx.Node) and seed is not kept_seed:
            seed.replace_all_uses_with(kept_seed)
        graph.erase_node(node)
        merged += 1
    if merged:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    gm.meta["comera_fx_sketches_shared"] = merged
    return gm
