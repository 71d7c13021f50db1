"""Issue 44 item 5: a TT layer's products run the plan chosen with the launch cost of the device its cores live on.

The envelope caches are keyed by device type; the plan for "cuda" is checked against brute force over every
contraction order with CUDA's launch term (no CUDA tensor is needed: the device is passed as a ``torch.device`` or
a string). A layer's move is checked on the meta device given CUDA's launch cost (``DEVICE_LAUNCH`` patched): the
only device besides the CPU that this machine can put tensors on."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_plan_launch import TINY, brute_force

import comera_fx
from comera_fx.packed import PackedTTLinear
from comera_fx.quantize import QuantSpec
from comera_fx.tt import TTLinear, TTMatrix, layers, plan_cache
from comera_fx.tt import plan as planner
from comera_fx.tt.decompose import random_tt_cores
from comera_fx.tt.plan.cost import DEVICE_LAUNCH, CostModel
from comera_fx.tt.range_plan import plan_for_range

CPU_ORDER, CUDA_ORDER = "(((x·G1)·G2)·G3)·G4", "((x·(G1·G2))·G3)·G4"  # TINY at b = 2 (test_plan_launch.py)


@pytest.fixture
def empty_caches(monkeypatch):
    """Both envelope caches empty, as in a fresh process."""
    monkeypatch.setattr(plan_cache, "_ENVELOPES", OrderedDict())
    monkeypatch.setattr(plan_cache, "_INFERENCE_ENVELOPES", OrderedDict())


@pytest.fixture
def meta_as_cuda(monkeypatch):
    """The meta device given CUDA's launch cost: a device with a launch term that tensors can be moved to here."""
    monkeypatch.setitem(DEVICE_LAUNCH, "meta", DEVICE_LAUNCH["cuda"])


def tiny_matrix() -> TTMatrix:
    gen = torch.Generator().manual_seed(0)
    return TTMatrix(TINY, random_tt_cores(TINY.core_shapes, 0.5, dtype=torch.float64, generator=gen))


@pytest.mark.parametrize("cuda", [torch.device("cuda", 0), "cuda", "cuda:1"])
def test_the_cuda_envelope_is_the_brute_force_choice_with_cudas_launch_term(cuda, empty_caches):
    on_cuda = layers.planned_envelope(TINY, "matmul", device=cuda)
    on_cpu = layers.planned_envelope(TINY, "matmul", device="cpu")
    for batch in (1, 2, 3):
        for envelope, launch in ((on_cuda, DEVICE_LAUNCH["cuda"]), (on_cpu, 0)):
            best, argmin = brute_force(TINY, CostModel(launch=launch), batch)
            chosen = envelope.choose(batch)
            assert chosen.cost(batch) == best and chosen.tree in argmin, (launch, batch, str(chosen))
    assert str(on_cpu.choose(2)) == CPU_ORDER and str(on_cuda.choose(2)) == CUDA_ORDER


def test_the_cache_holds_both_devices_without_mixing(empty_caches):
    on_cpu = layers.planned_envelope(TINY, "matmul", device=torch.device("cpu"))
    assert layers.cached_envelope(TINY, "matmul", device="cuda") is None  # a CPU plan is never a CUDA one
    on_cuda = layers.planned_envelope(TINY, "matmul", device="cuda:0")
    assert set(plan_cache._ENVELOPES) == {(TINY, "matmul", "cpu"), (TINY, "matmul", "cuda")}
    assert layers.cached_envelope(TINY, "matmul", device=torch.device("cuda", 1)) is on_cuda
    assert layers.cached_envelope(TINY, "matmul", device="cpu") is on_cpu
    assert layers.planned_envelope(TINY, "matmul", device="cpu") is on_cpu  # a hit, not a re-plan
    assert on_cpu.model.launch == 0 and on_cuda.model.launch == DEVICE_LAUNCH["cuda"]
    assert plan_cache.planned_ops(TINY, device="cpu") == plan_cache.planned_ops(TINY, device="cuda") == ["matmul"]
    forward_only = layers.planned_envelope(TINY, "matmul", device="cuda", backward=False)
    assert layers.cached_envelope(TINY, "matmul", device="cuda", backward=False) is forward_only
    assert layers.cached_envelope(TINY, "matmul", device="cpu", backward=False) is None


def test_a_cpu_layer_runs_the_cpu_plan_and_matches_the_dense_float64_product(empty_caches):
    tt = tiny_matrix()
    x = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 16, dtype=torch.float64)
    (tt.matmul(x) * weights).sum().backward()
    got = [x.grad, *(p.grad for p in tt.parameters())]
    assert str(tt._plan_pins["matmul"].choose(2)) == CPU_ORDER and tt._plan_pins["matmul"].model.launch == 0

    reference = tiny_matrix()  # the same cores, multiplied through the dense matrix they make
    x_ref = x.detach().clone().requires_grad_()
    ((x_ref @ reference.dense()) * weights).sum().backward()
    expected = [x_ref.grad, *(p.grad for p in reference.parameters())]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_a_moved_layer_runs_the_new_devices_plan_at_its_next_call(empty_caches, meta_as_cuda):
    linear = TTLinear(tiny_matrix())
    x = torch.randn(2, 16, dtype=torch.float64)
    linear(x)  # pins the CPU plans
    assert str(linear.tt._plan_pins["matmul"].choose(2)) == CPU_ORDER
    linear.to("meta")  # the move re-plans what was pinned, before any call (a compile may come next)
    pinned = linear.tt._plan_pins["matmul"]
    assert pinned.model.launch == DEVICE_LAUNCH["cuda"] and str(pinned.choose(2)) == CUDA_ORDER
    assert pinned is layers.cached_envelope(TINY, "matmul", device="meta")
    out = linear(x.to("meta"))
    assert out.shape == (2, 16) and linear.tt._plan_pins["matmul"] is pinned
    assert str(comera_fx.plan(linear).choose(2)) == CUDA_ORDER  # the public planner reads the layer's device
    assert str(comera_fx.plan(TINY).choose(2)) == CPU_ORDER  # a bare layout: no device, no launch cost
    linear.to_empty(device="cpu")  # meta tensors hold no values to copy back
    assert linear.tt._plan_pins["matmul"].model.launch == 0


def test_a_compiled_call_reads_the_pin_of_the_cores_device(empty_caches, meta_as_cuda, monkeypatch):
    """Moved, then compiled before any eager call: the trace reads the pin the move made, not the global cache
    (which it may not fill), and runs the new device's order: one copy fewer than the CPU order forward."""
    linear = TTLinear(tiny_matrix())
    linear(torch.randn(2, 16, dtype=torch.float64))
    linear.to("meta")

    def refuse(*args, **kwargs):
        raise AssertionError("traced code read the global plan cache")

    monkeypatch.setattr(layers, "cached_envelope", refuse)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        out = torch.compile(linear, backend=backend, fullgraph=True)(torch.randn(2, 16, dtype=torch.float64).to("meta"))
    finally:
        torch._dynamo.reset()
    assert out.shape == (2, 16) and len(graphs) == 1
    forward = [m for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule)][1]  # the Function's forward
    mms = [tuple(n.meta["example_value"].shape) for n in forward.graph.nodes if n.target is torch.mm]
    on_cuda, on_cpu = (planner.plan(TINY, launch=launch).choose(2) for launch in (DEVICE_LAUNCH["cuda"], 0))
    assert mms == gemm_outputs(on_cuda, 2) != gemm_outputs(on_cpu, 2)


def gemm_outputs(chosen: planner.Plan, batch: int) -> list[tuple[int, int]]:
    """The (rows, cols) of each GEMM the plan runs forward: a batched step's rows grow with the batch."""
    return [(step.m * batch if step.batched else step.m, step.n) for step in chosen.steps]


def test_range_plans_and_packed_layers_take_the_devices_launch_cost(empty_caches, meta_as_cuda):
    forward_only = CostModel(backward=False, launch=DEVICE_LAUNCH["cuda"])
    best, argmin = brute_force(TINY, forward_only, 2)
    pinned = plan_for_range(TINY, "matmul", 2, 2, launch=DEVICE_LAUNCH["cuda"]).plan
    assert pinned.cost(2) == best and pinned.tree in argmin
    packed = PackedTTLinear(TINY, [QuantSpec(8, 8)] * TINY.n_cores, bias=False, dtype=torch.float64)
    assert packed._pins["matmul"].model.launch == 0
    packed.to("meta")
    assert packed._pins["matmul"] is layers.cached_envelope(TINY, "matmul", device="meta", backward=False)
    assert packed._pins["matmul"].model.launch == DEVICE_LAUNCH["cuda"]
