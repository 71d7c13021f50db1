"""benchmarks/weight_baselines.py (weight bytes, fake-quantization of the baselines) and the other-source evaluation
text of examples/compress_pretrained.py, checked against hand counts and a float64 reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from comera_fx.quantize import fake_quant, quantized_bytes

ROOT = Path(__file__).resolve().parents[1]


def load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


baselines = load_file("weight_baselines", ROOT / "benchmarks" / "weight_baselines.py")
weight_bytes, fake_quant_ = baselines.weight_bytes, baselines.fake_quant_


class Tiny(nn.Module):
    """Encoder-named weights: a dense (8, 16) linear with bias, two low-rank factors (3, 16) and (8, 3)."""

    def __init__(self):
        super().__init__()
        self.bert = nn.Module()
        self.bert.embeddings = nn.Embedding(100, 16)  # outside the encoder: never counted
        self.bert.encoder = nn.Module()
        self.bert.encoder.dense = nn.Linear(16, 8)
        self.bert.encoder.norm = nn.LayerNorm(8)
        self.bert.encoder.a = nn.Parameter(torch.randn(3, 16))
        self.bert.encoder.b = nn.Parameter(torch.randn(8, 3))


def test_weight_bytes_by_hand():
    """128 + 48 + 24 = 200 weights (bias, LayerNorm and the embedding excluded)."""
    model = Tiny()
    assert weight_bytes(model) == 200 * 4
    # int8 per row: 200 bytes + one fp32 scale per row: 8 + 3 + 8 rows
    assert weight_bytes(model, 8, per_row=True) == 200 + 4 * (8 + 3 + 8)
    # int4 groups of 32: 128 -> 64 B + 4 groups; 48 -> 24 B + 2 groups; 24 -> 12 B + 1 group
    assert weight_bytes(model, 4, 32) == 64 + 24 + 12 + 4 * (4 + 2 + 1)
    assert quantized_bytes(10, 4, None) == 5 + 4 and quantized_bytes(7, 4, 4) == 4 + 2 * 4
    assert quantized_bytes(10, 16) == 20


@pytest.mark.parametrize("bits,group", [(8, 16), (4, 32), (4, 64), (8, None)])
def test_fake_quant_error_bound_and_grid(bits, group):
    """Every value moves by at most half its group's scale max|w|/qmax (computed here in float64 from the raw
    weight), and lands on an integer multiple of that scale within [-qmax, qmax]."""
    torch.manual_seed(0)
    w = torch.randn(12, 64) * torch.logspace(-2, 1, 12)[:, None]  # rows of very different magnitude
    q = fake_quant(w, bits, group).double()
    qmax = 2 ** (bits - 1) - 1
    size = w.numel() if group is None else group
    groups = w.double().reshape(-1, size)
    scale = groups.abs().amax(1, keepdim=True) / qmax
    err = (q.reshape(-1, size) - groups).abs()
    assert bool((err <= scale / 2 * (1 + 1e-5) + 1e-12).all()), float((err / scale).max())
    steps = q.reshape(-1, size) / scale
    assert torch.allclose(steps, steps.round(), atol=1e-3) and float(steps.abs().max()) <= qmax + 1e-3


def test_fake_quant_groups_are_local():
    """A huge value in one group leaves the other groups' grids fine (group scales, not one scale per tensor)."""
    w = torch.full((2, 64), 0.01)
    w[0, 0] = 100.0
    q = fake_quant(w, 4, 64)
    assert torch.allclose(q[1], w[1])  # its own group: 0.01 is exactly max|w|, kept
    assert float(fake_quant(w, 4, None)[1].abs().max()) == 0.0  # one scale for all: 0.01 rounds to 0


def test_fake_quant_in_place_only_encoder_weights():
    model = Tiny()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fake_quant_(model, 4, 32)
    after = model.state_dict()
    assert torch.equal(after["bert.embeddings.weight"], before["bert.embeddings.weight"])
    assert torch.equal(after["bert.encoder.dense.bias"], before["bert.encoder.dense.bias"])
    assert not torch.equal(after["bert.encoder.a"], before["bert.encoder.a"])


def load_example():
    return load_file("compress_pretrained", ROOT / "examples" / "compress_pretrained.py")


def test_other_source_text_deterministic_and_disjoint():
    """numpy docstrings: the same list twice, no duplicates, none of the excluded (training) texts, none of the
    standard library's own docstrings when those are excluded."""
    cp = load_example()
    first = cp.mine_other_source(limit=50, packages=("numpy",), max_files=40)
    assert first == cp.mine_other_source(limit=50, packages=("numpy",), max_files=40)
    assert len(first) == 50 and len(set(first)) == 50
    excluded = set(first[::2])
    again = cp.mine_other_source(excluded, limit=50, packages=("numpy",), max_files=40)
    assert not excluded & set(again) and len(again) == 50
    stdlib = cp.mine_stdlib(max_files=20)
    train = set(stdlib["train"])
    assert not train & set(cp.mine_other_source(train, limit=50, packages=("numpy",), max_files=40))


def test_package_prose_leaves_out_the_evaluation_text():
    """``--extra-packages`` training prose: docstrings of the named package (torch here), none of the excluded texts
    (the stdlib training texts and the other-source evaluation texts); numpy and sympy, whose docstrings are the
    evaluation text, are refused, and so is a package that is not installed."""
    cp = load_example()
    prose = cp.mine_package_prose(("torch",), set(), max_files=40)
    assert len(prose) > 20 and len(set(prose)) == len(prose)
    excluded = set(prose[::3])
    again = cp.mine_package_prose(("torch",), excluded, max_files=40)
    assert not excluded & set(again) and set(again) == set(prose) - excluded
    for refused in (("numpy",), ("torch", "sympy"), ("no_such_package_here",)):
        with pytest.raises(SystemExit, match="--extra-packages"):
            cp.mine_package_prose(refused, set(), max_files=2)
    # the recipe's prose: the stdlib's training texts first, then torch's minus every stdlib and evaluation text
    mined = cp.mine_stdlib(max_files=20)
    other = prose[:5]  # stands in for the evaluation texts
    texts, rows, n_extra = cp.training_prose(mined, other, ("torch",), 200, max_files=40)
    assert texts[: len(mined["train"])] == mined["train"] and n_extra == len(texts) - len(mined["train"]) > 0
    assert not set(texts[len(mined["train"]) :]) & (set(other) | set(mined["test_texts"]) | set(mined["train"]))
    assert rows == cp.joined_texts(mined["train"], 200) + cp.joined_texts(texts[len(mined["train"]) :], 200)
    assert cp.training_prose(mined, other, (), 200) == (mined["train"], cp.joined_texts(mined["train"], 200), 0)


def test_reference_text_rows_and_sampler_share():
    """The Python reference topics as training rows: every row at most ``chars`` long, none a heading underline or
    a grammar block, none a numpy docstring (the evaluation text); a sampler with reference share 1 draws only
    reference rows, share 0 none, and shares that add past 1 are refused."""
    import argparse

    cp = load_example()
    rows = cp.mine_reference(200)
    assert len(rows) > 500 and all(40 <= len(r) <= 200 for r in rows)
    assert not any("::=" in r or "*****" in r or "=====" in r for r in rows)
    assert not set(rows) & set(cp.mine_other_source(limit=50, packages=("numpy",), max_files=40))
    data = {
        "train_enc": {"input_ids": torch.zeros(8, 4, dtype=torch.long), "attention_mask": torch.ones(8, 4)},
        "train_reference_enc": {"input_ids": torch.ones(8, 6, dtype=torch.long), "attention_mask": torch.ones(8, 6)},
    }

    def shares(reference, long=0.0):
        ns = argparse.Namespace(
            batch_size=2, by_length=False, code_fraction=0.0, long_fraction=long, reference_fraction=reference
        )
        draw = cp.training_sampler(data, ns, seed=0)
        return [int(draw()["input_ids"][0, 0]) for _ in range(20)]

    assert shares(1.0) == [1] * 20 and shares(0.0) == [0] * 20
    assert 0 < sum(shares(0.5)) < 20
    with pytest.raises(ValueError, match="at most 1"):
        shares(0.6, long=0.5)
