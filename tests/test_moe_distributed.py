"""DDP at its defaults (``find_unused_parameters=False``) trains a converted MoE whose batches miss experts.

The dense models train under it: their 3D expert weights always get a gradient. The converted experts are one TT
matrix each, read only when a token is routed there (``TTExperts``' loop, the weight-space ``LazyBank``); they get
zero gradients when no token reaches them (``moe/unreached.py``), else DDP stops at the next iteration
("Expected to have finished reduction in the prior iteration ..."). Checked on gpt-oss (weight-space, eager loop)
and Mixtral (contracted), 8 experts, 3 tokens per rank: two SGD steps under DDP equal two steps of one process
on the mean of the ranks' float64 gradients, each from a model of its own.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers_distributed import run_scenarios, scenario_results

transformers = pytest.importorskip("transformers")

WORLD, STEPS, LR = 2, 2, 0.05
FAMILIES = ("gpt_oss", "mixtral")


def make_model(family: str):
    import comera_fx
    from comera_fx.testing.moe_families import build, families
    from test_moe_families import FULL

    model = build(family, dict(families())[family], num_local_experts=8).double().train()
    model.config._experts_implementation = "eager"
    comera_fx.tensorize_(model, FULL.replace(max_rank=4))
    return model


def batch(step: int, rank: int):
    return torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(100 * step + rank))


def scenario_ddp_moe(rank, world):
    results = {}
    for family in FAMILIES:
        model = make_model(family)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        missed = 0
        for step in range(STEPS):
            ids = batch(step, rank)
            ddp(ids, labels=ids).loss.backward()
            missed += sum(p.grad is not None and not bool(p.grad.any()) for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
        results[family] = {n: p.detach().clone() for n, p in model.named_parameters()}
        results[f"{family} zero grads"] = missed
    return results


SCENARIOS = {"ddp_moe": scenario_ddp_moe}


def one_process(family: str) -> dict:
    """STEPS of SGD on the mean of the ranks' gradients, each computed by a model of its own."""
    model = make_model(family)
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            ids = batch(step, rank)
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for n, p in model.named_parameters():
                got = [g[n] for g in grads if n in g]
                if got:
                    p -= LR * sum(got) / WORLD
    return {n: p.detach() for n, p in model.named_parameters()}


def test_ddp_at_its_defaults_trains_experts_a_batch_misses(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    group = run_scenarios(__name__, ["ddp_moe"], tmp_path, WORLD)
    results = scenario_results(group, "ddp_moe")
    for family in FAMILIES:
        assert all(r[f"{family} zero grads"] > 0 for r in results)  # batches missed experts
        want = one_process(family)
        for rank, res in enumerate(results):
            assert res[family].keys() == want.keys()
            for name, value in want.items():
                torch.testing.assert_close(res[family][name], value, rtol=1e-10, atol=1e-12, msg=f"{rank} {name}")
