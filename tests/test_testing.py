"""Tests of the comera_fx.testing toolkit: it must catch planted bugs, name where they diverge, and accept correct
rewrites (the identity and comera_fx's own tensorize pass at full rank).

The meta-tests run ``check_pass`` with their own small ``max_examples`` (25) instead of the 200-example CI
profile: they test the toolkit (does it find and report a known bug?), each example traces, rewrites and
differentiates a model, and every failure is shrunk. The library's own properties keep the CI profile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn

from comera_fx import TensorizeConfig, tensorize_
from comera_fx.passes import tensorize
from comera_fx.testing import RewriteMismatch, assert_rewrite_equivalent, check_pass, strategies
from comera_fx.testing.equivalence import takes_graph_module
from comera_fx.testing.models import MLP, RandomModel, SelfAttention, build_model
from comera_fx.tt import TTFormat
from comera_fx.tt.shapes import feasible_ranks

# Small and reproducible: these are tests of the toolkit, not of a library property (see the module docstring).
META = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Full rank and every weight "large": the tensorized model must equal the original to float64 rounding.
EXACT = TensorizeConfig(max_rank=10**9, min_numel=1, min_dim=1)
# Strategy-level properties are cheap per example; a few dozen suffice to exercise their shapes.
STRATEGY = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------------------ planted bug passes


def _linear_nodes(gm: fx.GraphModule):
    """(node, module) for every call_module on an nn.Linear."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
            yield node, gm.get_submodule(node.target)


def drop_bias(gm: fx.GraphModule) -> fx.GraphModule:
    """Bug: every linear loses its bias (nn.Linear modules and F.linear calls alike)."""
    for _, module in _linear_nodes(gm):
        module.bias = None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.linear and len(node.args) > 2:
            node.args = node.args[:2]
    gm.recompile()
    return gm


def transpose_square_weight(gm: fx.GraphModule) -> fx.GraphModule:
    """Bug: a square linear weight is used transposed (shapes still fit, so nothing crashes)."""
    for _, module in _linear_nodes(gm):
        if module.in_features == module.out_features:
            module.weight = nn.Parameter(module.weight.detach().t().contiguous())
    return gm


def _tied_aliases(gm: nn.Module) -> list[tuple[str, str]]:
    """(first FQN, later FQN) for every parameter held under two names."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], name))
        else:
            first[id(p)] = name
    return pairs


def untie(gm: nn.Module, *, perturb: float, record: list | None = None) -> nn.Module:
    """Bug: give the later holder of a tied weight its own copy (shifted by ``perturb``)."""
    for _, alias in _tied_aliases(gm):
        owner_name, _, attr = alias.rpartition(".")
        owner = gm.get_submodule(owner_name)
        setattr(owner, attr, nn.Parameter(getattr(owner, attr).detach().clone() + perturb))
        if record is not None:
            record.append(owner_name)
    return gm


class AddWhenBatchIsOne(nn.Module):
    """Wrong only for batch size 1 — the kind of special case (a squeeze, a fast path) that typical batches miss."""

    def forward(self, x):
        return x + 1e-3 if x.shape[0] == 1 else x


def wrong_for_batch_one(gm: fx.GraphModule) -> fx.GraphModule:
    """Bug: insert AddWhenBatchIsOne after the first module call (or before the output)."""
    gm.add_submodule("batch_one_bug", AddWhenBatchIsOne())
    graph = gm.graph
    first = next((n for n in graph.nodes if n.op == "call_module"), None)
    if first is None:
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            bug = graph.call_module("batch_one_bug", (output.args[0],))
        output.args = (bug,)
    else:
        with graph.inserting_after(first):
            bug = graph.call_module("batch_one_bug", (first,))
        first.replace_all_uses_with(bug)
        bug.args = (first,)
    graph.lint()
    gm.recompile()
    return gm


def identity(gm: fx.GraphModule) -> fx.GraphModule:
    return gm


def _check_pass_failure(pass_fn, **options) -> RewriteMismatch:
    with pytest.raises(RewriteMismatch) as info:
        check_pass(pass_fn, settings=META, **options)
    return info.value


def _assert_report_names_node(exc: RewriteMismatch) -> None:
    node = exc.divergence.node
    assert node, str(exc)
    assert f"%{node}" in str(exc), str(exc)
    # The printed (Hypothesis' "Falsifying example") case is the shrunk one the report describes.
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert repr(exc.case) in notes
    assert str(exc).startswith(f"Falsifying case: {exc.case!r}")


def _spec(exc: RewriteMismatch):
    return exc.case.model.spec


# -------------------------------------------------------------------------------------------- caught bugs


def test_dropped_bias_is_caught_at_the_first_linear_with_a_bias():
    exc = _check_pass_failure(drop_bias)
    _assert_report_names_node(exc)
    spec = _spec(exc)
    assert exc.divergence.what == "forward"
    # Shrunk to one biased linear and nothing else.
    assert len(spec.blocks) + (spec.head != "none") == 1, exc.case
    model = exc.case.model
    diverging = exc.divergence
    if diverging.op == "call_module":
        assert model.get_submodule(diverging.target).bias is not None
    else:
        assert diverging.target == "linear"
    assert diverging.max_abs_error > 1e-3


def test_transposed_square_weight_is_caught_at_that_linear():
    exc = _check_pass_failure(transpose_square_weight)
    _assert_report_names_node(exc)
    diverging = exc.divergence
    assert diverging.op == "call_module"
    module = exc.case.model.get_submodule(diverging.target)
    assert isinstance(module, nn.Linear) and module.in_features == module.out_features
    assert diverging.original_shape == diverging.rewritten_shape


def test_broken_and_perturbed_tie_is_caught_at_the_later_holder():
    perturbed: list[str] = []

    def untie_and_perturb(gm: fx.GraphModule) -> fx.GraphModule:
        perturbed.clear()
        return untie(gm, perturb=0.1, record=perturbed)

    exc = _check_pass_failure(untie_and_perturb, models=strategies.models(ties=True))
    _assert_report_names_node(exc)
    assert exc.divergence.what == "forward"
    # The last run of the pass is the shrunk example's: the node diverging is the perturbed copy's user.
    assert exc.divergence.target in perturbed
    assert "the tie is broken" in str(exc)


def test_broken_tie_without_a_value_change_is_caught_through_gradients():
    """Outputs stay equal after untying; only the tied parameter's gradient (summed over both uses) changes."""

    def untie_only(gm: fx.GraphModule) -> fx.GraphModule:
        return untie(gm, perturb=0.0)

    exc = _check_pass_failure(untie_only, models=strategies.models(ties=True))
    _assert_report_names_node(exc)
    assert exc.divergence.what == "parameter gradient"
    first, _ = _tied_aliases(exc.case.model)[0]
    assert exc.divergence.target == first
    assert exc.divergence.node in (first.rpartition(".")[0].replace(".", "_"), first.replace(".", "_"))
    assert "the tie is broken" in str(exc)


def test_bug_only_at_batch_size_one_is_found_by_crossing_batch_breakpoints():
    exc = _check_pass_failure(wrong_for_batch_one, batch_sizes=strategies.batch_sizes(breakpoints=(4,)))
    _assert_report_names_node(exc)
    assert _spec(exc).batch == 1
    assert "batch_one_bug" in str(exc)  # the report points at the node the rewrite added
    # ...and the same pass survives batches that avoid the breakpoint's lower side.
    check_pass(wrong_for_batch_one, settings=META, batch_sizes=st.sampled_from([3, 4, 5]))


def test_module_level_rewrite_is_located_by_module_fqn():
    class Doubled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    def double_mlp_output(model: nn.Module) -> nn.Module:
        model[1].fc_out = Doubled(model[1].fc_out)
        return model

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), MLP(6, 10, 6), nn.Linear(6, 3))
    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(model, double_mlp_output, torch.randn(2, 6), graph=False)
    assert info.value.divergence.node == "1.fc_out"
    assert "First diverging module: 1.fc_out (Linear -> Doubled" in str(info.value)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x, y):
        return self.a(x) * self.b(y)


def test_frozen_weight_is_caught_through_its_gradient():
    def freeze(gm: fx.GraphModule) -> fx.GraphModule:
        gm.b.weight.requires_grad_(False)
        return gm

    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(TwoInputs(), freeze, {"x": torch.randn(2, 3), "y": torch.randn(2, 3)})
    assert (info.value.divergence.what, info.value.divergence.node) == ("parameter gradient", "b")
    assert "b.weight.requires_grad is True in the original and False in the rewrite" in str(info.value)


def test_detached_input_is_caught_through_the_input_gradient():
    def detach_y(gm: fx.GraphModule) -> fx.GraphModule:
        y = next(n for n in gm.graph.nodes if n.name == "y")
        with gm.graph.inserting_after(y):
            detached = gm.graph.call_method("detach", (y,))
        y.replace_all_uses_with(detached)
        detached.args = (y,)
        gm.recompile()
        return gm

    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(TwoInputs(), detach_y, (torch.randn(2, 3), torch.randn(2, 3)))
    assert (info.value.divergence.what, info.value.divergence.node) == ("input gradient", "y")
    assert "gradient w.r.t. args[1]" in str(info.value)


def test_lossy_tensorize_is_located_at_the_replaced_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(
            model, functools.partial(tensorize, config=EXACT.replace(max_rank=1)), torch.randn(5, 8)
        )
    assert info.value.divergence.node == "_1"  # the first linear, now a rank-1 TT contraction
    assert "First diverging node: %_1 (call_module 1), replaced in the rewrite by %" in str(info.value)


def test_rewrite_that_crashes_the_model_is_reported_at_the_failing_node():
    def bad_reshape(gm: fx.GraphModule) -> fx.GraphModule:
        for _, module in _linear_nodes(gm):
            module.weight = nn.Parameter(module.weight.detach()[:, :-1])
        return gm

    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU())
    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(model, bad_reshape, torch.randn(3, 5), graph=True)
    assert info.value.divergence.what == "error"
    assert info.value.divergence.node == "_0"
    assert "raised" in str(info.value)


# ------------------------------------------------------------------------------------------ correct rewrites


def test_identity_pass_preserves_every_model():
    check_pass(identity, settings=META)


def test_full_rank_tensorize_pass_preserves_every_model():
    check_pass(functools.partial(tensorize, config=EXACT), settings=META)


def test_full_rank_in_place_tensorize_is_equivalent_including_gradients_of_kept_parameters():
    spec_model = build_model(_fixed_spec())
    x = torch.randint(0, spec_model.spec.vocab, (3, 4))

    def rewrite(model: nn.Module) -> None:
        tensorize_(model, EXACT)  # module scan: no Dynamo capture, keeps the test fast

    rewritten = assert_rewrite_equivalent(spec_model, rewrite, x)
    assert any(type(m).__name__.startswith("TT") for m in rewritten.modules())


def test_compiled_rewrite_is_checked_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 2))
    assert_rewrite_equivalent(model, identity, torch.randn(4, 6), compile_backend="aot_eager")


def test_tolerances_follow_the_dtype_and_can_be_loosened():
    def nudge(gm: fx.GraphModule) -> fx.GraphModule:
        for _, module in _linear_nodes(gm):
            module.bias = nn.Parameter(module.bias.detach() + 1e-5)
        return gm

    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RewriteMismatch):
        assert_rewrite_equivalent(model, nudge, torch.randn(2, 4))
    assert_rewrite_equivalent(model, nudge, torch.randn(2, 4), atol=1e-4)


# ------------------------------------------------------------------------------------ outputs and tolerances


@dataclasses.dataclass
class PlainOutput:  # a dataclass pytree does not know: its fields must still be compared and differentiated
    y: torch.Tensor
    count: int


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        return PlainOutput(self.a(x), 3)


def _scale_weight(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        model.a.weight.mul_(2)
    return model


def test_tensors_inside_an_unregistered_dataclass_output_are_compared():
    with pytest.raises(RewriteMismatch, match="output"):
        assert_rewrite_equivalent(DataclassOut(), _scale_weight, torch.randn(2, 3), graph=False)


def test_tensors_inside_a_dataclass_output_are_differentiated():
    def detach_output(model: nn.Module) -> nn.Module:
        forward = model.forward
        model.forward = lambda x: PlainOutput(forward(x).y.detach(), 3)
        return model

    with pytest.raises(RewriteMismatch) as info:
        assert_rewrite_equivalent(DataclassOut(), detach_output, torch.randn(2, 3), graph=False)
    assert info.value.divergence.what in ("input gradient", "parameter gradient")


class WithNonTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        y = self.a(x)
        return {"y": y, "aux": None, "pair": (y.argmax(-1), 3, "ok"), "total": float(y.detach().sum())}


def test_python_floats_in_outputs_get_the_tolerance_and_other_values_equality():
    def nudge_bias(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            model.a.bias.add_(1e-13)  # changes the float's last digits, not beyond float64 rounding
        return model

    assert_rewrite_equivalent(WithNonTensors(), nudge_bias, torch.randn(2, 3), graph=False)

    def change_constant(model: nn.Module) -> nn.Module:
        forward = model.forward
        model.forward = lambda x: {**forward(x), "pair": (forward(x)["pair"][0], 4, "ok")}
        return model

    with pytest.raises(RewriteMismatch, match="3 vs 4"):
        assert_rewrite_equivalent(WithNonTensors(), change_constant, torch.randn(2, 3), graph=False)


def _add_relative_noise(scale: float):
    """A rewrite whose output error is ``scale`` times the output norm, spread evenly over the elements (so
    elements near zero get an element-wise relative error far above ``scale``)."""

    def rewrite(model: nn.Module) -> nn.Module:
        forward = model.forward

        def noisy(x):
            y = forward(x)
            noise = torch.ones_like(y) / math.sqrt(max(y.numel(), 1))
            return y + scale * float(torch.linalg.vector_norm(y.detach())) * noise

        model.forward = noisy
        return model

    return rewrite


def test_norm_relative_tolerance_bounds_the_error_norm_not_each_element():
    torch.manual_seed(0)
    model, x = nn.Linear(6, 6), torch.randn(50, 6)
    with pytest.raises(RewriteMismatch):
        assert_rewrite_equivalent(model, _add_relative_noise(1e-7), x, graph=False, grads=False)
    assert_rewrite_equivalent(model, _add_relative_noise(1e-7), x, graph=False, grads=False, norm_rtol=1e-6)
    with pytest.raises(RewriteMismatch, match="relative norm error 1e-05"):
        assert_rewrite_equivalent(model, _add_relative_noise(1e-5), x, graph=False, grads=False, norm_rtol=1e-6)
    with pytest.raises(ValueError, match="norm_rtol"):
        assert_rewrite_equivalent(model, lambda m: m, x, graph=False, norm_rtol=-1.0)


def test_extra_inputs_check_the_one_rewrite_on_each():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    assert_rewrite_equivalent(model, wrong_for_batch_one, torch.randn(3, 4), extra_inputs=[torch.randn(5, 4)])
    with pytest.raises(RewriteMismatch, match="on extra input 2") as info:
        assert_rewrite_equivalent(
            model, wrong_for_batch_one, torch.randn(3, 4), extra_inputs=[torch.randn(5, 4), torch.randn(1, 4)]
        )
    assert info.value.divergence.node  # located on the input that shows it


def test_models_draw_further_inputs_and_check_pass_uses_them():
    batches = set()

    @STRATEGY
    @given(case=strategies.models(num_inputs=3))
    def look(case):
        model, (x,) = case
        assert len(case.more_inputs) == 2
        for (other,) in case.more_inputs:
            assert other.dtype == x.dtype and other.dim() == x.dim()
            assert other.shape[2:] == x.shape[2:]  # same features (and no sequence axis where x has none)
            model(other)
        batches.update(other.shape[0] for (other,) in case.more_inputs)

    look()
    assert len(batches) > 1
    # The first input never has batch size 1 here; only the further inputs can show the bug.
    exc = _check_pass_failure(wrong_for_batch_one, batch_sizes=st.sampled_from([3, 1]), num_inputs=3)
    assert any(inputs[0].shape[0] == 1 for inputs in (exc.case.example_inputs, *exc.case.more_inputs))
    with pytest.raises(ValueError, match="num_inputs"):
        strategies.models(num_inputs=0)


# ------------------------------------------------------------------------------------------- compiled check


def _counting_backend():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    return backend, calls


def test_compiled_check_leaves_the_callers_compiled_code_alone():
    backend, calls = _counting_backend()
    user_model = nn.Sequential(nn.Linear(3, 3))
    users_compiled = torch.compile(user_model, backend=backend)
    x = torch.randn(2, 3)
    users_compiled(x)
    assert len(calls) == 1
    torch.manual_seed(0)
    assert_rewrite_equivalent(nn.Sequential(nn.Linear(6, 2)), identity, torch.randn(4, 6), compile_backend="aot_eager")
    users_compiled(x)
    assert len(calls) == 1, "the check wiped the caller's compiled code (a recompile happened)"


def test_compiled_check_compiles_every_model_of_a_shared_forward():
    """Twelve models sharing nn.Sequential.forward: past Dynamo's recompile limit (8) each is still compiled."""
    backend, calls = _counting_backend()
    for width in range(2, 14):
        assert_rewrite_equivalent(
            nn.Sequential(nn.Linear(width, 3)), identity, torch.randn(2, width), compile_backend=backend, grads=False
        )
    assert len(calls) == 12


def test_compiled_check_compares_parameter_gradients():
    """A backend that computes the right outputs but detaches the parameters: only parameter gradients show it."""

    def detaching_backend(gm, example_inputs):
        def run(*inputs):
            return gm(*[x.detach() if isinstance(x, nn.Parameter) else x for x in inputs])

        return run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(RewriteMismatch, match="gradient w.r.t. parameter") as info:
        assert_rewrite_equivalent(model, identity, torch.randn(2, 4), compile_backend=detaching_backend)
    assert info.value.divergence.what == "compiled"


def _fixed_spec():
    from comera_fx.testing.models import BlockSpec, ModelSpec

    blocks = (
        BlockSpec("attention", 8, 8),
        BlockSpec("residual", 8, 8, inner=BlockSpec("mlp", 8, 8, hidden=12)),
        BlockSpec("layernorm", 8, 8),
        BlockSpec("functional_linear", 8, 8),
    )
    return ModelSpec("tokens", 8, 11, blocks, "tied", 0, batch=3, seq_len=4, seed=3)


# ------------------------------------------------------------------------------------------------ helpers API


def test_graph_rewrites_are_recognised_by_annotation():
    def module_rewrite(m: nn.Module) -> nn.Module:
        return m

    assert takes_graph_module(tensorize) is True
    assert takes_graph_module(functools.partial(tensorize, config=EXACT)) is True
    assert takes_graph_module(drop_bias) is True
    assert takes_graph_module(module_rewrite) is False
    assert takes_graph_module(lambda m: m) is None


def test_undeclared_graph_pass_is_retried_on_the_trace():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RewriteMismatch):
        assert_rewrite_equivalent(model, lambda gm: drop_bias(gm), torch.randn(2, 4))


def test_import_comera_fx_does_not_import_the_toolkit():
    code = "import sys, comera_fx\nassert 'comera_fx.testing' not in sys.modules and 'hypothesis' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_equivalence_check_works_without_hypothesis_installed():
    code = """
import sys
sys.modules["hypothesis"] = None  # as if the [test] extra were not installed
import torch
from comera_fx.testing import assert_rewrite_equivalent
assert_rewrite_equivalent(torch.nn.Linear(3, 2), lambda m: m, torch.randn(4, 3), graph=False)
try:
    from comera_fx.testing import strategies
except ModuleNotFoundError as exc:
    assert "pip install comera_fx[test]" in str(exc), exc
else:
    raise AssertionError("strategies imported without Hypothesis")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------ strategies


@STRATEGY
@given(spec=strategies.tt_specs())
def test_tt_specs_are_valid_layouts_within_feasible_ranks(spec):
    layout = spec.layout
    chain = (
        layout.row_modes + layout.col_modes
        if layout.format is TTFormat.TT
        else tuple(a * b for a, b in zip(layout.row_modes, layout.col_modes))
    )
    assert all(r <= f for r, f in zip(layout.ranks, feasible_ranks(chain)))
    assert [tuple(c.shape) for c in spec.cores] == layout.core_shapes
    assert [g.numel() for g in spec.gates] == list(layout.internal_ranks)
    dense = spec.matrix().dense()
    assert dense.shape == (layout.rows, layout.cols) and torch.isfinite(dense).all()


@STRATEGY
@given(data=st.data())
def test_tt_inputs_fit_the_layout_in_any_memory_layout(data):
    tt = data.draw(strategies.tt_matrices(formats=["tt"]))
    x = data.draw(strategies.tt_inputs(tt.layout))
    assert x.shape[-1] == tt.rows and x.dtype == torch.float64
    y = tt.matmul(x)
    assert torch.allclose(y, x @ tt.dense(), atol=1e-8)


def test_strategies_draw_awkward_cases():
    seen = {"zero_batch": False, "non_contiguous": False, "dead_gate": False, "prime": False}

    @STRATEGY
    @given(x=strategies.float_tensors(5), spec=strategies.tt_specs(), n=strategies.feature_sizes())
    def look(x, spec, n):
        seen["zero_batch"] |= x.numel() == 0
        seen["non_contiguous"] |= not x.is_contiguous()
        seen["dead_gate"] |= any(bool((g == 0).any()) for g in spec.gates)
        seen["prime"] |= n > 2 and all(n % k for k in range(2, math.isqrt(n) + 1))

    look()
    assert all(seen.values()), seen


def test_batch_sizes_straddle_each_breakpoint():
    assert strategies.batch_size_values((8, 16)) == (1, 7, 8, 9, 15, 16, 17)
    assert strategies.batch_size_values((1,)) == (1, 2)
    assert strategies.batch_size_values((1,), include_zero=True) == (0, 1, 2)
    with pytest.raises(ValueError):
        strategies.batch_sizes((-1,))


@STRATEGY
@given(case=strategies.models())
def test_models_are_reproducible_and_run(case):
    model, (x,) = case
    again = build_model(model.spec)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    y = model(x)
    assert y.shape[0] == model.spec.batch and y.dtype == torch.float64
    assert isinstance(model, RandomModel)


def test_models_with_ties_always_tie_a_weight():
    @STRATEGY
    @given(case=strategies.models(ties=True))
    def tied(case):
        assert _tied_aliases(case.model)

    tied()


def test_models_cover_the_grammar():
    kinds = set()

    @settings(STRATEGY, max_examples=100)
    @given(case=strategies.models())
    def collect(case):
        spec = case.model.spec
        kinds.update(b.kind for b in spec.blocks)
        kinds.update(b.inner.kind for b in spec.blocks if b.inner is not None)
        kinds.add(f"head:{spec.head}")
        kinds.add(f"input:{spec.input_layout}")

    collect()
    expected = set(strategies.BLOCK_KINDS) | {
        "head:none",
        "head:linear",
        "head:tied",
        "input:contiguous",
        "input:transposed",
        "input:strided",
        "input:expanded",
    }
    assert expected <= kinds, expected - kinds


def test_attention_block_matches_a_reference_implementation():
    torch.manual_seed(0)
    attn = SelfAttention(6).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    expected = attn.o(F.scaled_dot_product_attention(attn.q(x), attn.k(x), attn.v(x)))
    assert torch.allclose(attn(x), expected)
