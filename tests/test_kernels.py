"""Triton kernels of comera_fx.tt.kernels against the aten code of comera_fx.tt.ops, forward and backward.

The tests marked ``triton`` need triton: on a CUDA machine they run the compiled kernels; on CPU they run them in
Triton's interpreter (``TRITON_INTERPRET=1 pytest -m triton tests/test_kernels.py``, about 1.5 min for the 200
examples per property of the ci profile; .ci/run does this after the default suite). Without triton they skip;
the unmarked tests check the aten fallback and run everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_fx.tt import kernels
from comera_fx.testing.strategies import batch_shapes, index_tensors, tt_specs
from comera_fx.tt import ops
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.layout import TTFormat, TTLayout


def _kernel_device() -> torch.device:
    """The device the kernels run on here, or skip with the reason."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'comera_fx[triton]')")
    if not kernels.triton_available():
        pytest.skip(f"the kernels failed to load: {kernels._impl_error}")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not kernels._load().interpreted():
        pytest.skip("no CUDA device and triton not in interpret mode: set TRITON_INTERPRET=1 to run the kernels on CPU")
    return torch.device("cpu")


@pytest.fixture
def device() -> torch.device:
    return _kernel_device()


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    scale = 1.0 + expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale)


def _leaves(tensors, device):
    return [t.detach().to(device).requires_grad_() for t in tensors]


def _check_take_rows(
    index, cores, gates, layout, *, pre_gated: bool, dedup: bool, tol: float = 1e-4, expect_kernel: bool = True
):
    ref_cores, ref_gates = _leaves(cores, "cpu"), _leaves(gates, "cpu")
    ref_cores64 = [c.detach().double().requires_grad_() for c in ref_cores]
    ref_gates64 = [g.detach().double().requires_grad_() for g in ref_gates]
    ref = ops.take_rows(index.cpu(), ops.gate_cores(ref_cores64, ref_gates64, layout), layout)

    device = cores[0].device
    if pre_gated:
        out = kernels.take_rows(index, ops.gate_cores(cores, gates, layout), layout, dedup=dedup)
    else:
        out = kernels.take_rows(index, cores, layout, gates, dedup=dedup)
    assert out.shape == ref.shape and out.dtype == cores[0].dtype and out.device == device
    _close(out.detach().double().cpu(), ref.detach(), tol)
    if ref.numel() == 0:
        return
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(ref, ref_cores64 + ref_gates64, grad, allow_unused=True)
    actual = torch.autograd.grad(out, list(cores) + list(gates), grad.to(device, out.dtype), allow_unused=True)
    for name, a, e in zip(
        [f"core {k}" for k in range(len(cores))] + [f"gate {k}" for k in range(len(gates))], actual, expected
    ):
        e = torch.zeros_like(ref_cores64[0]) if e is None else e
        a = torch.zeros_like(e) if a is None else a.double().cpu()
        try:
            _close(a, e, tol)
        except AssertionError as err:
            raise AssertionError(f"gradient of {name}: {err}") from None


# ------------------------------------------------------------------------------------------ kernels vs aten


@pytest.mark.triton
@given(
    spec=tt_specs(dtype=torch.float32, formats=(TTFormat.TTM,), max_modes=3, max_rank=6),
    data=st.data(),
    pre_gated=st.booleans(),
    dedup=st.booleans(),
)
def test_take_rows_matches_aten(spec, data, pre_gated, dedup):
    device = _kernel_device()
    layout = spec.layout
    index = data.draw(index_tensors(layout.rows, batch_shapes=batch_shapes(max_dims=2, max_side=4)), label="index")
    cores, gates = _leaves(spec.cores, device), _leaves(spec.gates, device)
    _check_take_rows(index.to(device), cores, gates, layout, pre_gated=pre_gated, dedup=dedup)


@pytest.mark.triton
@given(spec=tt_specs(dtype=torch.float32, formats=(TTFormat.TTM,), max_modes=4, max_rank=5), gate_last=st.booleans())
def test_gated_merge_matches_aten(spec, gate_last):
    device = _kernel_device()
    layout = spec.layout
    n = len(spec.cores)
    cores = _leaves(spec.cores, device)
    # A chain's own last bond is gated when it is the left half of a split chain: add a gate for it.
    extra = [torch.linspace(-1.5, 2.0, layout.ranks[-1])] if gate_last else []
    gates = _leaves(list(spec.gates) + extra, device)
    out = kernels.gated_ttm_merge(cores, gates, layout.row_modes, layout.col_modes, layout.ranks, fused=True)

    ref_cores = [c.detach().double().cpu().requires_grad_() for c in cores]
    ref_gates = [g.detach().double().cpu().requires_grad_() for g in gates]
    gated = [c * g for c, g in zip(ref_cores, ref_gates)] + ref_cores[len(ref_gates) :]
    ref = ops.ttm_merge(gated, layout.row_modes, layout.col_modes, layout.ranks)
    assert out.shape == ref.shape and len(gates) in (n, n - 1)
    _close(out.detach().double().cpu(), ref.detach())
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = torch.autograd.grad(ref, ref_cores + ref_gates, grad)
    actual = torch.autograd.grad(out, cores + gates, grad.to(device, out.dtype))
    for a, e in zip(actual, expected):
        _close(a.double().cpu(), e)


@pytest.mark.triton
def test_take_rows_several_tiles(device):
    """Halves wider than one tile (B_R = 132 > 128), a rank over one tile (70 > 64) and repeated ids."""
    layout = TTLayout(TTFormat.TTM, 37, 250, (2, 5, 4), (3, 11, 12), (1, 3, 70, 1))
    generator = torch.Generator().manual_seed(0)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=generator), device)
    gates = _leaves([torch.rand(r, generator=generator) + 0.5 for r in layout.internal_ranks], device)
    index = torch.tensor([[0, 36, 5], [5, 17, 36]], device=device)
    _check_take_rows(index, cores, gates, layout, pre_gated=False, dedup=False)
    _check_take_rows(index, cores, gates, layout, pre_gated=False, dedup=True)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_take_rows_half_precision(device, dtype):
    """Low-precision tables accumulate in float32; compared with the float64 reference at that dtype's precision.
    (bfloat16 dots are upcast in interpret mode, whose tl.dot does not support bf16.)"""
    layout = TTLayout(TTFormat.TTM, 60, 24, (3, 4, 5), (2, 3, 4), (1, 4, 6, 1))
    generator = torch.Generator().manual_seed(3)
    cores = _leaves([c.to(dtype) for c in random_tt_cores(layout.core_shapes, 1.0, generator=generator)], device)
    gates = _leaves([(torch.rand(r, generator=generator) + 0.5).to(dtype) for r in layout.internal_ranks], device)
    index = torch.tensor([0, 59, 13, 13, 42], device=device)
    _check_take_rows(index, cores, gates, layout, pre_gated=False, dedup=False, tol=5e-2)


@pytest.mark.triton
def test_take_rows_compiles_fullgraph(device, monkeypatch):
    """fullgraph=True traces through the dispatcher; the forward graph calls comera_fx::ttm_lookup and (with the
    fused merge switched on) comera_fx::gated_merge, the backward graph comera_fx::ttm_lookup_backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(kernels, "FUSED_MERGE", True)

    layout = TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1))
    generator = torch.Generator().manual_seed(4)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=generator), device)
    gates = _leaves([torch.rand(r, generator=generator) + 0.5 for r in layout.internal_ranks], device)
    index = torch.randint(0, layout.rows, (2, 5), generator=generator).to(device)
    graphs = {}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.code
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    fn = torch.compile(
        lambda i, c, g: kernels.take_rows(i, c, layout, g),
        fullgraph=True,
        backend=aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward")),
    )
    # Under the interpreter the kernels are not JIT functions, so AOTAutograd cannot decompose the triton_op into
    # its kernel launches (it would run them on functional tensors): keep the ops opaque there. On CUDA the ops are
    # decomposed as Inductor would see them.
    interpret = device.type == "cpu"
    with torch._functorch.config.patch(decompose_custom_triton_ops=not interpret):
        out = fn(index, cores, gates)
        grads = torch.autograd.grad(out.sum(), cores + gates)
    eager = kernels.take_rows(index, cores, layout, gates)
    eager_grads = torch.autograd.grad(eager.sum(), cores + gates)
    _close(out.detach(), eager.detach(), 1e-5)
    for a, e in zip(grads, eager_grads):
        _close(a, e, 1e-5)
    if interpret:
        assert "comera_fx.ttm_lookup.default" in graphs["forward"]
        assert "comera_fx.gated_merge.default" in graphs["forward"]
        assert "comera_fx.ttm_lookup_backward.default" in graphs["backward"]
    else:
        assert "triton_kernel_wrapper" in graphs["forward"] and "triton_kernel_wrapper" in graphs["backward"]


@pytest.mark.triton
def test_cpu_without_interpret_uses_aten(monkeypatch):
    """With triton importable but TRITON_INTERPRET unset, CPU tensors take the aten path, never the kernels."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'comera_fx[triton]')")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout = TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1))
    cores = random_tt_cores(layout.core_shapes, 1.0, generator=torch.Generator().manual_seed(5))
    gates = [torch.rand(r) + 0.5 for r in layout.internal_ranks]
    assert kernels.kernel_path(*cores, *gates) == "aten"
    impl = kernels._load()
    if impl is not None:

        def refuse(*args, **kwargs):
            raise AssertionError("the Triton kernel ran on CPU tensors outside interpret mode")

        monkeypatch.setattr(impl, "ttm_lookup", refuse)
        monkeypatch.setattr(impl, "gated_merge", refuse)
    index = torch.tensor([[1, 44], [7, 7]])
    out = kernels.take_rows(index, cores, layout, gates)
    torch.testing.assert_close(out, ops.take_rows(index, ops.gate_cores(cores, gates, layout), layout))


@pytest.mark.triton
def test_the_lookup_merges_its_halves_with_aten_by_default(device, monkeypatch):
    """FUSED_MERGE is off: the lookup kernel runs, the fused merge kernel does not, and the result is unchanged."""
    impl = kernels._load()
    layout = TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1))
    generator = torch.Generator().manual_seed(8)
    cores = _leaves(random_tt_cores(layout.core_shapes, 1.0, generator=generator), device)
    gates = _leaves([torch.rand(r, generator=generator) + 0.5 for r in layout.internal_ranks], device)
    index = torch.randint(0, layout.rows, (3, 4), generator=generator).to(device)
    monkeypatch.setattr(kernels, "FUSED_MERGE", True)
    fused = kernels.take_rows(index, cores, layout, gates)
    lookups = []
    original = impl.ttm_lookup

    def counted(*args, **kwargs):
        lookups.append(1)
        return original(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused merge ran with FUSED_MERGE off")

    monkeypatch.setattr(kernels, "FUSED_MERGE", False)
    monkeypatch.setattr(impl, "ttm_lookup", counted)
    monkeypatch.setattr(impl, "gated_merge", refuse)
    out = kernels.take_rows(index, cores, layout, gates)
    assert lookups
    _close(out.detach(), fused.detach(), 1e-5)


# ------------------------------------------------------------------------------------------ low-rank chain


def _chain_reference(x, left, right, bias):
    """float64 leaves on CPU and x @ left @ right (+ bias): the independent reference of the fused chain."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, left, right)]
    if bias is not None:
        leaves.append(bias.detach().double().cpu().requires_grad_())
    out = leaves[0] @ leaves[1] @ leaves[2]
    return (out + leaves[3] if bias is not None else out), leaves


@pytest.mark.triton
@given(
    m=st.integers(0, 70),
    k=st.integers(1, 40),
    r=st.integers(1, 40),
    n=st.integers(1, 140),
    with_bias=st.booleans(),
    programs=st.sampled_from([0, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_lowrank_chain_matches_float64(m, k, r, n, with_bias, programs, seed):
    """x @ L @ R (+ bias) and its gradients, against float64: row tiles, column splits (``programs`` above the
    row tiles) and ranks under and over one 16-wide tile; m = 0 is an empty batch."""
    device = _kernel_device()
    generator = torch.Generator().manual_seed(seed)
    shapes = [(m, k), (k, r), (r, n)] + ([(n,)] if with_bias else [])
    tensors = [(torch.randn(shape, generator=generator)).to(device).requires_grad_() for shape in shapes]
    x, left, right = tensors[:3]
    bias = tensors[3] if with_bias else None
    out = kernels.lowrank_product(x, left, right, bias, programs=programs)
    ref, ref_leaves = _chain_reference(x, left, right, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    _close(out.detach().double().cpu(), ref.detach())
    grad = torch.randn((m, n), dtype=torch.float64, generator=generator)
    expected = torch.autograd.grad(ref, ref_leaves, grad)
    actual = torch.autograd.grad(out, tensors, grad.to(device, torch.float32))
    for name, a, e in zip(("x", "left", "right", "bias"), actual, expected):
        try:
            _close(a.double().cpu(), e)
        except AssertionError as err:
            raise AssertionError(f"gradient of {name}: {err}") from None


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lowrank_chain_half_precision(device, dtype):
    """Low precision accumulates in float32, the intermediate rounded to the dtype as aten's two GEMMs store it."""
    generator = torch.Generator().manual_seed(11)
    x, left, right, bias = (
        (torch.randn(shape, generator=generator) / 4).to(device, dtype).requires_grad_()
        for shape in ((33, 48), (48, 20), (20, 70), (70,))
    )
    out = kernels.lowrank_product(x, left, right, bias)
    ref, ref_leaves = _chain_reference(x, left, right, bias)
    assert out.dtype == dtype
    _close(out.detach().double().cpu(), ref.detach(), 3e-2)
    for a, e in zip(torch.autograd.grad(out.sum(), (x, left, right, bias)), torch.autograd.grad(ref.sum(), ref_leaves)):
        _close(a.double().cpu(), e, 3e-2)


@pytest.mark.triton
@given(spec=tt_specs(dtype=torch.float32, formats=(TTFormat.TT,), max_modes=3, max_rank=6), data=st.data())
def test_tt_layers_run_the_fused_chain(spec, data):
    """With FUSED_CHAIN on, TTMatrix.matmul / matmul_t (gates folded, padded layouts, any batch shape) run the fused
    kernel, and values and the gradients of x, cores, gates and bias match float64 dense."""
    device = _kernel_device()
    impl = kernels._load()
    layout = spec.layout
    op = data.draw(st.sampled_from(["matmul", "matmul_t"]), label="op")
    n_in, n_out = (layout.rows, layout.cols) if op == "matmul" else (layout.cols, layout.rows)
    batch = data.draw(batch_shapes(max_dims=2, max_side=5), label="batch")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(*batch, n_in, generator=generator).to(device).requires_grad_()
    bias = torch.randn(n_out, generator=generator).to(device).requires_grad_()
    matrix = spec.matrix().to(device)
    calls = []
    original = impl and kernels._chain_impl.lowrank_chain

    def counted(*args):
        calls.append(1)
        return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "FUSED_CHAIN", True)
        patch.setattr(kernels._chain_impl, "lowrank_chain", counted)
        out = getattr(matrix, op)(x, bias)
    assert calls, "the fused chain did not run"
    params = [x, *matrix.cores, *matrix.gates, bias]
    ref_params = [p.detach().double().cpu().requires_grad_() for p in params]
    ref_x, ref_cores, ref_gates, ref_bias = (
        ref_params[0],
        ref_params[1 : 1 + len(matrix.cores)],
        ref_params[1 + len(matrix.cores) : -1],
        ref_params[-1],
    )
    dense = ops.to_dense(ops.gate_cores(ref_cores, ref_gates, layout), layout)
    ref = ref_x @ (dense if op == "matmul" else dense.t()) + ref_bias
    _close(out.detach().double().cpu(), ref.detach())
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=generator)
    for a, e in zip(
        torch.autograd.grad(out, params, grad.to(device, out.dtype)), torch.autograd.grad(ref, ref_params, grad)
    ):
        _close(a.double().cpu(), e)


@pytest.mark.triton
def test_tt_linear_chain_compiles_fullgraph(device, monkeypatch):
    """Under torch.compile(fullgraph=True) a TT linear with FUSED_CHAIN on calls comera_fx::lowrank_chain forward
    and backward; values and gradients equal eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from comera_fx.tt.layers import TTLinear

    monkeypatch.setattr(kernels, "FUSED_CHAIN", True)
    torch.manual_seed(12)
    layer = TTLinear.from_dense(torch.nn.Linear(48, 40), max_rank=6).to(device)
    assert layer.tt.layout.format is TTFormat.TT
    x = torch.randn(3, 7, 48, device=device, requires_grad=True)
    graphs = {}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.code
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    compiled = torch.compile(
        layer, fullgraph=True, backend=aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))
    )
    params = [x, *layer.parameters()]
    interpret = device.type == "cpu"  # see test_take_rows_compiles_fullgraph
    with torch._functorch.config.patch(decompose_custom_triton_ops=not interpret):
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), params)
    eager = layer(x)
    for a, e in zip([out, *grads], [eager, *torch.autograd.grad(eager.square().sum(), params)]):
        _close(a.detach(), e.detach(), 1e-5)
    if interpret:
        assert "comera_fx.lowrank_chain.default" in graphs["forward"]
        assert "comera_fx.lowrank_chain.default" in graphs["backward"]
    else:
        assert "triton_kernel_wrapper" in graphs["forward"] and "triton_kernel_wrapper" in graphs["backward"]


# ------------------------------------------------------------------------------------ aten fallback (no triton)


def test_fallback_matches_ops(monkeypatch):
    """With the kernels switched off, take_rows / gated_ttm_merge are exactly the ops.py code (also the dedup
    path and TT layouts)."""
    monkeypatch.setattr(kernels, "ENABLED", False)
    generator = torch.Generator().manual_seed(6)
    for layout in (
        TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1)),
        TTLayout(TTFormat.TT, 30, 20, (5, 6), (4, 5), (1, 3, 4, 2, 1)),
    ):
        cores = random_tt_cores(layout.core_shapes, 1.0, generator=generator)
        gates = [torch.rand(r, generator=generator) + 0.5 for r in layout.internal_ranks]
        index = torch.randint(0, layout.rows, (3, 4), generator=generator)
        index[0, 0] = index[1, 1]
        expected = ops.take_rows(index, ops.gate_cores(cores, gates, layout), layout)
        assert kernels.kernel_path(*cores) == "aten"
        torch.testing.assert_close(kernels.take_rows(index, cores, layout, gates), expected)
        torch.testing.assert_close(kernels.take_rows(index, ops.gate_cores(cores, gates, layout), layout), expected)
        torch.testing.assert_close(kernels.take_rows(index, cores, layout, gates, dedup=True), expected)
    layout = TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1))
    cores = random_tt_cores(layout.core_shapes, 1.0, generator=generator)
    gates = [torch.rand(r, generator=generator) + 0.5 for r in layout.internal_ranks]
    torch.testing.assert_close(
        kernels.gated_ttm_merge(cores, gates, layout.row_modes, layout.col_modes, layout.ranks),
        ops.ttm_merge(ops.gate_cores(cores, gates, layout), layout.row_modes, layout.col_modes, layout.ranks),
    )


def test_chain_is_opt_in_and_falls_back_to_aten(monkeypatch):
    """FUSED_CHAIN is off by default; on, CPU tensors without the interpreter and TTM layouts still take aten, and
    ``lowrank_product``'s fallback is exactly x @ L @ R + bias."""
    assert kernels.FUSED_CHAIN is False
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "FUSED_CHAIN", True)
    generator = torch.Generator().manual_seed(13)
    tt = TTLayout(TTFormat.TT, 30, 20, (5, 6), (4, 5), (1, 3, 4, 2, 1))
    ttm = TTLayout(TTFormat.TTM, 45, 20, (3, 4, 4), (2, 3, 4), (1, 3, 5, 1))
    x = torch.randn(4, 30, generator=generator)
    assert not kernels.chain_applies(x, random_tt_cores(tt.core_shapes, 1.0, generator=generator), tt)
    monkeypatch.setattr(kernels, "kernel_path", lambda *tensors: "triton")
    assert kernels.chain_applies(x, random_tt_cores(tt.core_shapes, 1.0, generator=generator), tt)
    assert not kernels.chain_applies(x, random_tt_cores(ttm.core_shapes, 1.0, generator=generator), ttm)
    assert not kernels.chain_applies(x, [], tt, fused=False)
    monkeypatch.undo()
    left, right, bias = torch.randn(30, 3, generator=generator), torch.randn(3, 7, generator=generator), torch.randn(7)
    torch.testing.assert_close(kernels.lowrank_product(x, left, right, bias), x @ left @ right + bias)


def test_cpu_tensors_take_aten_path_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.kernel_path(torch.zeros(3), torch.zeros(2)) == "aten"
    assert kernels.kernel_path(torch.zeros(3, dtype=torch.float64)) == "aten"


def test_import_loads_no_kernels():
    """Importing comera_fx (and the kernels package) neither defines the triton ops nor fails without triton."""
    code = (
        "import sys, comera_fx, comera_fx.tt.kernels as k; "
        "print('comera_fx.tt.kernels._triton' in sys.modules, hasattr(__import__('torch').ops.comera_fx, "
        "'ttm_lookup'))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
