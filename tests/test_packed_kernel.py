"""``comera_fx.packed.cpu_kernel``: the int4 / int8 product that reads codes inside the GEMM, against float64."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from comera_fx.packed import PackedLinear, cpu_kernel
from comera_fx.packed.linear import to_row_blocks
from comera_fx.quantize import QuantSpec, dequantize, quantize_groups

needs_kernel = pytest.mark.skipif(
    not cpu_kernel.enabled(), reason="the packed CPU kernel needs AVX-512 or AVX2 (this CPU has neither)"
)


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """Each test on this CPU's build of the kernel and on the AVX2 build (which an AVX-512 CPU also runs)."""
    if request.param == "avx2":
        monkeypatch.setenv("COMERA_FX_CPU_KERNEL", "avx2")
    if cpu_kernel.library() is None:
        pytest.skip("no packed CPU kernel on this machine (it needs AVX2 or AVX-512 and a C++ compiler)")
    return cpu_kernel.isa()


def weight64(linear: nn.Linear, spec: QuantSpec) -> torch.Tensor:
    codes, scales = quantize_groups(linear.weight.detach(), spec)
    return dequantize(codes, scales, spec, tuple(linear.weight.shape), torch.float64)


@pytest.fixture
def calls(monkeypatch):
    """How often packed layers called the kernel."""
    count = []
    real = cpu_kernel.product

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "product", counted)
    return count


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, None), (4, 16), (4, 32), (8, None), (8, 16), (8, 96)])
@pytest.mark.parametrize("rows", [16, 48, 80, 128])  # one row block; tails after tiles of four blocks
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_product_is_the_float64_product(bits, group, rows, bias, build):
    """Every tile shape: 0-13 tokens (tiles of six and each tail count) and 64; the product of the codes'
    float64 weight (``quantize_groups`` + ``dequantize``, independent of the kernel's layout) within fp32 error."""
    lib = cpu_kernel.library()
    torch.manual_seed(rows + bits + (group or 0))
    linear = nn.Linear(96, rows, bias=bias)
    spec = QuantSpec(bits, group)
    layer = PackedLinear.from_linear(linear, spec)
    weight = weight64(linear, spec)
    for tokens in (0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 64):
        x = torch.randn(tokens, 96)
        out = cpu_kernel.product(
            lib, bits, x, layer.codes, layer.scales, layer.kgroup, linear.bias.detach() if bias else None
        )
        expected = x.double() @ weight.t() + (linear.bias.detach().double() if bias else 0)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


@needs_kernel
def test_packed_layers_take_the_kernel_only_where_it_is_right(calls):
    """Eager calls without a recorded gradient of x go to the kernel (any leading shape, non-contiguous x); calls
    recording x's gradient, other dtypes, layers whose rows do not fill blocks of 16, and traced calls do not. A
    bias that records its gradient gets it."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    spec = QuantSpec(4, 32)
    layer = PackedLinear.from_linear(linear, spec)
    weight = weight64(linear, spec)
    x = torch.randn(8, 3, 64).transpose(0, 1)  # not contiguous
    expected = x.double() @ weight.t() + linear.bias.detach().double()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=2e-5)
    assert len(calls) == 2
    out = layer(x)  # grad mode, x without grad, the bias a parameter: the kernel, the bias added after
    assert len(calls) == 3 and out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((32,), 24.0))
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    assert len(calls) == 3 and xg.grad is not None
    with torch.no_grad():
        wide = copy.deepcopy(layer).double()
        wide(x.double())
        torch.testing.assert_close(wide(x).double(), expected, rtol=0, atol=2e-5)  # float64 scales: not the kernel
        PackedLinear.from_linear(nn.Linear(64, 24), spec)(x)  # 24 rows: held row by row
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x).double(), expected, rtol=0, atol=2e-5)
    assert len(calls) == 3


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_calls_large_enough_split_over_threads_give_the_same_product(threads, calls, build):
    """Below and above ``PARALLEL_MIN_MACS`` (tiles split over OpenMP threads, and the row blocks after the last
    whole tile), on one thread and on two: the kernel, and the float64 product."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 80 + 16 * 4 * 3)  # 3 + 1 tiles of four row blocks and one block more
    spec = QuantSpec(4, 32)
    layer = PackedLinear.from_linear(linear, spec)
    weight = weight64(linear, spec)
    before = torch.get_num_threads()
    big = cpu_kernel.PARALLEL_MIN_MACS // (64 * linear.out_features) + 7
    try:
        torch.set_num_threads(threads)
        for tokens in (5, big):
            x = torch.randn(tokens, 64)
            with torch.no_grad():
                out = layer(x)
            torch.testing.assert_close(
                out.double(), x.double() @ weight.t() + linear.bias.detach().double(), rtol=0, atol=2e-5
            )
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2


def test_a_failed_build_warns_once_and_the_layers_rebuild(monkeypatch, tmp_path):
    """No compiler (or one that fails): one warning naming the switch (when the first layer is built), codes held
    row by row, and the rebuild path's right outputs."""
    monkeypatch.setattr(cpu_kernel, "enabled", lambda: True)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("COMERA_FX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: str(tmp_path / "no-such-compiler"))
    torch.manual_seed(2)
    linear = nn.Linear(32, 16)
    with pytest.warns(RuntimeWarning, match="COMERA_FX_CPU_KERNEL=0"):
        layer = PackedLinear.from_linear(linear, QuantSpec(4, None))
    assert layer.row_block == 1
    x = torch.randn(3, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = layer(x)
            PackedLinear.from_linear(linear, QuantSpec(4, None))(x)
    expected = x.double() @ weight64(linear, QuantSpec(4, None)).t() + linear.bias.detach().double()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


def test_the_switches_turn_the_kernel_off(monkeypatch):
    monkeypatch.setenv("COMERA_FX_CPU_KERNEL", "0")
    assert not cpu_kernel.enabled() and cpu_kernel.library() is None
    monkeypatch.delenv("COMERA_FX_CPU_KERNEL")
    monkeypatch.setattr(cpu_kernel, "USE_KERNEL", False)
    assert not cpu_kernel.enabled() and cpu_kernel.library() is None


@needs_kernel
def test_the_build_is_cached_by_source_and_compiler(monkeypatch, tmp_path):
    """A second build finds the first's library (not compiled again); another source gets another file."""
    monkeypatch.setenv("COMERA_FX_KERNEL_CACHE", str(tmp_path))
    compiler = cpu_kernel._compiler()
    first = cpu_kernel._build(compiler, cpu_kernel.isa())
    stamp = first.stat().st_mtime_ns
    assert cpu_kernel._build(compiler, cpu_kernel.isa()) == first and first.stat().st_mtime_ns == stamp
    changed = tmp_path / "cpu_kernel.cpp"
    changed.write_text(cpu_kernel.SOURCE.read_text() + "\n// another version\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", changed)
    assert cpu_kernel._build(compiler, cpu_kernel.isa()) != first


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_gives_the_codes_row_by_row(bits, dtype, build):
    """``unpack`` of blocked codes: each row's codes (int4 times 16, low codes then high codes; or one half) in
    fp32 or bf16, against the signed codes ``quantize_groups`` gives."""
    torch.manual_seed(bits)
    linear = nn.Linear(64, 48)
    spec = QuantSpec(bits, None)
    layer = PackedLinear.from_linear(linear, spec)
    codes = quantize_groups(linear.weight.detach(), spec)[0].reshape(48, 64).float() * (16 if bits == 4 else 1)
    lib = cpu_kernel.library()
    out = torch.full((48, 64), float("nan"), dtype=dtype)
    cpu_kernel.unpack(lib, bits, layer.codes, 64, out, 0, 3)
    assert torch.equal(out.float(), codes)
    if bits == 4:
        for half in (1, 2):
            part = torch.empty(48, 32, dtype=dtype)
            cpu_kernel.unpack(lib, bits, layer.codes, 64, part, 0, 3, halves=half)
            assert torch.equal(part.float(), codes[:, (half - 1) * 32 : half * 32])


def test_row_blocks_put_each_columns_rows_together():
    rows = torch.arange(32 * 3).reshape(32, 3)
    blocked = to_row_blocks(rows, 16)
    assert blocked.shape == (2, 3, 16) and blocked.is_contiguous()
    assert torch.equal(blocked[1, 2], rows[16:32, 2])


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 16), (8, 32)])
def test_low_rank_packed_tt_layers_run_as_two_kernel_products(bits, group, monkeypatch, build):
    """A low-rank ``PackedTTLinear`` (cores (1, in, r), (r, out, 1)) in eager calls without a recorded gradient of
    x: two ``dense_product`` calls on the cores the kernel dequantized, gates folded; the float64 product of the
    held codes, scales and gates (``packed_tt_reference``) at 1-64 tokens, the bias tracked in grad mode. A
    transposed (tied head) one keeps the planner's path."""
    import comera_fx
    from comera_fx.packed import PackedTTLinear
    from comera_fx.tt.layers import TTLinear
    from test_packed import packed_tt_reference

    count = []
    real = cpu_kernel.dense_product
    monkeypatch.setattr(cpu_kernel, "dense_product", lambda *a, **k: count.append(1) or real(*a, **k))
    torch.manual_seed(bits + group)
    layer = TTLinear.from_dense(nn.Linear(96, 48), max_rank=32, num_modes=1)
    assert layer.tt.layout.core_shapes == [(1, 96, 32), (32, 48, 1)]
    with torch.no_grad():
        layer.tt.gates[0].uniform_(0.5, 1.5)
    comera_fx.quantize_(layer, bits, group)
    packed = PackedTTLinear.from_tt_linear(layer)
    for tokens in (1, 7, 64):
        x = torch.randn(2, tokens, 96)
        with torch.inference_mode():
            out = packed(x)
        torch.testing.assert_close(out.double(), packed_tt_reference(packed, x), rtol=0, atol=2e-5)
    assert len(count) == 6
    out = packed(x)  # grad mode: the bias added after, with its gradient
    assert len(count) == 8
    out.sum().backward()
    torch.testing.assert_close(packed.bias.grad, torch.full((48,), 2.0 * 64))
    head = PackedTTLinear.from_tt_linear(TTLinear(layer.tt, torch.zeros(96), transposed=True))
    with torch.inference_mode():
        head(torch.randn(3, 48))
    assert len(count) == 8
