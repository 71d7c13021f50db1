"""The planner's custom autograd (``plan.execute_function`` / ``plan.plan_function``) against independent references.

* Numbers: output and gradients w.r.t. x, every core and every gate equal a dense float64 reference, M built with
  opt_einsum from the cores and the gate vectors (gates as separate tensors on the bonds, not folded).
* Saved for backward: with ``torch.autograd.graph.saved_tensors_hooks``, the batch-dependent tensors saved are one
  per batched step and their bytes are exactly what the cost model counts (``Plan.terms.bytes_saved``).
* Tracing: ``torch.compile(fullgraph=True, dynamic=True)`` with aot_eager (and inductor, marked slow: ~15 s of
  C++ compilation here), one graph for two batch sizes of one plan interval.
"""

from __future__ import annotations

import opt_einsum as oe
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_fx.testing.strategies import tt_inputs, tt_specs
from comera_fx.tt import TTFormat, TTLayout, TTLinear, TTMatrix, layers
from comera_fx.tt import merged, ops
from comera_fx.tt import plan as planner
from helpers_models import assert_bf16_autocast_grads_close, random_trees

BOND, ROW, COL = 0, 100, 200


def dense_reference(cores, gates, layout: TTLayout) -> torch.Tensor:
    """M (rows × cols) from the cores and the gate vectors, each gate a separate operand on its bond."""
    operands = []
    for k, core in enumerate(cores):
        labels = [ROW + k] if layout.format is TTFormat.TT else [ROW + k, COL + k]
        operands += [core, [BOND + k, *labels, BOND + k + 1]]
    for k, gate in enumerate(gates):
        operands += [gate, [BOND + k + 1]]
    n = len(cores)
    modes = [ROW + k for k in range(n)] + ([COL + k for k in range(n)] if layout.format is TTFormat.TTM else [])
    full = oe.contract(*operands, [BOND, *modes, BOND + n])
    return full.reshape(layout.padded_rows, layout.padded_cols)[: layout.rows, : layout.cols]


def grads_of(fn, tensors):
    """fn(*tensors) and the gradients of a fixed random projection of it w.r.t. every tensor."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    y = fn(*leaves)
    weights = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    return y, torch.autograd.grad((y * weights).sum(), leaves)


def assert_rel_close(actual, expected, tol=1e-10):
    assert tuple(actual.shape) == tuple(expected.shape)
    err = torch.linalg.norm((actual.detach() - expected.detach()).reshape(-1)).item()
    scale = torch.linalg.norm(expected.detach().reshape(-1)).item()
    assert err <= tol * max(scale, 1e-300) or err == 0, f"relative error {err / max(scale, 1e-300):.3g} > {tol}"


# ----------------------------------------------------------------------------------------------------- numbers


@settings(max_examples=60)  # each example runs up to 6 plans forward + backward: keeps the test to a few seconds
@given(data=st.data(), spec=tt_specs(max_modes=3, max_rank=5), op=st.sampled_from(planner.OPS), with_bias=st.booleans())
def test_function_gradients_match_dense_float64(data, spec, op, with_bias):
    """Every plan — a random tree, the envelope's, and for TT the two-factor tree (x·L)·R, whose bond runs padded on
    CPU with the bias in its spare slice — gives the dense float64 output and gradients of x, cores, gates, bias."""
    layout = spec.layout
    x = data.draw(tt_inputs(layout, side="rows" if op == "matmul" else "cols"))
    net = planner.build_network(layout, op)
    plans = [planner.Plan.from_tree(net, data.draw(random_trees(net.n_tensors))), *planner.plan(layout, op=op).plans]
    if layout.format is TTFormat.TT:
        two_factor = planner.Plan.from_tree(net, _two_factor_tree(layout, op))
        assert planner.plan_runner(two_factor).two_factor is not None
        plans.append(two_factor)
    n = len(spec.cores)
    n_out = layout.cols if op == "matmul" else layout.rows
    bias = [torch.randn(n_out, dtype=x.dtype, generator=torch.Generator().manual_seed(2))] if with_bias else []

    def reference(x, *params):
        m = dense_reference(params[:n], params[n : n + len(spec.gates)], layout)
        y = x @ m if op == "matmul" else x @ m.t()
        return y + params[-1] if with_bias else y

    want_y, want = grads_of(reference, [x, *spec.cores, *spec.gates, *bias])
    for chosen in plans:

        def planned(x, *params):
            cores = ops.gate_cores(list(params[:n]), list(params[n : n + len(spec.gates)]), layout)
            return planner.execute_function(chosen, x, cores, layout, params[-1] if with_bias else None)

        got_y, got = grads_of(planned, [x, *spec.cores, *spec.gates, *bias])
        assert_rel_close(got_y, want_y)
        for g, w in zip(got, want):
            assert_rel_close(g, w)


def _two_factor_tree(layout: TTLayout, op: str):
    """(x·(G1·…·Gk))·(Gk+1·…·Gn) for x @ M (row cores first), the column cores first for x @ Mᵀ."""
    k, n = len(layout.row_modes), layout.n_cores
    rows, cols = list(range(1, k + 1)), list(range(k + 1, n + 1))
    first, second = (rows, cols) if op == "matmul" else (cols, rows)

    def chain(ids):
        tree = ids[0]
        for i in ids[1:]:
            tree = (tree, i)
        return tree

    return ((0, chain(first)), chain(second))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_module_uses_the_function_and_matches_dense(monkeypatch, transposed, with_bias):
    monkeypatch.setattr(layers, "CUSTOM_AUTOGRAD", True)
    tt = TTMatrix.random(
        30,
        20,
        format=TTFormat.TT,
        row_modes=(3, 5, 2),
        col_modes=(4, 5),
        max_rank=4,
        std=1.0,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        for gate in tt.gates:
            gate.uniform_(0.5, 1.5)
    out_features = tt.rows if transposed else tt.cols
    bias = torch.randn(out_features, dtype=torch.float64) if with_bias else None
    linear = TTLinear(tt, bias, transposed=transposed)
    x = torch.randn(7, 3, linear.in_features, dtype=torch.float64, requires_grad=True)
    y = linear(x)
    assert y.grad_fn.name().startswith("PlannedProduct"), y.grad_fn.name()
    params = [x, *tt.cores, *tt.gates] + ([linear.bias] if with_bias else [])
    dy = torch.randn(y.shape, dtype=torch.float64)
    got = torch.autograd.grad(y, params, dy)
    n = len(tt.cores)

    def reference(x, *p):
        m = dense_reference(p[:n], p[n : 2 * n - 1], tt.layout)
        y = x @ (m.t() if transposed else m)
        return y + p[-1] if with_bias else y

    leaves = [p.detach().requires_grad_() for p in params]
    want_y = reference(*leaves)
    want = torch.autograd.grad(want_y, leaves, dy)
    assert_rel_close(y, want_y)
    for g, w in zip(got, want):
        assert_rel_close(g, w)


@pytest.mark.parametrize("randomized", [False, True])
def test_the_output_may_be_modified_in_place(monkeypatch, randomized):
    """A model may write into a layer's output (Llama 4's MoE block: ``out = shared_expert(x); out.add_(routed)``).
    The planned product's y was a view made inside the custom Function, which autograd refuses to modify in place;
    now y + z written in place has the gradients of the float64 reference's y + z (dX, and every core and gate
    without the sketch; with it, dX is exact)."""
    from comera_fx.rmm import rmm_tt_product

    monkeypatch.setattr(layers, "CUSTOM_AUTOGRAD", True)
    tt = TTMatrix.random(
        30, 20, format=TTFormat.TT, row_modes=(3, 5, 2), col_modes=(4, 5), max_rank=4, std=1.0,
        dtype=torch.float64, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    x = torch.randn(6, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    z = torch.randn(6, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    params = [x] if randomized else [x, *tt.cores, *tt.gates]
    y = rmm_tt_product(x, tt, rho=0.5) if randomized else TTLinear(tt)(x)
    assert y.grad_fn.name().startswith("RandomizedTTProduct" if randomized else "PlannedProduct")
    y.add_(z)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(y, params, dy)
    leaves = [p.detach().requires_grad_() for p in [x, *tt.cores, *tt.gates]]
    n = len(tt.cores)
    want_y = leaves[0] @ dense_reference(leaves[1 : 1 + n], leaves[1 + n :], tt.layout) + z
    want = torch.autograd.grad(want_y, leaves[: len(params)], dy)
    assert_rel_close(y, want_y)
    for g, w in zip(got, want):
        assert_rel_close(g, w)


@pytest.fixture(autouse=True)
def planned_path_only(monkeypatch):
    """These tests are about the plan runners: no-grad calls of few tokens would take the cached two-factor form
    (tests/test_decode_cache.py) instead."""
    monkeypatch.setattr(merged, "USE_MERGED_FORMS", False)


def aten_calls(fn, *args, shapes: bool = False) -> list:
    """The aten ops ``fn(*args)`` dispatches, by name (with ``shapes``: (name, shapes of its tensor arguments))."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            calls.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]) if shapes else name)
            return func(*args, **(kwargs or {}))

    calls: list = []
    with Record():
        fn(*args)
    return calls


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("in_gemm", [True, False])
def test_bias_rides_in_the_last_gemm_when_the_plan_writes_y(monkeypatch, grad, in_gemm):
    """The bias never costs a separate pass over y where the last GEMM writes y: it rides in the padded bond's spare
    slice (a row of R: no add, no addmm) or, with that off, in addmm as nn.Linear's does; the numbers match a
    float64 dense x·W + b. Where the last GEMM does not write y (output padding trimmed), a plain add remains."""
    monkeypatch.setattr(layers, "CUSTOM_AUTOGRAD", True)
    monkeypatch.setattr(planner.autograd, "BIAS_IN_GEMM", in_gemm)
    torch.manual_seed(0)
    for out_features, writes_y in ((96, True), (97, False)):  # 97 is padded to 98 = 2·7·7 (trimmed after)
        dense = torch.nn.Linear(120, out_features, dtype=torch.float64)
        linear = TTLinear.from_dense(
            dense, max_rank=4, col_modes=(4, 4, 6) if writes_y else (2, 7, 7), row_modes=(4, 5, 6)
        )
        x = torch.randn(50, 120, dtype=torch.float64)
        chosen = layers.choose_plan(layers.planned_envelope(linear.tt.layout, "matmul", device="cpu"), 50)
        assert planner.folds_bias(chosen) is writes_y
        assert planner.plan_runner(chosen).two_factor is not None  # rank 4 runs at 16: the bond has spare slices
        with torch.set_grad_enabled(grad):
            calls = aten_calls(linear, x)
            y = linear(x)
        if writes_y and in_gemm:
            assert "addmm" not in calls and "add" not in calls, calls
        else:
            assert ("addmm" in calls) is writes_y and ("add" not in calls) is writes_y, calls
        tt = linear.tt
        m = dense_reference(list(tt.cores), list(tt.gates), tt.layout)
        assert_rel_close(y, x @ m + dense.bias)


@pytest.mark.parametrize("in_gemm", [True, False])
def test_bias_gradient_comes_out_of_the_gemm_for_dr(monkeypatch, in_gemm):
    """With the bias in the padded bond, 1ᵀ·dY is the bias row of the GEMM that computes dR = tᵀ·dY: backward runs
    no separate sum over dY. Every gradient equals the float64 dense reference's either way."""
    monkeypatch.setattr(planner.autograd, "BIAS_IN_GEMM", in_gemm)
    torch.manual_seed(0)
    dense = torch.nn.Linear(120, 96, dtype=torch.float64)
    linear = TTLinear.from_dense(dense, max_rank=4, col_modes=(4, 4, 6), row_modes=(4, 5, 6))
    x = torch.randn(50, 120, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(50, 96, dtype=torch.float64)
    y = linear(x)
    calls = aten_calls(lambda: y.backward(dy), shapes=True)
    sums_over_dy = [c for c in calls if c[0] == "sum" and (50, 96) in c[1]]  # (the gates' sums are small)
    assert bool(sums_over_dy) is not in_gemm, calls
    tt = linear.tt
    leaves = [t.detach().requires_grad_() for t in (x, *tt.cores, *tt.gates, linear.bias)]
    n = len(tt.cores)
    want_y = leaves[0] @ dense_reference(leaves[1 : 1 + n], leaves[1 + n : -1], tt.layout) + leaves[-1]
    want = torch.autograd.grad(want_y, leaves, dy)
    for got, expected in zip((x.grad, *(p.grad for p in (*tt.cores, *tt.gates, linear.bias))), want):
        assert_rel_close(got, expected)


def test_kernel_rank_pads_the_bond_on_cpu_only(monkeypatch):
    """Multiples of 8, at least 16, on CPU (where it was measured); elsewhere, or switched off, the rank itself."""
    assert [planner.autograd.kernel_rank(r, "cpu") for r in (1, 7, 13, 16, 17, 24, 30, 32, 33)] == [
        16,
        16,
        16,
        16,
        24,
        24,
        32,
        32,
        40,
    ]
    assert planner.autograd.kernel_rank(30, "cuda") == 30
    monkeypatch.setattr(planner.autograd, "PAD_RANKS", False)
    assert planner.autograd.kernel_rank(7, "cpu") == 7


def test_padding_saves_only_the_padded_slices_of_t(monkeypatch):
    """The padded bond costs, in saved bytes, exactly b·(padded − true rank) elements of t over what the cost model
    counts for the true rank (which is what reports show); with padding off, exactly the counted bytes."""
    layout = TTMatrix.random(
        120, 96, format=TTFormat.TT, row_modes=(4, 5, 6), col_modes=(4, 4, 6), max_rank=5, std=1.0, dtype=torch.float64
    ).layout
    planned = layers.choose_plan(layers.planned_envelope(layout, "matmul", device="cpu"), 64)
    chosen = planner.Plan.from_tree(planned.network, planned.tree, planner.CostModel(itemsize=8))
    first, _ = planner.plan_runner(chosen).two_factor
    rank = chosen.steps[first].n
    counted = chosen.terms.bytes_saved[1]  # bytes per row of x, float64
    cores = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in layout.core_shapes]
    for pad, extra in ((True, planner.autograd.kernel_rank(rank, "cpu") - rank), (False, 0)):
        monkeypatch.setattr(planner.autograd, "PAD_RANKS", pad)
        totals = []
        for batch in (10, 20):
            x = torch.randn(batch, 120, dtype=torch.float64, requires_grad=True)
            saved = saved_for_backward(lambda x, *c: planner.execute_function(chosen, x, c, layout), x, *cores)
            totals.append(sum(nbytes for _, nbytes in saved))
        assert extra > 0 or not pad
        assert (totals[1] - totals[0]) // 10 == counted + 8 * extra, (pad, totals, counted, extra)


# -------------------------------------------------------------------------------------------- saved tensors


def saved_for_backward(fn, *args):
    """(element count, bytes) of every tensor autograd saves while running fn(*args)."""
    saved = []

    def pack(t):
        saved.append((t.numel(), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*args)
    y.sum().backward()  # the unpacked tensors really serve the backward
    return saved


@given(
    data=st.data(),
    spec=tt_specs(max_modes=3, max_rank=5, dead_gates=False),
    op=st.sampled_from(planner.OPS),
    x_grad=st.booleans(),
    batches=st.tuples(st.integers(1, 9), st.integers(10, 20)),
)
def test_saved_tensors_are_what_the_cost_model_counts(data, spec, op, x_grad, batches):
    with pytest.MonkeyPatch.context() as patch:  # the padded bond: test_padding_saves_only_the_padded_slices_of_t
        patch.setattr(planner.autograd, "PAD_RANKS", False)
        _check_saved_tensors_against_the_cost_model(data, spec, op, x_grad, batches)


def _check_saved_tensors_against_the_cost_model(data, spec, op, x_grad, batches):
    layout = spec.layout
    net = planner.build_network(layout, op)
    tree = data.draw(random_trees(net.n_tensors))
    model = planner.CostModel(itemsize=8, x_requires_grad=x_grad)
    chosen = planner.Plan.from_tree(net, tree, model)
    counted = chosen.terms.bytes_saved
    assert counted[0] == 0  # only activations (b-dependent) are counted
    n_in = layout.rows if op == "matmul" else layout.cols
    per_batch = []
    for batch in batches:
        x = torch.randn(batch, n_in, dtype=torch.float64, requires_grad=x_grad)
        cores = [c.detach().clone().requires_grad_() for c in spec.cores]
        per_batch.append(saved_for_backward(lambda x, *c: planner.execute_function(chosen, x, c, layout), x, *cores))
    small, large = per_batch
    assert len(small) == len(large) == 2 * len(chosen.steps)  # the two operands of each GEMM, nothing else
    grows = [(s, l) for s, l in zip(small, large) if s != l]
    assert len(grows) == sum(step.batched for step in chosen.steps)
    for batch, saved in zip(batches, per_batch):
        bytes_b = sum(
            nbytes
            for (numel, nbytes), other in zip(saved, small if saved is large else large)
            if (numel, nbytes) != other
        )
        assert bytes_b == counted[1] * batch, (str(chosen), batch, bytes_b, counted)


# ------------------------------------------------------------------------------------------------- tracing


def _small_linear():
    tt = TTMatrix.random(
        24,
        20,
        format=TTFormat.TT,
        row_modes=(2, 3, 4),
        col_modes=(4, 5),
        max_rank=3,
        std=1.0,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        for gate in tt.gates:
            gate.uniform_(0.5, 1.5)
    return TTLinear(tt)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiles_fullgraph_dynamic_with_planned_backward(monkeypatch, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(layers, "CUSTOM_AUTOGRAD", True)
    linear = _small_linear()
    linear.tt.prepare_plans()
    envelope = layers.planned_envelope(linear.tt.layout, "matmul", device="cpu")
    piece = envelope.pieces[-1]  # two sizes in the last interval share one graph
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(linear, backend=counter, fullgraph=True, dynamic=True)
    n = len(linear.tt.cores)
    params = [*linear.tt.cores, *linear.tt.gates]
    for batch in (piece.first + 1, piece.first + 5):
        x = torch.randn(batch, 24, dtype=torch.float64, requires_grad=True)
        y = compiled(x)
        dy = torch.randn(y.shape, dtype=torch.float64)
        got = torch.autograd.grad(y, [x, *params], dy)
        leaves = [t.detach().requires_grad_() for t in (x, *params)]
        want_y = leaves[0] @ dense_reference(leaves[1 : 1 + n], leaves[1 + n :], linear.tt.layout)
        want = torch.autograd.grad(want_y, leaves, dy)
        assert_rel_close(y, want_y)
        for g, w in zip(got, want):
            assert_rel_close(g, w)
    assert counter.frame_count == 1, counter.frame_count
    torch._dynamo.reset()


def test_backward_under_cpu_autocast_matches_float32():
    """Autocast runs the forward GEMMs in bf16 on fp32 cores, so backward meets a bf16 gradient and fp32 operands
    (it raised "expected m1 and m2 to have the same dtype" before the planned backward promoted them)."""
    import copy

    import comera_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), comera_fx.TTLinear.from_dense(torch.nn.Linear(128, 64), max_rank=4)
    )
    reference = copy.deepcopy(model)
    assert_bf16_autocast_grads_close(model, reference, torch.randn(32, 64))


def test_backward_gemms_run_in_the_forwards_autocast_dtype():
    """Under bf16 autocast the planned backward's GEMMs run in bf16 as autocast runs a built-in op's backward in its
    forward's dtype (they ran in fp32 before: the operands were promoted), and the cores still get fp32 gradients."""
    import comera_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = comera_fx.TTLinear.from_dense(torch.nn.Linear(128, 64), max_rank=4)
    x = torch.randn(32, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    with GemmDtypes() as backward:
        y.float().sum().backward()
    assert backward.seen and set(backward.seen) == {torch.bfloat16}
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters()) and x.grad.dtype == torch.float32
