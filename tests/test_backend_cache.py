"""Warm starts: a second process compiling the same TT model with ``comera_fx.backend`` loads its graphs from
AOTAutograd's on-disk cache and computes exactly what the first computed; another post-AOT pass is another key.
Slow: each process compiles with Inductor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

RUN = textwrap.dedent("""
    import json, sys, torch
    import comera_fx
    from torch._dynamo.utils import counters

    out, extra_pass = sys.argv[1], sys.argv[2] == "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.GELU(), torch.nn.Linear(128, 96))
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    x = torch.randn(32, 96)

    def widen(gm):  # another post-AOT pass: changes nothing, but it is another compile
        return gm

    backend = comera_fx.make_backend(post_aot_passes=[widen] if extra_pass else ())
    compiled = torch.compile(model, backend=backend)
    y = compiled(x)
    y.pow(2).sum().backward()
    grads = [p.grad.flatten().tolist() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    reference = model(x)
    reference.pow(2).sum().backward()
    close = all(torch.allclose(torch.tensor(g), p.grad.flatten(), rtol=1e-4, atol=1e-6)
                for g, p in zip(grads, model.parameters()))
    json.dump({"y": y.flatten().tolist(), "grads": grads, "close_to_eager": close and
               torch.allclose(y, reference, rtol=1e-4, atol=1e-6), "counters": dict(counters["aot_autograd"]),
               "stats_hits": backend.stats.cache_hits},
              open(out, "w"))
""")


def run(tmp_path, name: str, extra_pass: bool = False) -> dict:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / f"{name}.json"
    subprocess.run(
        [sys.executable, str(script), str(out), "1" if extra_pass else "0"],
        check=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    return json.loads(out.read_text())


def test_a_second_process_loads_the_graphs_and_computes_the_same(tmp_path):
    cold = run(tmp_path, "cold")
    warm = run(tmp_path, "warm")
    assert cold["counters"].get("autograd_cache_saved", 0) >= 1, cold["counters"]
    assert warm["counters"].get("autograd_cache_hit", 0) >= 1, warm["counters"]
    assert warm["counters"].get("autograd_cache_miss", 0) == 0, warm["counters"]
    assert cold["stats_hits"] == 0 and warm["stats_hits"] == warm["counters"]["autograd_cache_hit"]
    assert cold["close_to_eager"] and warm["close_to_eager"]
    assert warm["y"] == cold["y"] and warm["grads"] == cold["grads"]  # the same compiled code

    other = run(tmp_path, "other pass", extra_pass=True)  # the pass is in the key: compiled, not loaded
    assert other["counters"].get("autograd_cache_hit", 0) == 0, other["counters"]
    assert other["counters"].get("autograd_cache_miss", 0) >= 1, other["counters"]
