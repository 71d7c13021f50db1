"""PackedLinear: int8 / int4 (and int3, held as int4) codes in memory (the fp32 weight rebuilt per call), checked
against a float64 matmul on the dequantized weights (``comera_fx.quantize.dequantize``), and kept packed through
state_dict and save/load."""

import copy
import math

import pytest
import torch
from torch import nn

import comera_fx
from comera_fx.packed import PackedLinear, cpu_kernel, kernel_group, pack_linears_
from comera_fx.quantize import QuantSpec, dequantize, fake_quant, quantize_groups

CASES = [(8, 32), (8, 64), (8, None), (8, 384), (4, 32), (4, 64), (4, 128), (4, None), (4, 384), (3, 32), (3, None)]


@pytest.fixture(params=["kernel", "rebuild"])
def packed_path(request, monkeypatch):
    """Each eager product both ways: ``cpu_kernel`` (where this CPU builds it) and the weight rebuilt."""
    if request.param == "rebuild":
        monkeypatch.setattr(cpu_kernel, "USE_KERNEL", False)
    elif cpu_kernel.library() is None:
        pytest.skip("no packed CPU kernel on this machine (it needs AVX-512 and a C++ compiler)")
    return request.param


def reference(linear: nn.Linear, spec: QuantSpec, x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_groups(linear.weight.detach(), spec)
    weight = dequantize(codes, scales, spec, tuple(linear.weight.shape), torch.float64)
    return x.double() @ weight.t() + linear.bias.double()


@pytest.mark.parametrize("bits,group", CASES)
def test_packed_output_is_the_dequantized_weights_matmul(bits, group, packed_path):
    torch.manual_seed(bits + (group or 0))
    linear = nn.Linear(128, 48)
    spec = QuantSpec(bits, group)
    packed = PackedLinear.from_linear(linear, spec)
    for shape in [(3, 5, 128), (2, 100, 128)]:  # fewer tokens than the input width, and more: both products
        x = torch.randn(shape)
        with torch.no_grad():
            out = packed(x)
        assert out.shape == (*shape[:-1], 48)
        torch.testing.assert_close(out.double(), reference(linear, spec, x), rtol=0, atol=2e-5)
    assert torch.equal(packed.dequantized(), fake_quant(linear.weight.detach(), bits, group))
    held = QuantSpec(packed.held_bits, group).nbytes(linear.weight.numel())  # int3 held as int4
    assert packed.nbytes() <= 1.3 * held  # held as codes, not fp32


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32), (3, 64)])
def test_state_dict_round_trip_and_portable_form(bits, group):
    torch.manual_seed(1)
    linear = nn.Linear(64, 32)
    packed = PackedLinear.from_linear(linear, QuantSpec(bits, group))
    state = packed.state_dict()
    assert set(state) == {"weight", "weight_scales", "bias"}
    assert state["weight"].numel() == 64 * 32 * bits // 8  # the portable form: bits a code (int3 held as int4)
    assert packed.codes.numel() == 64 * 32 * (8 if bits == 8 else 4) // 8
    fresh = PackedLinear(64, 32, QuantSpec(bits, group))
    fresh.load_state_dict(state)
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), packed(x))
    with pytest.raises(RuntimeError, match="weight_scales"):
        PackedLinear(64, 32, QuantSpec(bits, group)).load_state_dict({"weight": state["weight"], "bias": state["bias"]})


@pytest.mark.parametrize("old_format", [None, 2])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_a_module_pickled_whole_by_older_code_loads_its_codes_right(bits, group, old_format, tmp_path):
    """Older pickles, rebuilt here from the codes' definition: before ``code_format`` an int4 nibble held code + 8;
    up to format 2 codes and scales were held row by row (nibbles: low = input j, high = input j + in/2). Each must
    load to the weight it stood for."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32)
    spec = QuantSpec(bits, group)
    packed = PackedLinear.from_linear(linear, spec)
    codes = quantize_groups(linear.weight.detach().float(), spec)[0].reshape(32, 64)  # signed codes, out x in
    if bits == 4:
        nibbles = (codes.to(torch.int16) + (8 if old_format is None else 0)).to(torch.uint8) & 0xF
        packed.codes = nibbles[:, :32] | (nibbles[:, 32:] << 4)
    else:
        packed.codes = codes.to(torch.int8).contiguous()
    packed.scales = packed.row_scales()
    del packed.row_block
    if old_format is None:
        del packed.code_format
    else:
        packed.code_format = old_format
    torch.save(packed, tmp_path / "old.pt")
    loaded = torch.load(tmp_path / "old.pt", weights_only=False)
    assert loaded.codes.shape == (2, 64 if bits == 8 else 32, 16)
    assert torch.equal(loaded.dequantized(), fake_quant(linear.weight.detach(), bits, group))
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).double(), reference(linear, spec, x), rtol=0, atol=2e-5)


def test_groups_without_a_kernel_layout_are_refused():
    with pytest.raises(ValueError, match="divides"):
        kernel_group(QuantSpec(8, 40), 32, 64)
    with pytest.raises(ValueError, match="odd"):
        kernel_group(QuantSpec(4, 33), 8, 33)


def build():
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40))


def test_pack_linears_and_save_load_keep_the_layers_packed(tmp_path):
    torch.manual_seed(2)
    model = build()
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="^0$")
    comera_fx.quantize_(model, 8, 64, dense_linears=True, include="^2$")
    comera_fx.quantize_(model, 4, 40, dense_linears=True, include="^4$")  # groups of 40 straddle 48-wide rows
    x = torch.randn(6, 128)
    expected = model(x).detach()
    comera_fx.save_tensorized(model, tmp_path / "fake.st")
    loaded = comera_fx.load_tensorized(tmp_path / "fake.st", build, pack=True)
    assert [type(m).__name__ for m in loaded] == ["PackedLinear", "ReLU", "PackedLinear", "ReLU", "Linear"]
    assert loaded[0].spec.bits == 4 and loaded[2].spec.bits == 8
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=1e-5)
    packed = copy.deepcopy(model)
    left = pack_linears_(packed)
    assert list(left) == ["4"] and "40" in left["4"]
    torch.testing.assert_close(packed(x), expected, rtol=0, atol=1e-5)
    comera_fx.save_tensorized(packed, tmp_path / "packed.st")
    again = comera_fx.load_tensorized(tmp_path / "packed.st", build)
    assert isinstance(again[0], PackedLinear) and isinstance(again[2], PackedLinear)
    assert torch.equal(again(x), packed(x))
    path = tmp_path / "whole.pt"
    torch.save(packed, path)
    assert torch.equal(torch.load(path, weights_only=False)(x), packed(x))


def test_saved_packed_files_hold_the_portable_codes_once(tmp_path, monkeypatch):
    """A packed model's file holds its codes in the state_dict's portable form only (not also its in-memory
    layout, which older versions wrote beside it), keeps a real non-persistent buffer, and a file of such an older
    version (its raw buffers in another layout) still loads right."""
    from comera_fx import checkpoint
    from comera_fx.checkpoint import _read

    torch.manual_seed(4)
    model = build()
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="^0$")
    packed = copy.deepcopy(model)
    pack_linears_(packed)
    packed.register_buffer("seen", torch.arange(3.0), persistent=False)
    x = torch.randn(6, 128)
    comera_fx.save_tensorized(packed, tmp_path / "packed.st")
    _, tensors = _read(tmp_path / "packed.st")
    assert "__comera_fx_nonpersistent__.seen" in tensors
    assert not any(key.endswith((".codes", ".scales")) for key in tensors)

    def build_seen():
        model = build()
        model.register_buffer("seen", torch.zeros(3), persistent=False)
        return model

    again = comera_fx.load_tensorized(tmp_path / "packed.st", build_seen)
    assert torch.equal(again(x), packed(x)) and torch.equal(again.seen, torch.arange(3.0))
    older = {"0.codes": torch.zeros(64, 64, dtype=torch.uint8), "0.scales": torch.zeros(64, 4)}  # row by row
    monkeypatch.setattr(checkpoint, "non_persistent_buffers", lambda model: older)
    comera_fx.save_tensorized(packed, tmp_path / "older.st")
    monkeypatch.undo()
    assert torch.equal(comera_fx.load_tensorized(tmp_path / "older.st", build)(x), packed(x))


def test_export_carries_the_codes_not_fp32_weights():
    """comera_fx.export of a packed model: the program holds the int8 / uint8 codes (no fp32 weight of a packed
    layer), and matches eager."""
    from torch.export import Dim

    torch.manual_seed(3)
    model = build()
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="^0$")
    comera_fx.quantize_(model, 8, 64, dense_linears=True, include="^2$")
    pack_linears_(model)
    model.eval()
    program = comera_fx.export(model, (torch.randn(4, 128),), dynamic_shapes=({0: Dim("b", max=64)},))
    held = {**program.state_dict, **program.constants}
    assert held["0.codes"].dtype == torch.uint8 and held["2.codes"].dtype == torch.int8
    assert not any(v.is_floating_point() and v.numel() >= 64 * 48 for v in held.values())
    x = torch.randn(9, 128)  # eager takes the 8 and the scales off the output here, the program off the weight
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=1e-5)


# ---- PackedTTLinear: TT cores held as codes


def tt_model(seed: int = 4) -> nn.Sequential:
    """Two TT linears (TT and TTM formats, random gates, held quantized) around a plain one."""
    from comera_fx.tt.layers import TTLinear

    torch.manual_seed(seed)
    first = TTLinear.from_dense(nn.Linear(128, 96), max_rank=12)
    second = TTLinear.from_dense(nn.Linear(96, 48), max_rank=10, format="ttm")
    for layer in (first, second):
        with torch.no_grad():
            for gate in layer.tt.gates:
                gate.uniform_(0.5, 1.5)
    return nn.Sequential(first, nn.ReLU(), second, nn.ReLU(), nn.Linear(48, 40))


def tt_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """float64 x Wᵀ + b with W rebuilt from each core's codes and scales (``comera_fx.quantize.dequantize``)."""
    from comera_fx.packed import tt_core_specs
    from comera_fx.tt import ops

    tt, specs = layer.tt, tt_core_specs(layer.tt)
    cores = []
    for core, spec in zip(tt.cores, specs):
        codes, scales = quantize_groups(core.detach(), spec)
        cores.append(dequantize(codes, scales, spec, tuple(core.shape), torch.float64))
    gates = [g.detach().double() for g in tt.gates]
    m = ops.to_dense(ops.gate_cores(cores, gates, tt.layout), tt.layout)
    weight = m if layer.transposed else m.t()
    return x.double() @ weight.t() + layer.bias.detach().double()


@pytest.mark.parametrize("bits,group", [(8, 64), (8, None), (8, 16), (4, 32), (4, 7), (4, None), (4, 16)])
def test_packed_tt_forward_is_the_fake_quantized_tt_forward(bits, group, packed_path):
    from comera_fx.packed import PackedTTLinear
    from comera_fx.tt.layers import TTLinear

    model = tt_model(bits + (group or 0))
    comera_fx.quantize_(model, bits, group)  # the TT cores
    for layer in (model[0], model[2]):
        packed = PackedTTLinear.from_tt_linear(layer)
        assert packed._aligned == (group == 16 or (group == 32 and layer is model[2]))  # all cores unpacked at once
        for core, held in zip(layer.tt.cores, packed.cores()):
            assert torch.equal(held, core.detach())  # the fake-quantized fp32 cores, bit for bit
        assert packed.nbytes() == comera_fx.quantize.stored_bytes(layer)  # held as its stored bytes
        assert packed.nbytes() * 3 < sum(c.numel() * 4 for c in layer.tt.cores)
        for shape in [(5, layer.in_features), (2, 3, layer.in_features), (70, layer.in_features)]:
            x = torch.randn(shape)
            out = packed(x)
            torch.testing.assert_close(out.double(), tt_reference(layer, x), rtol=0, atol=2e-5)
            with torch.no_grad():
                torch.testing.assert_close(out, layer(x), rtol=0, atol=2e-5)
    # a tied head's product (x Mᵀ): a TT matrix used transposed
    tt = model[0].tt
    head = TTLinear(tt, torch.zeros(128), transposed=True)
    x = torch.randn(4, 96)
    torch.testing.assert_close(
        PackedTTLinear.from_tt_linear(head)(x).double(), tt_reference(head, x), rtol=0, atol=2e-5
    )


def test_packed_tt_round_trips_state_dict_copy_and_torch_save(tmp_path):
    from comera_fx.packed import PackedTTLinear

    model = tt_model()
    comera_fx.quantize_(model, 4, 32)
    packed = PackedTTLinear.from_tt_linear(model[0])
    state = packed.state_dict()
    assert {k for k, v in state.items() if not v.is_floating_point()} == {f"codes_{k}" for k in range(4)}
    fresh = PackedTTLinear.from_manifest_entry(packed.manifest_entry())
    fresh.load_state_dict(state)
    x = torch.randn(6, 128)
    assert torch.equal(fresh(x), packed(x))
    assert torch.equal(copy.deepcopy(packed)(x), packed(x))
    torch.save(packed, tmp_path / "p.pt")
    assert torch.equal(torch.load(tmp_path / "p.pt", weights_only=False)(x), packed(x))


def test_load_tensorized_pack_holds_tt_cores_packed(tmp_path):
    from comera_fx.packed import PackedTTLinear, packed_modules

    model = tt_model()
    comera_fx.quantize_(model, 4, 32)
    comera_fx.quantize_(model, 8, 16, dense_linears=True, include="^4$")
    x = torch.randn(7, 128)
    with torch.no_grad():
        expected = model(x)
    comera_fx.save_tensorized(model, tmp_path / "tt.st")
    loaded = comera_fx.load_tensorized(tmp_path / "tt.st", build_tt, pack=True)
    assert [type(m).__name__ for m in loaded] == ["PackedTTLinear", "ReLU", "PackedTTLinear", "ReLU", "PackedLinear"]
    assert not any(p.dim() >= 2 for p in loaded.parameters())  # no fp32 core or weight in memory
    held = sum(m.nbytes() for m in packed_modules(loaded).values())
    assert held <= 1.3 * comera_fx.quantize.stored_bytes(model)
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=2e-5)
    comera_fx.save_tensorized(loaded, tmp_path / "packed.st")  # a packed model saves and loads packed
    again = comera_fx.load_tensorized(tmp_path / "packed.st", build_tt)
    assert isinstance(again[0], PackedTTLinear) and isinstance(again[2], PackedTTLinear)
    assert torch.equal(again(x), loaded(x))
    plain = comera_fx.load_tensorized(tmp_path / "tt.st", build_tt)  # without pack: TT in fp32, as before
    assert type(plain[0]).__name__ == "TTLinear"


def build_tt():
    return nn.Sequential(nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 48), nn.ReLU(), nn.Linear(48, 40))


def test_int3_layers_pack_save_and_load_as_three_bits(tmp_path):
    """An int3 dense layer: packed (held as int4 nibbles), saved at 3 bits a code, loaded packed, the same outputs;
    TT cores on an int3 grid have no packed layout: pack_linears_ leaves the layer and says why."""
    from comera_fx.packed import PackedTTLinear

    torch.manual_seed(3)
    model = build()
    comera_fx.quantize_(model, 3, 32, dense_linears=True, include="^0$")
    x = torch.randn(6, 128)
    expected = model(x).detach()
    weight = model[0].weight.detach().reshape(-1, 32)
    assert all(len(torch.unique(g)) <= 7 for g in weight)  # seven levels a group
    packed = copy.deepcopy(model)
    assert pack_linears_(packed) == {}
    assert isinstance(packed[0], PackedLinear) and packed[0].held_bits == 4
    torch.testing.assert_close(packed(x), expected, rtol=0, atol=1e-5)
    comera_fx.save_tensorized(packed, tmp_path / "int3.st")
    again = comera_fx.load_tensorized(tmp_path / "int3.st", build)
    assert isinstance(again[0], PackedLinear) and again[0].spec == QuantSpec(3, 32)
    assert torch.equal(again(x), packed(x))
    assert comera_fx.quantize.stored_bytes(again[0]) == 128 * 64 * 3 // 8 + 128 * 64 // 32 * 4
    tt = tt_model()
    comera_fx.quantize_(tt, 3, 32)
    left = pack_linears_(tt)
    assert set(left) == {"0", "2"} and "int3" in left["0"]
    with pytest.raises(ValueError, match="int8 / int4 cores"):
        PackedTTLinear.from_tt_linear(tt[0])


def test_pack_linears_packs_tt_layers_and_leaves_shared_ones():
    from comera_fx.packed import PackedTTLinear
    from comera_fx.tt.layers import TTLinear

    model = tt_model()
    comera_fx.quantize_(model, 8, 32)
    model.append(TTLinear(model[2].tt, None))  # shares layer 2's TT matrix
    left = pack_linears_(model)
    assert isinstance(model[0], PackedTTLinear) and set(left) == {"2", "5"} and "shared" in left["2"]
    assert isinstance(pack_linears_(tt_model(), tt=True), dict)  # nothing quantized: nothing to pack, no error


def test_export_carries_packed_tt_codes():
    """comera_fx.export of a model with PackedTTLinear layers: the program holds the cores' codes (no fp32 core),
    and matches eager over the declared batch range."""
    from torch.export import Dim

    model = tt_model()
    comera_fx.quantize_(model, 4, 32)
    pack_linears_(model)
    model.eval()
    program = comera_fx.export(model, (torch.randn(4, 128),), dynamic_shapes=({0: Dim("b", max=64)},))
    held = {**program.state_dict, **program.constants}
    assert held["0.codes"].dtype == torch.uint8
    assert not any(v.is_floating_point() and v.dim() >= 2 for v in held.values() if v.numel() > 40 * 48)
    for rows in (1, 9, 64):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=1e-5)


def test_shared_workspace_gives_the_same_outputs_in_every_mode(monkeypatch):
    """Eager no-grad calls rebuild weights in one shared buffer (without ``cpu_kernel``); outputs of earlier layers
    stay valid, inference mode and no_grad both work after each other, and a call recording a gradient builds its
    own weight."""
    import comera_fx.packed as packed_mod
    from comera_fx.packed import workspace

    monkeypatch.setattr(cpu_kernel, "USE_KERNEL", False)

    torch.manual_seed(5)
    layers = [
        PackedLinear.from_linear(nn.Linear(64, 96), QuantSpec(4, 32)),
        PackedLinear.from_linear(nn.Linear(64, 32), QuantSpec(8, None)),
    ]
    x = torch.randn(5, 64)
    workspace.REUSE_WORKSPACE = False
    try:
        with torch.no_grad():
            expected = [layer(x) for layer in layers]
    finally:
        workspace.REUSE_WORKSPACE = True
    with torch.inference_mode():
        first = [layer(x) for layer in layers]
    with torch.no_grad():
        second = [layer(x) for layer in layers]
    for a, b, c in zip(expected, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert packed_mod.workspace_bytes() >= 96 * 64 * 4
    xg = x.clone().requires_grad_()
    out = layers[0](xg)
    layers[1](x)  # writes the shared buffer; the gradient below needs layer 0's own weight
    out.sum().backward()
    torch.testing.assert_close(xg.grad, layers[0].dequantized().sum(0).expand(5, 64), rtol=0, atol=1e-5)


def packed_tt_reference(packed, x: torch.Tensor) -> torch.Tensor:
    """float64 x Wᵀ + b with W rebuilt from the packed layer's held codes, scales and gates
    (``comera_fx.quantize.dequantize`` per core)."""
    from comera_fx.packed import reference_weight
    from comera_fx.tt import ops

    layout = packed.layout
    cores = [
        reference_weight(packed.core_codes(k), packed.core_scales(k), spec, shape)
        for k, (shape, spec) in enumerate(zip(layout.core_shapes, packed.specs))
    ]
    gates = [g.double() for g in packed.gates()]
    m = ops.to_dense(ops.gate_cores(cores, gates, layout), layout)
    weight = m if packed.transposed else m.t()
    return x.double() @ weight.t() + packed.bias.detach().double()


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_tt_shared_path_folds_gates_and_follows_their_changes(bits, packed_path):
    """Eager no-grad calls dequantize the cores into the shared workspace with the gates folded into the next
    core's scales where its groups allow (here: every bond but the last); the result is the float64 product, and
    a gate or scale written in place afterwards is seen by the next call."""
    from comera_fx.packed import PackedTTLinear
    from comera_fx.packed.tt import fold_gates_into_scales
    from comera_fx.tt.layers import TTLinear

    torch.manual_seed(11)
    layer = TTLinear.from_dense(nn.Linear(384, 96), max_rank=16)
    with torch.no_grad():
        for gate in layer.tt.gates:
            gate.uniform_(0.5, 1.5)
    comera_fx.quantize_(layer, bits, 16)
    packed = PackedTTLinear.from_tt_linear(layer)
    assert packed._aligned
    _, left = fold_gates_into_scales(packed.scales, packed.gates(), packed._spans, 16)
    per_index = [math.prod(s) // s[0] for s in packed.layout.core_shapes[1:]]
    assert left == tuple(k for k, n in enumerate(per_index) if n % 16)
    assert 0 < len(left) < len(per_index)  # both kinds of bond are exercised
    x = torch.randn(3, 5, 384)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            torch.testing.assert_close(packed(x).double(), packed_tt_reference(packed, x), rtol=0, atol=2e-5)
    with torch.no_grad():
        packed.gates_0.mul_(1.7)
        packed.get_buffer(f"gates_{left[0]}").mul_(0.6)
        packed.scales[:4].mul_(2.0)
        torch.testing.assert_close(packed(x).double(), packed_tt_reference(packed, x), rtol=0, atol=2e-5)
    xg = x.clone().requires_grad_()  # a call recording a gradient builds its own cores
    out = packed(xg)
    torch.testing.assert_close(out.double(), packed_tt_reference(packed, x), rtol=0, atol=2e-5)
    out.sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (4, None), (8, 48), (4, 96)])
@pytest.mark.parametrize("cap_rows", [23, 101])
@pytest.mark.parametrize("rows", [101, 112])
@pytest.mark.parametrize("held", ["rows", "blocks", "unpack"])
def test_packed_linear_rebuilt_in_blocks_under_the_workspace_cap(bits, group, cap_rows, rows, held, monkeypatch):
    """With ``workspace.MAX_BYTES`` below the weight's fp32 size, eager no-grad calls rebuild it in blocks: of
    output rows (unequal here; whole blocks of 16 rows where the layer holds its codes so), or, for int4 when half
    the weight fits and its groups allow, the low and the high codes (two halves of the inputs). Either way the
    float64 product at few tokens (scales on the output or per group) and at many (weight finished, bias fused),
    with and without a bias, and a workspace under the cap. ``cpu_kernel``'s product off (it rebuilds nothing).
    ``held``: "rows", built without the kernel (codes row by row); "blocks", built with it (the layers of 112 rows
    in blocks of 16), then called without (ATen's ops); "unpack", the kernel's unpacking of those blocks."""
    import threading

    from comera_fx.packed import workspace

    if held != "rows" and cpu_kernel.library() is None:
        pytest.skip("no packed CPU kernel on this machine (it needs AVX-512 and a C++ compiler)")
    monkeypatch.setattr(PackedLinear, "_kernel_for", lambda self, x: None)
    cap = 96 * 4 * rows // 2 if cap_rows == 101 else 96 * 4 * cap_rows  # 101: half of the weight
    monkeypatch.setattr(workspace, "_WORKSPACE", threading.local())
    monkeypatch.setattr(workspace, "MAX_BYTES", cap)
    if cap_rows == 23:
        assert workspace.chunk_rows(101, 96 * 4) == 21  # five blocks: four of 21 rows, one of 17
    torch.manual_seed(3)
    for bias in (True, False):
        linear = nn.Linear(96, rows, bias=bias)
        if not bias:
            linear.bias = None
        spec = QuantSpec(bits, group)
        monkeypatch.setattr(cpu_kernel, "USE_KERNEL", held != "rows")
        layer = PackedLinear.from_linear(linear, spec)
        assert layer.row_block == (16 if rows == 112 and held != "rows" else 1)
        monkeypatch.setattr(cpu_kernel, "USE_KERNEL", held == "unpack")
        if layer.row_block == 16 and cap_rows == 23:
            assert layer._chunk_rows(96 * 4) == 16  # seven blocks of one row block each
        halves = bits == 4 and cap_rows == 101 and group != 32  # 32 does not divide the 48 inputs of a half
        assert layer._in_halves(4) == halves
        codes, scales = quantize_groups(linear.weight.detach(), spec)
        weight = dequantize(codes, scales, spec, (rows, 96), torch.float64)
        for tokens in (3, 90):
            x = torch.randn(2, tokens, 96)
            expected = x.double() @ weight.t() + (linear.bias.detach().double() if bias else 0)
            for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad):
                with mode():
                    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=2e-5)
    assert 0 < workspace.workspace_bytes() <= cap
