"""save_tensorized / load_tensorized: identical outputs in a fresh process, no dense weight ever allocated; trained
and pruned random models round-trip through it and through the plain state_dict."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.testing import strategies
from comera_fx.testing.models import build_model, make_example_input

from helpers_models import Big, Mixed, TiedLM

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op creates outside the meta device."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def tensorized(model_cls, **config):
    torch.manual_seed(0)
    model = model_cls()
    comera_fx.tensorize_(model, TensorizeConfig(**config))
    return model


@pytest.mark.parametrize("model_cls", [Big, TiedLM, Mixed])
def test_round_trip_same_outputs(tmp_path, model_cls):
    model = tensorized(model_cls, max_rank=8, min_numel=10_000)
    ids = torch.randint(0, 300, (3, 7))
    path = tmp_path / "m.safetensors"
    manifest = comera_fx.save_tensorized(model, path)
    assert manifest["tt_matrices"]
    loaded = comera_fx.load_tensorized(path, model_cls)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert str(comera_fx.report(loaded)) == str(comera_fx.report(model))
    if model_cls is TiedLM:
        assert loaded.head.tt is loaded.emb.tt  # the tie survives


def test_round_trip_in_a_fresh_process(tmp_path):
    model = tensorized(Big, max_rank=8, min_numel=10_000)
    ids = torch.randint(0, 1000, (2, 9))
    comera_fx.save_tensorized(model, tmp_path / "m.safetensors")
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch, comera_fx\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from helpers_models import Big\n"
        f"m = comera_fx.load_tensorized({str(tmp_path / 'm.safetensors')!r}, Big)\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(ids), {str(tmp_path / 'out.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "out.pt"), model(ids))


def test_loading_never_allocates_the_dense_weights(tmp_path):
    model = tensorized(Big, max_rank=8, min_numel=10_000)
    comera_fx.save_tensorized(model, tmp_path / "m.safetensors")
    smallest_converted = 1000 * 64  # the embedding; up / mid / down are larger
    with LargestAllocation() as eager:  # the check can fail: building the dense model allocates them
        Big()
    assert eager.largest >= smallest_converted
    with LargestAllocation() as loading:
        comera_fx.load_tensorized(tmp_path / "m.safetensors", Big)
    assert 0 < loading.largest < smallest_converted


def test_low_rank_layout_round_trip(tmp_path):
    """num_modes=1 (two cores per weight, the low-rank student of docs/pretrained.md) saves and loads like TT."""
    model = tensorized(Big, max_rank=8, min_numel=10_000, num_modes=1)
    assert all(len(m.tt.cores) == 2 for m in (model.up, model.mid, model.down))
    ids = torch.randint(0, 1000, (2, 5))
    comera_fx.save_tensorized(model, tmp_path / "m.safetensors")
    loaded = comera_fx.load_tensorized(tmp_path / "m.safetensors", Big)
    assert [len(m.tt.cores) for m in (loaded.up, loaded.mid, loaded.down)] == [2, 2, 2]
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_pruned_ranks_round_trip(tmp_path):
    model = tensorized(Big, max_rank=8, min_numel=10_000)
    tt = model.mid.tt
    keep = 3  # prune the middle bond to 3 slices (what rank adaptation does)
    bond = len(tt.row_modes)
    tt.cores[bond - 1] = nn.Parameter(tt.cores[bond - 1].detach()[..., :keep].clone())
    tt.cores[bond] = nn.Parameter(tt.cores[bond].detach()[:keep].clone())
    tt.gates[bond - 1] = nn.Parameter(tt.gates[bond - 1].detach()[:keep].clone())
    assert tt.ranks[bond] == keep
    ids = torch.randint(0, 1000, (2, 5))
    comera_fx.save_tensorized(model, tmp_path / "m.safetensors")
    loaded = comera_fx.load_tensorized(tmp_path / "m.safetensors", Big)
    assert loaded.mid.tt.ranks == tt.ranks
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # The plain state_dict route: a freshly tensorized model adopts the pruned checkpoint's ranks.
    fresh = tensorized(Big, max_rank=8, min_numel=10_000)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_torch_save_fallback(tmp_path, monkeypatch):
    model = tensorized(TiedLM, max_rank=8, min_numel=10_000)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    comera_fx.save_tensorized(model, tmp_path / "m.pt")
    loaded = comera_fx.load_tensorized(tmp_path / "m.pt", TiedLM)
    ids = torch.randint(0, 300, (2, 4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    torch.save({"x": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="save_tensorized"):
        comera_fx.load_tensorized(tmp_path / "other.pt", TiedLM)


def test_foreign_safetensors_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="save_tensorized"):
        comera_fx.load_tensorized(tmp_path / "plain.safetensors", TiedLM)


def test_bert_non_persistent_buffers_and_calibrated_model(tmp_path):
    config = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=500,
        max_position_embeddings=64,
    )

    def build():
        torch.manual_seed(0)
        return transformers.BertModel(config).eval()

    model = build()
    batches = [{"input_ids": torch.randint(0, 500, (2, 16))}]
    cal = comera_fx.calibrate(model, batches, config=TensorizeConfig(min_numel=10_000))
    comera_fx.tensorize_(
        model, TensorizeConfig(min_numel=10_000, size_target=0.3, allocation="energy"), calibration=cal
    )
    comera_fx.save_tensorized(model, tmp_path / "bert.safetensors")
    loaded = comera_fx.load_tensorized(tmp_path / "bert.safetensors", build).eval()
    with torch.no_grad():
        expected = model(**batches[0]).last_hidden_state
        assert torch.equal(loaded(**batches[0]).last_hidden_state, expected)


# ------------------------------------------------------------- trained, then pruned by RankAdaptive, then saved

TRAINING_STEPS = 12
TRAINED_MODELS = strategies.models(
    block_kinds=("linear", "mlp", "residual", "tied_linear"),  # each has a linear
    max_blocks=3,
    min_features=4,
    max_features=24,
    batch_sizes=st.integers(1, 3),
    num_inputs=2,
)


def train_until_pruned(model: nn.Module, spec, config: TensorizeConfig) -> comera_fx.RankAdaptive:
    """tensorize_, then AdamW with RankAdaptive taking the TT size to a third over ``TRAINING_STEPS`` steps."""
    comera_fx.tensorize_(model, config)
    # Something to prune: a bond above rank 1 (a prime-sized weight's single core, or rank 1 everywhere, has none)
    assume(any(r > 1 for m in model.modules() if isinstance(m, comera_fx.TTMatrix) for r in m.ranks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = comera_fx.RankAdaptive(
        model, optimizer, comera_fx.BudgetConfig(keep_fraction=1 / 3, total_steps=TRAINING_STEPS)
    )
    x = make_example_input(dataclasses.replace(spec, batch=8, seed=spec.seed + 1))
    for _ in range(TRAINING_STEPS):
        loss = model(x).pow(2).mean()
        loss.backward()
        hook.observe(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return hook


def assert_same_outputs(loaded: nn.Module, model: nn.Module, inputs) -> None:
    with torch.no_grad():
        for (x,) in inputs:
            assert torch.equal(loaded(x), model(x))


# Each example trains 12 steps, prunes about 6 times, saves, loads and rebuilds twice (~0.3-3 s of CPU on one
# thread), so 20 examples. One thread for the whole test (the fixture is not per example, and needs not be).
@pytest.mark.filterwarnings("ignore:RankAdaptive. the scheduled size:UserWarning")  # tiny models hit rank floors
@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=TRAINED_MODELS, max_rank=st.integers(2, 6))
def test_trained_and_pruned_random_models_save_and_load_to_the_same_outputs(case, max_rank, one_thread):
    """Random models tensorized, trained and pruned by RankAdaptive (ranks below the tensorized ones), then saved
    two ways: ``save_tensorized`` / ``load_tensorized`` into the bare architecture, and ``torch.save`` of the
    ``state_dict`` loaded into a freshly tensorized model of other weights at the original ranks (which adopts the
    pruned ranks). Both compute exactly what the trained model computes, on two batches."""
    model, example_inputs = case
    spec = model.spec
    config = TensorizeConfig(max_rank=max_rank, min_numel=1, min_dim=1)
    hook = train_until_pruned(model, spec, config)
    assert hook.live_tt_params() < hook.initial_tt_params, hook.summary()  # it was pruned
    model.eval()
    inputs = [example_inputs, *case.more_inputs]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        comera_fx.save_tensorized(model, path)
        loaded = comera_fx.load_tensorized(path, lambda: build_model(spec)).eval()
        assert_same_outputs(loaded, model, inputs)

        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        fresh = build_model(dataclasses.replace(spec, seed=spec.seed + 2))
        comera_fx.tensorize_(fresh, config)
        fresh.load_state_dict(torch.load(buffer))
        assert_same_outputs(fresh.eval(), model, inputs)
