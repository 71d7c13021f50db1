"""An AOTInductor package of comera_fx.export's program runs in a process that never imports comera_fx and gives
eager's outputs across the declared range; inputs outside it are refused naming the dimension. Slow: AOTInductor
compiles C++."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.export import Dim

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.tt import TTLinear

from helpers_models import MLP

pytestmark = pytest.mark.slow

SERVE = textwrap.dedent("""
    import sys, torch, torch._inductor
    package, inputs, outputs = sys.argv[1:]
    run = torch._inductor.aoti_load_package(package)
    results = []
    for x in torch.load(inputs):
        try:
            results.append(run(x))
        except Exception as error:
            results.append(f"{type(error).__name__}: {error}")
    assert not any(name.startswith("comera_fx") for name in sys.modules), "comera_fx was imported"
    torch.save(results, outputs)
""")


def test_aoti_package_runs_without_comera_fx_and_matches_eager(tmp_path):
    torch.manual_seed(0)
    dense = MLP().double().eval()
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0))
    program = comera_fx.export(
        model, (torch.randn(3, 128, dtype=torch.float64),), dynamic_shapes=({0: Dim("b", min=1, max=256)},)
    )
    path = comera_fx.package(program, tmp_path / "mlp.pt2")

    sizes = [1, 2, 5, 17, 256]
    bad = [torch.randn(300, 128, dtype=torch.float64), torch.randn(4, 100, dtype=torch.float64)]
    inputs = [torch.randn(b, 128, dtype=torch.float64) for b in sizes] + bad
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    env = dict(os.environ, AOTI_RUNTIME_CHECK_INPUTS="1")  # the package then checks shapes against the ranges
    subprocess.run(
        [sys.executable, str(script), path, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        check=True,
        cwd=tmp_path,
        timeout=600,
        env=env,
    )
    results = torch.load(tmp_path / "out.pt")

    def reference(x):  # the dense float64 model with the TT layers' matrices
        h = torch.tanh(torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias))
        return torch.nn.functional.linear(h, model.fc2.weight, model.fc2.bias)

    assert isinstance(model.fc1, TTLinear)
    for x, y in zip(inputs[: len(sizes)], results):
        assert isinstance(y, torch.Tensor), y
        with torch.no_grad():
            torch.testing.assert_close(y, model(x), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(y, reference(x), rtol=1e-10, atol=1e-12)
    too_large, wrong_width = results[len(sizes) :]
    assert isinstance(too_large, str) and "too large at 0" in too_large and "256" in too_large, too_large
    assert isinstance(wrong_width, str) and "at 1" in wrong_width and "128" in wrong_width, wrong_width


def test_aoti_package_of_a_packed_model_matches_eager(tmp_path):
    """A model with PackedLinear (int4 codes) and PackedTTLinear (int8 cores) layers packages and runs from its
    codes: the program holds no fp32 weight of a packed layer, and the package gives eager's outputs."""
    from comera_fx.packed import pack_linears_

    torch.manual_seed(1)
    model = MLP().eval()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0, skip=["fc2"]))
    comera_fx.quantize_(model, 8, 16)  # fc1's TT cores
    comera_fx.quantize_(model, 4, 32, dense_linears=True, include="fc2")
    assert pack_linears_(model) == {}
    assert [type(m).__name__ for m in (model.fc1, model.fc2)] == ["PackedTTLinear", "PackedLinear"]
    program = comera_fx.export(model, (torch.randn(3, 128),), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    held = {**program.state_dict, **program.constants}
    assert {k for k, v in held.items() if v.is_floating_point() and v.dim() >= 2} == {"fc2.scales"}  # per group
    run = torch._inductor.aoti_load_package(comera_fx.package(program, tmp_path / "packed.pt2"))
    for rows in (1, 7, 64):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            torch.testing.assert_close(run(x), model(x), rtol=0, atol=1e-5)
