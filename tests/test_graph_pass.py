"""comera_fx.passes.tensorize: the GraphModule -> GraphModule pass, on symbolic_trace and torch.export graphs.

Every check compares against the ORIGINAL dense model, kept untouched; function equivalence (outputs, and
gradients w.r.t. float inputs and kept parameters) is checked with comera_fx.testing.assert_rewrite_equivalent.
"""

import copy
import operator

import pytest
import torch
from torch import fx

import comera_fx
from comera_fx import TensorizeConfig, TTMatrix
from comera_fx.testing import assert_rewrite_equivalent
from helpers_models import (
    MLP,
    FunctionalLinear,
    LinearAndMatmul,
    MatmulModel,
    Mixed,
    TiedLM,
    Tiny,
    large_2d_parameters,
    rel_err,
    relative_tolerance,
    tt_chain_dense,
)

FULL = TensorizeConfig(max_rank=10**9, min_numel=4096)

MODELS = {
    "mlp": (MLP, lambda: torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))),
    "functional": (
        FunctionalLinear,
        lambda: torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
    ),
    "matmul": (
        MatmulModel,
        lambda: torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
    ),
    "linear_and_matmul": (
        LinearAndMatmul,
        lambda: torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
    ),
    "tied": (TiedLM, lambda: torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(2))),
    "mixed": (Mixed, lambda: torch.tensor([[0, 5, 299, 0], [17, 0, 3, 250]])),  # includes the padding index 0
}

# Ops the TT contraction subgraph may use: pairwise contractions (matmul / mm / bmm) and data movement only.
ALLOWED_NEW_OPS = {
    "matmul",
    "mm",
    "bmm",
    "reshape",
    "view",
    "permute",
    "t",
    "transpose",
    "mul",
    "add",
    "getitem",
    "embedding",
    "pad",
    "div",
    "remainder",
    "floordiv",
    "where",
    "eq",
    "contiguous",
    "getattr",
}  # getattr: reading x.shape for the output reshape


def capture(flavor: str, model, x) -> fx.GraphModule:
    if flavor == "symbolic_trace":
        return fx.symbolic_trace(model)
    return torch.export.export(model, (x,)).module()


def assert_pass_equivalent(flavor: str, dense, x, config=FULL, **kwargs) -> fx.GraphModule:
    """Capture a copy of ``dense`` the ``flavor`` way, run the pass on it and compare with ``dense`` (float64,
    relative error 1e-10 unless ``kwargs`` say otherwise); returns the rewritten GraphModule."""
    kwargs = relative_tolerance(dense, (x,), 1e-10) | kwargs
    if flavor == "symbolic_trace":  # the toolkit hands the rewrite fx.symbolic_trace of its copy
        return assert_rewrite_equivalent(
            dense, lambda gm: comera_fx.passes.tensorize(gm, config), x, graph=True, **kwargs
        )
    return assert_rewrite_equivalent(
        dense, lambda m: comera_fx.passes.tensorize(capture(flavor, m, x), config), x, graph=False, **kwargs
    )


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]  # aten overloads: "mm.default" -> "mm"


def call_names(gm: fx.GraphModule) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.fixture(
    scope="module",
    params=[(f, m) for f in ("symbolic_trace", "export") for m in MODELS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def converted(request):
    flavor, name = request.param
    torch.manual_seed(0)
    cls, make_input = MODELS[name]
    dense = cls().double()
    x = make_input()
    gm = capture(flavor, copy.deepcopy(dense), x)
    before = call_names(gm)
    out = comera_fx.passes.tensorize(gm, FULL)
    return dict(flavor=flavor, name=name, dense=dense, x=x, gm=out, before=before, returned_same=out is gm)


def test_full_rank_matches_dense_model(converted):
    """Outputs, and gradients w.r.t. float inputs and the parameters left dense (biases, tied or skipped ones)."""
    assert converted["returned_same"]
    gm = assert_pass_equivalent(converted["flavor"], converted["dense"], converted["x"])
    assert isinstance(gm, fx.GraphModule) and gm.meta["comera_fx"].converted


def test_graph_keeps_no_dead_nodes(converted):
    """The pass lints its graph itself; what lint does not check is that nothing it left behind is unused."""
    gm = copy.deepcopy(converted["gm"])
    before = [n.format_node() for n in gm.graph.nodes]
    gm.graph.eliminate_dead_code()
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_summary_lists_converted_layers(converted):
    gm, dense = converted["gm"], converted["dense"]
    summary = gm.meta["comera_fx"]
    assert isinstance(summary, comera_fx.TensorizeSummary) and summary.method == "graph"
    assert sorted(d.fqn for d in summary.converted) == sorted(large_2d_parameters(dense, FULL))
    text = str(summary)
    assert all(d.fqn in text for d in summary.converted)


def test_dense_parameters_are_gone_and_cores_registered(converted):
    gm = converted["gm"]
    summary = gm.meta["comera_fx"]
    names = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    converted_aliases = {a for d in summary.converted for a in d.aliases}
    assert converted_aliases and not names & converted_aliases
    get_attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert not get_attrs & converted_aliases
    tt_modules = {n: m for n, m in gm.named_modules() if isinstance(m, TTMatrix)}
    assert set(tt_modules) == {"comera_tt_" + d.fqn.replace(".", "_") for d in summary.converted}
    for module_name, tt in tt_modules.items():
        assert all(p.requires_grad for p in tt.parameters())
        assert any(n.startswith(module_name + ".cores.") for n in names)
        assert any(n.startswith(module_name + ".gates.") for n in names)
    # every parameter left is either a TT core / gate or an unconverted parameter of the dense model (biases)
    dense_names = {n for n, _ in converted["dense"].named_parameters(remove_duplicate=False)}
    assert {n for n in names if not n.startswith("comera_tt_")} == dense_names - converted_aliases


def test_no_n_ary_einsum_only_pairwise_contractions(converted):
    gm = converted["gm"]
    after = call_names(gm)
    assert not any("einsum" in n or "tensordot" in n for n in after)
    new_ops = set(after) - set(converted["before"])
    assert new_ops <= ALLOWED_NEW_OPS, new_ops - ALLOWED_NEW_OPS
    assert {"matmul", "mm", "bmm"} & set(after)


def test_one_tt_submodule_per_parameter_even_when_tied(converted):
    gm, dense = converted["gm"], converted["dense"]
    tt_names = [n for n, m in gm.named_modules() if isinstance(m, TTMatrix)]
    assert len(tt_names) == len(large_2d_parameters(dense, FULL))  # distinct parameter objects, not holders
    if converted["name"] not in ("tied", "mixed"):
        return
    assert "comera_tt_emb_weight" in tt_names and not any("head" in n for n in tt_names)
    decision = next(d for d in gm.meta["comera_fx"].converted if d.fqn == "emb.weight")
    assert sorted(decision.uses) == ["embedding", "linear"]


def test_core_and_gate_gradients_equal_a_dense_reference(converted):
    """d sum(out) / d core for every TT core and gate, against the chain rule done independently: dL/dW from the
    untouched dense model (W = M or Mᵀ at full rank), pushed through an opt_einsum rebuild of M from copies of the
    cores (``tt_chain_dense``)."""
    gm, dense, x = converted["gm"], copy.deepcopy(converted["dense"]), converted["x"]
    dense(x).sum().backward()
    gm.zero_grad()
    gm(x).sum().backward()
    matrices = gm.meta["comera_fx"].converted
    assert matrices, "the pass converted nothing: no TT gradient to check"
    for decision in matrices:
        tt = gm.get_submodule("comera_tt_" + decision.fqn.replace(".", "_"))
        weight = dense.get_parameter(decision.fqn)
        cores = [c.detach().clone().requires_grad_() for c in tt.cores]
        gates = [g.detach().clone().requires_grad_() for g in tt.gates]
        rebuilt = tt_chain_dense(cores, gates, tt.layout)
        same = rebuilt.shape == weight.shape and torch.allclose(rebuilt, weight, rtol=1e-8, atol=1e-10)
        assert same or torch.allclose(rebuilt, weight.T, rtol=1e-8, atol=1e-10), decision.fqn
        (rebuilt * (weight.grad if same else weight.grad.T)).sum().backward()
        for got, reference in zip([*tt.cores, *tt.gates], [*cores, *gates]):
            assert got.grad is not None and reference.grad.norm() > 0, decision.fqn
            torch.testing.assert_close(got.grad, reference.grad, rtol=1e-7, atol=1e-9 * reference.grad.norm())


@pytest.mark.parametrize("flavor", ["symbolic_trace", "export"])
def test_low_rank_graph_matches_eager_tensorize(flavor):
    """At a truncated rank the graph pass and tensorize_ make the same TT-SVD: same outputs."""
    torch.manual_seed(0)
    dense = Mixed().double()
    x = MODELS["mixed"][1]()
    config = TensorizeConfig(max_rank=6, min_numel=4096)
    gm = comera_fx.passes.tensorize(capture(flavor, copy.deepcopy(dense), x), config)
    eager = copy.deepcopy(dense)
    comera_fx.tensorize_(eager, config, example_inputs=(x,))
    with torch.no_grad():
        out_graph, out_eager, out_dense = gm(x), eager(x), dense(x)
    assert rel_err(out_graph, out_eager) <= 1e-10
    assert rel_err(out_graph, out_dense) > 1e-3  # truly truncated: the equality above is not the dense one
    # the padding row of the embedding is exact even at low rank
    with torch.no_grad():
        emb_ref = dense.emb(x)
    assert (x == 0).any()
    assert torch.equal(dense.emb.weight[0], emb_ref[x == 0][0])
    ranks = {d.fqn: d.ranks for d in gm.meta["comera_fx"].converted}
    assert all(max(r) <= 6 for r in ranks.values())


def test_graph_pass_respects_skip_and_threshold():
    torch.manual_seed(0)
    dense = Mixed().double()
    x = MODELS["mixed"][1]()
    gm = assert_pass_equivalent("symbolic_trace", dense, x, FULL.replace(skip=[r"^w2$"]))
    summary = gm.meta["comera_fx"]
    skipped = {d.fqn: d.reason for d in summary.skipped}
    assert "w2" in skipped and "skip" in skipped["w2"]
    assert "w2" in dict(gm.named_parameters())


def test_graph_pass_on_a_model_with_nothing_large():
    torch.manual_seed(0)
    dense = Tiny()
    ids = torch.tensor([[1, 2, 3]])
    # nothing changes, so outputs and gradients are bit-for-bit those of the model (float32, as built)
    gm = assert_pass_equivalent("symbolic_trace", dense, ids, TensorizeConfig(), dtype=torch.float32, rtol=0, atol=0)
    assert gm.meta["comera_fx"].converted == []
    assert "nothing converted" in str(gm.meta["comera_fx"])
    assert not any(isinstance(m, TTMatrix) for m in gm.modules())


def test_report_of_a_graph_module_names_layers_by_parameter():
    torch.manual_seed(0)
    gm = comera_fx.passes.tensorize(fx.symbolic_trace(MLP().double()), TensorizeConfig(max_rank=8, min_numel=4096))
    rows = {r.fqn: r for r in comera_fx.report(gm).layers}
    assert set(rows) == {"fc1_weight", "fc2_weight"}
    assert rows["fc1_weight"].dense_params == 128 * 256
