"""comera_fx.report: per-layer rows and totals, checked against counts computed here from shapes and modules."""

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from helpers_models import num_params, tt_param_count

MODES_RE = re.compile(r"^(\d+)(?:→(\d+))?=([\d·]+) \| (\d+)(?:→(\d+))?=([\d·]+)$")


class Awkward(nn.Module):
    """Sizes that do not factor well (97 is prime, 1003 = 17·59), padded here; plus a tie and a raw parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1003, 64)
        self.fc = nn.Linear(97, 130)
        self.up = nn.Linear(64, 97)
        self.w = nn.Parameter(torch.randn(128, 130) / 12)
        self.head = nn.Linear(64, 1003, bias=False)
        self.head.weight = self.emb.weight
        self.down = nn.Linear(128, 64)

    def forward(self, ids):
        h = self.fc(torch.tanh(self.up(self.emb(ids))))  # (…, 130)
        return self.head(self.down(F.linear(h, self.w)))  # w: (128 × 130) read by linear


# Padding is forced with explicit modes (the automatic choice is the mode heuristic's business, not the report's).
CONFIG = TensorizeConfig(
    max_rank=6,
    min_numel=4096,
    min_dim=64,
    overrides={r"^fc\.": {"row_modes": (10, 10)}, r"^emb\.": {"row_modes": (32, 32), "col_modes": (8, 8)}},
)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    dense = Awkward()
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, CONFIG, example_inputs=(torch.randint(0, 1003, (2, 5)),))
    return dense, model, summary


def parse_modes(text):
    match = MODES_RE.match(text)
    assert match, text
    rows, padded_rows, row_modes, cols, padded_cols, col_modes = match.groups()
    row_modes = tuple(int(m) for m in row_modes.split("·"))
    col_modes = tuple(int(m) for m in col_modes.split("·"))
    return (
        int(rows),
        int(padded_rows) if padded_rows else None,
        row_modes,
        int(cols),
        int(padded_cols) if padded_cols else None,
        col_modes,
    )


def expected_params(fmt, row_modes, col_modes, ranks):
    """Cores + gates from the modes and ranks: TT cores (r, n, r'), TTM cores (r, a, b, r'), one gate per bond."""
    if fmt == "tt":
        dims = row_modes + col_modes
    else:
        dims = tuple(a * b for a, b in zip(row_modes, col_modes))
    assert len(ranks) == len(dims) + 1 and ranks[0] == ranks[-1] == 1
    cores = sum(ranks[k] * dims[k] * ranks[k + 1] for k in range(len(dims)))
    return cores + sum(ranks[1:-1])


# (report name, the TTMatrix holder, rows of M, cols of M, format)
LAYERS = {
    "emb": (lambda m: m.emb.tt, 1003, 64, "ttm"),  # an embedding stores E itself
    "fc": (lambda m: m.fc.tt, 97, 130, "tt"),  # a linear layer stores M = Wᵀ (in × out)
    "up": (lambda m: m.up.tt, 64, 97, "tt"),
    "w": (lambda m: m.w_tt, 130, 128, "tt"),
    "down": (lambda m: m.down.tt, 128, 64, "tt"),
}


def test_one_row_per_tt_matrix(models):
    dense, model, summary = models
    rep = comera_fx.report(model)
    assert [r.fqn for r in rep.layers] and sorted(r.fqn for r in rep.layers) == sorted(LAYERS)
    assert len(summary.converted) == len(LAYERS)
    tied = next(r for r in rep.layers if r.fqn == "emb")
    assert tied.used_by == ("emb", "head")
    assert all(r.used_by == (r.fqn,) for r in rep.layers if r.fqn != "emb")


@pytest.mark.parametrize("name", list(LAYERS))
def test_row_contents(models, name):
    _, model, _ = models
    get_tt, rows, cols, fmt = LAYERS[name]
    row = next(r for r in comera_fx.report(model).layers if r.fqn == name)
    assert row.format == fmt
    n_rows, padded_rows, row_modes, n_cols, padded_cols, col_modes = parse_modes(row.modes)
    assert (n_rows, n_cols) == (rows, cols)
    for size, padded, modes in ((n_rows, padded_rows, row_modes), (n_cols, padded_cols, col_modes)):
        if padded is None:
            assert math.prod(modes) == size
        else:
            assert padded == math.prod(modes) and size < padded <= math.ceil(size * 1.25)
    assert row.ranks[0] == row.ranks[-1] == 1 and max(row.ranks) <= CONFIG.max_rank
    assert row.live_ranks == row.ranks  # fresh gates are all ones
    assert row.params == tt_param_count(get_tt(model))
    assert row.params == expected_params(fmt, row_modes, col_modes, row.ranks)
    assert row.dense_params == rows * cols
    assert row.compression == pytest.approx(rows * cols / row.params)


def test_padding_is_shown_with_an_arrow(models):
    _, model, _ = models
    modes = {r.fqn: r.modes for r in comera_fx.report(model).layers}
    assert modes["fc"].startswith("97→100=10·10 | 130")
    assert modes["emb"] == "1003→1024=32·32 | 64=8·8"
    assert "→" not in modes["down"]  # 128 | 64 factor exactly


def test_totals(models):
    dense, model, _ = models
    rep = comera_fx.report(model)
    assert rep.tt_params == sum(tt_param_count(get(model)) for get, *_ in LAYERS.values())
    assert rep.dense_params == sum(r * c for _, r, c, _ in LAYERS.values())
    assert rep.model_params == num_params(model)
    assert rep.dense_model_params == num_params(dense)  # the original model, tied weight counted once


def test_to_dict(models):
    _, model, _ = models
    data = comera_fx.report(model).to_dict()
    assert set(data) == {"layers", "total", "randomized_backward"}
    assert data["randomized_backward"] == []
    assert set(data["total"]) == {"tt_params", "dense_params", "compression", "model_params", "dense_model_params"}
    assert len(data["layers"]) == len(LAYERS)
    for layer in data["layers"]:
        assert set(layer) == {
            "fqn",
            "used_by",
            "format",
            "modes",
            "ranks",
            "live_ranks",
            "params",
            "dense_params",
            "plan",
            "backward",
            "compression",
        }
        assert layer["backward"] == "exact"
        assert layer["compression"] == pytest.approx(layer["dense_params"] / layer["params"])
    total = data["total"]
    assert total["tt_params"] == sum(layer["params"] for layer in data["layers"])
    assert total["compression"] == pytest.approx(total["dense_params"] / total["tt_params"])


def test_str_lists_every_layer_and_totals(models):
    _, model, _ = models
    text = str(comera_fx.report(model))
    for name in LAYERS:
        assert re.search(rf"^{name}\b", text, re.MULTILINE), name
    assert "tied: head" in text
    assert "total" in text and "whole model" in text
    assert f"{comera_fx.report(model).tt_params:,}" in text


def test_live_ranks_drop_when_gates_are_closed(models):
    _, model, _ = models
    tt = copy.deepcopy(model.fc.tt)
    holder = nn.Module()
    holder.fc = nn.Module()
    holder.fc.tt = tt
    before = comera_fx.report(holder).layers[0]
    with torch.no_grad():
        tt.gates[0][:2] = 0.0
        tt.gates[0][2] = 0.005  # below the default threshold 1e-2
        tt.gates[-1][0] = -0.5  # a large negative gate is alive
    row = comera_fx.report(holder).layers[0]
    assert row.ranks == before.ranks  # stored sizes do not change
    assert row.live_ranks[1] == row.ranks[1] - 3
    assert row.live_ranks[2:] == row.ranks[2:]
    assert "live" in str(comera_fx.report(holder))
    assert comera_fx.report(holder, gate_threshold=0.0).layers[0].live_ranks[1] == row.ranks[1] - 2
    everything_dead = comera_fx.report(holder, gate_threshold=2.0).layers[0]
    assert everything_dead.live_ranks == (1,) + (0,) * (len(row.ranks) - 2) + (1,)


def test_report_of_a_dense_model_is_empty():
    torch.manual_seed(0)
    dense = Awkward()
    rep = comera_fx.report(dense)
    assert rep.layers == () and rep.tt_params == 0 and rep.dense_params == 0
    assert rep.model_params == rep.dense_model_params == num_params(dense)
    assert "no TT layers" in str(rep)
