"""``tensorize(gm, config)``: the graph-level entry point of the TT rewrite, a ``GraphModule -> GraphModule`` pass for
custom compilers. It registers the cores and gates on the GraphModule and replaces each large linear-like /
embedding op by the explicit TT contraction subgraph; which layers and at what ranks is decided exactly as for the
in-place ``tensorize_`` (``passes.tensorize``: ``skip_reason``, ``plan_layers``, ``build_or_skip``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..checks import check_config_type
from ..config import TensorizeConfig
from ..tt import ops
from ..tt import plan as planner
from ..tt.layers import TTEmbedding
from ..tt.plan_cache import choose_plan, planned_envelope
from .emit import emit_traced
from .find import UseKind, find_in_graph, static_tokens
from .graph_experts import tensorize_experts
from .layer_plan import LayerInput, plan_layers
from .tensorize import (
    LayerDecision,
    TensorizeSummary,
    _is_plain,
    _owner,
    _tt_matrix_of,
    build_or_skip,
    skip_reason,
    stores_transpose,
)


def _normalize_modules(gm: fx.GraphModule) -> None:
    """Turn ``call_module`` on plain nn.Linear / nn.Embedding (symbolic_trace leaves them) into functional calls
    on ``get_attr`` weights, so one rewrite handles every graph flavour."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if _is_plain(module, nn.Linear):
            with gm.graph.inserting_before(node):
                w = gm.graph.get_attr(f"{node.target}.weight")
                b = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
                new = gm.graph.call_function(F.linear, (node.args[0], w, b))
        elif _is_plain(module, nn.Embedding) and TTEmbedding.check_supported(module) is None:
            with gm.graph.inserting_before(node):
                w = gm.graph.get_attr(f"{node.target}.weight")
                new = gm.graph.call_function(F.embedding, (node.args[0], w, module.padding_idx))
        else:
            continue
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


def _embedding_padding_idx(node: fx.Node) -> int | None:
    if node.target is F.embedding:
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx")
        other = list(node.args[3:]) + [node.kwargs.get(k) for k in ("max_norm", "scale_grad_by_freq", "sparse")]
    else:  # torch.embedding / aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq, sparse)
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        pad = None if pad == -1 else pad
        other = list(node.args[3:])
    if any(o not in (None, False, 2.0) for o in other):
        raise ValueError(f"{node.name}: max_norm / scale_grad_by_freq / sparse embeddings cannot be tensorized")
    return pad


def tensorize(gm: fx.GraphModule, config: TensorizeConfig | None = None) -> fx.GraphModule:
    """Graph pass: replace every large linear-like / embedding op on a ``get_attr`` parameter by TT contractions.

    Works on GraphModules from ``symbolic_trace``, ``torch.export(...).module()`` or ``make_fx``. The cores and
    gates are registered on ``gm`` (submodule ``comera_tt_<param>``), the ops become explicit reshape / mm / bmm
    nodes, unused dense parameters are deleted, and the graph is linted and recompiled. The summary of what was
    converted is left in ``gm.meta["comera_fx"]``.
    """
    check_config_type("passes.tensorize(gm, config)", config, TensorizeConfig, "TensorizeConfig(max_rank=32)")
    config = config or TensorizeConfig()
    if config.size_target is not None:
        raise ValueError(
            "TensorizeConfig.size_target is supported by tensorize_ (in place), not yet by the graph "
            "pass tensorize(gm, ...); use tensorize_, or max_rank / rank_ratio here"
        )
    _normalize_modules(gm)
    result = find_in_graph(gm)
    decisions, selected = [], []
    for index, cand in enumerate(result.candidates):
        decision = LayerDecision(
            cand.fqn, cand.aliases, cand.kind, cand.shape, tuple(sorted({u.kind.value for u in cand.uses}))
        )
        decisions.append(decision)
        decision.reason = skip_reason(cand, config)
        if decision.reason is None:
            selected.append((cand, decision, index))
    layers = [
        LayerInput(cand.fqn, cand.kind, stores_transpose(cand), _tt_matrix_of(gm.get_parameter(cand.fqn), cand), index)
        for cand, _, index in selected
    ]
    plans = plan_layers(layers, config).plans
    built = []
    for cand, decision, _ in selected:
        made = build_or_skip(gm.get_parameter(cand.fqn), cand, decision, plans[cand.fqn])
        if made is not None:
            built.append((cand, decision, *made))

    graph = gm.graph
    nodes_by_name = {n.name: n for n in graph.nodes}
    for cand, decision, tt, notes in built:
        module_name = "comera_tt_" + cand.fqn.replace(".", "_")
        gm.add_submodule(module_name, tt)
        layout = tt.layout
        use_nodes = [nodes_by_name[use.node] for use in cand.uses]
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_before(min(use_nodes, key=order.__getitem__)):
            # Gates are folded into the cores once, shared by every use (a tied embedding and head).
            cores = [graph.get_attr(f"{module_name}.cores.{k}") for k in range(layout.n_cores)]
            gates = [graph.get_attr(f"{module_name}.gates.{k}") for k in range(layout.n_cores - 1)]
            gated = emit_traced(graph, lambda c, g: ops.gate_cores(c, g, layout), cores, gates)
        for use, node in zip(cand.uses, use_nodes):
            if use.kind is UseKind.OTHER:  # TensorizeConfig.weight_space: the op reads the rebuilt weight
                _feed_rebuilt(graph, node, cand, gated, layout)
                continue
            with graph.inserting_before(node):
                new = _emit_use(gm, graph, node, use.kind, gated, layout, module_name, cand)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        decision.converted = True
        decision.notes.extend(notes)
        decision.ranks, decision.params = tt.ranks, layout.num_params
    _delete_converted_parameters(gm, {alias for cand, *_ in built for alias in cand.aliases})
    decisions += tensorize_experts(gm, config, lambda fqn, shape: LayerDecision(fqn, (fqn,), "experts", shape, ()))
    graph.lint()
    gm.recompile()
    gm.meta["comera_fx"] = TensorizeSummary(decisions, result.method)
    return gm


def _feed_rebuilt(graph, node, cand, cores, layout) -> None:
    """Give an op with no TT rule the weight rebuilt from the gated ``cores`` (P = M, or Mᵀ) in place of P."""
    with graph.inserting_before(node):
        dense = emit_traced(graph, lambda c: ops.to_dense(c, layout), cores)
        dense = graph.call_method("t", (dense,)) if stores_transpose(cand) else dense
    for arg in list(node.all_input_nodes):
        if arg.op == "get_attr" and arg.target in cand.aliases:
            node.replace_input_with(arg, dense)


def _emit_use(gm, graph, node, kind, cores, layout, module_name, cand):
    """Emit the TT contraction replacing one op, reading the gated ``cores`` nodes."""
    if kind is UseKind.EMBEDDING:
        weight_first = node.target is not F.embedding
        index = node.args[1] if weight_first else node.args[0]
        out = emit_traced(graph, lambda i, c: ops.take_rows(i, c, layout), index, cores)
        pad = _embedding_padding_idx(node)
        if pad is not None:
            pad = pad + layout.rows if pad < 0 else pad
            row_name = f"{module_name}_padding_row_{pad}"
            if not hasattr(gm, row_name):
                gm.register_buffer(row_name, gm.get_parameter(cand.fqn).detach()[pad].clone())
            row = graph.get_attr(row_name)
            out = emit_traced(graph, lambda i, o, r: torch.where((i == pad)[..., None], r, o), index, out, row)
        return out
    x = (
        node.args[1]
        if kind is UseKind.MATMUL and node.target in (torch.addmm, torch.ops.aten.addmm.default)
        else node.args[0]
    )
    # LINEAR computes x Pᵀ and MATMUL x P; M is Pᵀ or P (stores_transpose). When they differ, contract with Mᵀ:
    # a tied head on an embedding's M = P, or a square P read both by linear and by matmul.
    op = "matmul_t" if (kind is UseKind.LINEAR) != stores_transpose(cand) else "matmul"
    envelope = planned_envelope(layout, op, device=gm.get_submodule(module_name).device)
    chosen = choose_plan(envelope, static_tokens(x, layout.rows if op == "matmul" else layout.cols))
    out = emit_traced(graph, lambda a, c: planner.execute(chosen, a, c, layout), x, cores)
    bias = None
    if kind is UseKind.LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    elif node.target in (torch.addmm, torch.ops.aten.addmm.default):
        bias = node.args[0]
    if bias is not None:
        out = graph.call_function(torch.add, (out, bias))
    return out


def _delete_converted_parameters(gm: fx.GraphModule, converted: set[str]) -> None:
    """Erase the ``get_attr`` nodes of converted weights and delete those dense parameters from ``gm``."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in converted and not node.users:
            gm.graph.erase_node(node)
    for name in converted:
        owner, _, attr = _owner(gm, name)
        del owner._parameters[attr]
