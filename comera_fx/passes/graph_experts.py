"""Expert weights in the graph pass ``tensorize(gm)``: the weight-space form inside a GraphModule.

In a graph from ``symbolic_trace``, ``torch.export(...).module()`` or ``make_fx`` a 3D expert parameter is a
``get_attr`` node feeding whatever the model does with it (``bmm``, an index and ``linear``, ``_grouped_mm``...).
Rather than recognise each of those, the pass keeps them: each expert's TT matrix is registered on ``gm`` (a
``TTExpertBank`` as submodule ``comera_tt_<param>``) and the ``get_attr`` is replaced by the graph that rebuilds
P (E × a × b) from the gated cores (``tt/ops.py``'s ``to_dense``, traced once per expert), so every op reading P
runs unchanged and full rank is exact. A parameter that a convolution reads (a Conv1d weight is 3D too) is not
an expert weight and is left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from ..config import TensorizeConfig
from ..moe.bank import TTExpertBank
from ..tt import ops
from ..tt.layers import TTMatrix
from .emit import emit_traced

_CONVOLUTIONS = {
    torch.conv1d,
    torch.nn.functional.conv1d,
    torch.conv_transpose1d,
    torch.ops.aten.convolution.default,
    torch.ops.aten.conv1d.default,
}


def _expert_parameters(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """{FQN: its get_attr nodes} of the 3D float parameters no convolution reads."""
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            p = gm.get_parameter(node.target)
        except AttributeError:
            continue
        if (
            p.dim() == 3
            and p.dtype.is_floating_point
            and p.shape[0] >= 2
            and not any(user.target in _CONVOLUTIONS for user in node.users)
        ):
            found.setdefault(node.target, []).append(node)
    return found


def tensorize_experts(gm: fx.GraphModule, config: TensorizeConfig, make_decision) -> list:
    """Convert every large 3D expert parameter of ``gm`` (one expert's matrix passes ``config``'s size threshold
    and skip rules) to the weight-space form; returns one decision per parameter found (``make_decision(fqn,
    shape)`` builds it). The dense parameters are deleted from ``gm``."""
    decisions = []
    # TT cores are 3D parameters too: those of comera_fx's own modules (the matrices this pass just built) are not
    # expert banks.
    ours = tuple(f"{name}." for name, module in gm.named_modules() if isinstance(module, (TTMatrix, TTExpertBank)))
    for fqn, nodes in _expert_parameters(gm).items():
        if fqn.startswith(ours):
            continue
        p = gm.get_parameter(fqn)
        decision = make_decision(fqn, tuple(p.shape))
        decisions.append(decision)
        if not config.is_large(tuple(p.shape[1:])):
            decision.reason = (
                f"one expert's matrix {tuple(p.shape[1:])} is below the size threshold (set "
                f"TensorizeConfig.min_numel / min_dim)"
            )
            continue
        if config.is_skipped(fqn):
            decision.reason = "excluded by TensorizeConfig.skip / overrides"
            continue
        settings = config.settings_for(fqn)
        try:
            bank = TTExpertBank.from_dense(p, "matmul", **settings.tt_options("linear"))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"cannot tensorize the experts {fqn} {tuple(p.shape)}: {exc}") from exc
        bank.to(device=p.device, dtype=p.dtype).requires_grad_(p.requires_grad)
        name = "comera_tt_" + fqn.replace(".", "_")
        gm.add_submodule(name, bank)
        graph = gm.graph
        with graph.inserting_before(nodes[0]):
            rebuilt = _emit_rebuild(graph, name, bank)
        for node in nodes:
            node.replace_all_uses_with(rebuilt)
            graph.erase_node(node)
        owner, _, attr = fqn.rpartition(".")
        del gm.get_submodule(owner)._parameters[attr]
        decision.converted = True
        decision.ranks = bank[0].ranks
        decision.params = sum(tt.layout.num_params for tt in bank)
        decision.notes.append(f"weight-space: the graph's ops read P rebuilt from {len(bank)} experts' TT cores")
    return decisions


def _emit_rebuild(graph: fx.Graph, name: str, bank: TTExpertBank) -> fx.Node:
    """Nodes computing P = stack of every expert's M_e (slice use "matmul": M_e = P[e])."""

    experts = []
    for e, tt in enumerate(bank):
        layout = tt.layout
        cores = [graph.get_attr(f"{name}.{e}.cores.{k}") for k in range(layout.n_cores)]
        gates = [graph.get_attr(f"{name}.{e}.gates.{k}") for k in range(layout.n_cores - 1)]
        experts.append(
            emit_traced(
                graph, lambda c, g, layout=layout: ops.to_dense(ops.gate_cores(c, g, layout), layout), cores, gates
            )
        )
    return graph.call_function(torch.stack, (experts,))
