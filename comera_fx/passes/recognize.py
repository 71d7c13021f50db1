"""Recognise "linear of a reconstructed TT weight" in a captured graph and contract x with the cores instead.

``tensorize_`` gives a module that reads a converted parameter in its own code (``F.linear(x, self.w)``) a
property that rebuilds the dense weight from the TT cores: correct everywhere, but it builds the full matrix and
runs a dense GEMM. Under a compiler that is wasted work, so this pass finds every linear-like op whose weight
operand is computed from the cores and gates of one registered ``TTMatrix`` alone, checks numerically what that
computation is (M or Mᵀ — anything else is left alone), and replaces the op by the planned pairwise contraction
of x with the gated cores. The dense reconstruction then has no users and is removed.

The check is not a pattern match on the ops the property happens to emit: the weight's subgraph is evaluated on
random float64 cores and compared with ``ops.to_dense`` — a polynomial identity checked at a random point — so a
parametrisation that scales, masks or otherwise changes the weight is never mistaken for M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, fx

from ..tt import ops
from ..tt import plan as planner
from ..tt.layers import TTMatrix
from ..tt.plan_cache import choose_plan, planned_envelope
from .find import UseKind, classify_use, static_tokens
from .holders import PROPERTY_MATRICES
from .emit import emit_traced

aten = torch.ops.aten


@dataclass(frozen=True)
class _Owner:
    tt: TTMatrix
    role: str  # "core" or "gate"
    index: int


def _owners(matrices) -> dict[int, _Owner]:
    table = {}
    for tt in matrices:
        for k, core in enumerate(tt.cores):
            table[id(core)] = _Owner(tt, "core", k)
        for k, gate in enumerate(tt.gates):
            table[id(gate)] = _Owner(tt, "gate", k)
    return table


def node_values(gm: fx.GraphModule, example_inputs=None) -> dict[fx.Node, Tensor]:
    """The real tensor behind each placeholder / get_attr node, where known.

    Dynamo lifts parameters to placeholders and passes the parameter objects as example inputs (also kept in the
    node's ``grapharg``); symbolic_trace / export graphs read them with ``get_attr``.
    """
    values: dict[fx.Node, Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = list(example_inputs) if example_inputs is not None else [None] * len(placeholders)
    for node, value in zip(placeholders, inputs):
        if not isinstance(value, Tensor):
            grapharg = node.meta.get("grapharg")
            value = getattr(grapharg, "example", None) if grapharg is not None else None
        if isinstance(value, Tensor):
            values[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = gm.get_parameter(node.target)
            except AttributeError:
                continue
            values[node] = value
    return values


def _weight_operand(node: fx.Node) -> tuple[fx.Node | None, UseKind]:
    """The node a linear-like op reads as its weight, and how (LINEAR: x Wᵀ, MATMUL: x W)."""
    args = node.args
    if node.op == "call_function" and node.target in (torch.addmm, aten.addmm.default):
        candidate = args[2] if len(args) == 3 else None
    elif node.op == "call_function" and node.target in (
        torch._C._nn.linear,
        torch.nn.functional.linear,
        aten.linear.default,
    ):
        candidate = args[1] if len(args) > 1 else node.kwargs.get("weight")
    elif len(args) == 2:  # mm / matmul / @ / Tensor.matmul
        candidate = args[1]
    else:
        candidate = None
    if not isinstance(candidate, fx.Node):
        return None, UseKind.OTHER
    kind = classify_use(node, candidate)
    return (candidate, kind) if kind in (UseKind.LINEAR, UseKind.MATMUL) else (None, UseKind.OTHER)


def _closure(weight: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(leaves, nodes in topological order) of the subgraph computing ``weight``; None if it has side effects."""
    seen, leaves, stack = set(), [], [weight]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr"):
            leaves.append(node)
            continue
        if node.op not in ("call_function", "call_method") or node.is_impure():
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(weight.graph.nodes)}
    return leaves, sorted(seen, key=order.__getitem__)


def _evaluate(nodes: list[fx.Node], output: fx.Node, env: dict[fx.Node, Tensor]) -> Tensor:
    """Run the subgraph ``nodes`` on the leaf values in ``env`` (a tiny interpreter over a copied graph)."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    leaves = [n for n in nodes if n in env]
    for leaf in leaves:
        mapping[leaf] = graph.placeholder(leaf.name)
    for node in nodes:
        if node not in mapping:
            mapping[node] = graph.node_copy(node, mapping.__getitem__)
    graph.output(mapping[output])
    return fx.GraphModule(torch.nn.Module(), graph)(*[env[leaf] for leaf in leaves])


def _identify(nodes, weight: fx.Node, leaves: list[fx.Node], owners: dict[fx.Node, _Owner]) -> str | None:
    """'M' or 'MT' if the subgraph computes the gated TT matrix or its transpose on random cores; else None."""
    tt = owners[leaves[0]].tt
    layout = tt.layout
    generator = torch.Generator().manual_seed(0)
    cores = [torch.randn(c.shape, generator=generator, dtype=torch.float64) for c in tt.cores]
    gates = [torch.rand(g.shape, generator=generator, dtype=torch.float64) + 0.5 for g in tt.gates]
    env = {leaf: (cores if owners[leaf].role == "core" else gates)[owners[leaf].index] for leaf in leaves}
    try:
        with torch.no_grad():
            value = _evaluate(nodes, weight, env)
    except Exception:  # an op that does not run on plain float64 CPU tensors: not ours, leave it alone
        return None
    expected = ops.to_dense(ops.gate_cores(cores, gates, layout), layout)
    if not isinstance(value, Tensor) or value.dtype != torch.float64:
        return None
    if value.shape == expected.shape and torch.allclose(value, expected, rtol=1e-9, atol=1e-12):
        return "M"
    if value.shape == expected.t().shape and torch.allclose(value, expected.t(), rtol=1e-9, atol=1e-12):
        return "MT"
    return None


def contract_reconstructed_tt(gm: fx.GraphModule, example_inputs=None, *, matrices=None) -> fx.GraphModule:
    """Graph pass: replace ``linear/mm/matmul/addmm(x, W)`` with W rebuilt from TT cores by planned contractions.

    ``matrices``: the ``TTMatrix`` objects to look for (default: those ``tensorize_`` gave a reconstructing
    property). The number of ops rewritten is left in ``gm.meta["comera_fx_reconstructed"]``.
    """
    values = node_values(gm, example_inputs)
    by_id = _owners(PROPERTY_MATRICES if matrices is None else matrices)
    owners = {node: by_id[id(v)] for node, v in values.items() if id(v) in by_id}
    rewritten = 0
    if owners:
        for node in list(gm.graph.nodes):
            weight, kind = _weight_operand(node)
            if weight is None or weight in owners:
                continue
            found = _closure(weight)
            if found is None:
                continue
            leaves, nodes = found
            if not leaves or any(leaf not in owners for leaf in leaves):
                continue
            tt = owners[leaves[0]].tt
            if any(owners[leaf].tt is not tt for leaf in leaves):
                continue
            what = _identify(nodes, weight, leaves, owners)
            if what is None:
                continue
            _replace_with_contraction(gm.graph, node, kind, what, tt, leaves, owners)
            rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    gm.meta["comera_fx_reconstructed"] = rewritten
    return gm


def _replace_with_contraction(
    graph: fx.Graph,
    node: fx.Node,
    kind: UseKind,
    what: str,
    tt: TTMatrix,
    leaves: list[fx.Node],
    owners: dict[fx.Node, _Owner],
) -> None:
    layout = tt.layout
    by_role = {(owners[leaf].role, owners[leaf].index): leaf for leaf in leaves}
    cores = [by_role[("core", k)] for k in range(layout.n_cores)]
    gates = [by_role[("gate", k)] for k in range(layout.n_cores - 1)]
    is_addmm = node.target in (torch.addmm, aten.addmm.default)
    x = node.args[1] if is_addmm else node.args[0]
    # linear: x Wᵀ; matmul: x W. With W = M that is x Mᵀ / x M; with W = Mᵀ the other way round.
    op = "matmul_t" if (kind is UseKind.LINEAR) == (what == "M") else "matmul"
    envelope = planned_envelope(layout, op, device=tt.device)
    chosen = choose_plan(envelope, static_tokens(x, layout.rows if op == "matmul" else layout.cols))
    with graph.inserting_before(node):
        gated = emit_traced(graph, lambda c, g: ops.gate_cores(c, g, layout), cores, gates)
        out = emit_traced(graph, lambda a, c: planner.execute(chosen, a, c, layout), x, gated)
        bias = None
        if is_addmm:
            bias = node.args[0]
        elif kind is UseKind.LINEAR:
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None:
            out = graph.call_function(torch.add, (out, bias))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
