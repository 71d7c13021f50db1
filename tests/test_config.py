"""TensorizeConfig: validation (every bad value -> ValueError naming the field), resolution and round trips."""

import json
import math

import pytest
import torch

import comera_fx
from comera_fx import Init, LayerSettings, TensorizeConfig, TTFormat

# (keyword arguments, text the error message must contain)
INVALID = [
    (dict(max_rank=0), "max_rank"),
    (dict(max_rank=-1), "max_rank"),
    (dict(max_rank=1.5), "max_rank"),
    (dict(max_rank=True), "max_rank"),
    (dict(max_rank="8"), "max_rank"),
    (dict(rank_ratio=0), "rank_ratio"),
    (dict(rank_ratio=0.0), "rank_ratio"),
    (dict(rank_ratio=1.5), "rank_ratio"),
    (dict(rank_ratio=-0.5), "rank_ratio"),
    (dict(rank_ratio="0.5"), "rank_ratio"),
    (dict(rank_ratio=math.nan), "rank_ratio"),
    (dict(rank_ratio=True), "rank_ratio"),
    (dict(rel_tol=-0.1), "rel_tol"),
    (dict(rel_tol=1.5), "rel_tol"),
    (dict(rel_tol=math.nan), "rel_tol"),
    (dict(init="foo"), "init"),
    (dict(init=None), "init"),
    (dict(num_modes=0), "num_modes"),
    (dict(num_modes=13), "num_modes"),
    (dict(num_modes=2.0), "num_modes"),
    (dict(row_modes=()), "row_modes"),
    (dict(row_modes=(4, 0)), "row_modes"),
    (dict(row_modes="ab"), "row_modes"),
    (dict(col_modes=(8, 2.5)), "col_modes"),
    (dict(linear_format="cp"), "linear_format"),
    (dict(embedding_format=3), "embedding_format"),
    (dict(max_pad_fraction=-1), "max_pad_fraction"),
    (dict(max_pad_fraction=1.5), "max_pad_fraction"),
    (dict(max_pad_fraction=None), "max_pad_fraction"),
    (dict(max_pad_fraction="x"), "max_pad_fraction"),
    (dict(min_numel=-1), "min_numel"),
    (dict(min_numel=1.5), "min_numel"),
    (dict(min_numel=None), "min_numel"),
    (dict(min_dim=0), "min_dim"),
    (dict(min_dim=True), "min_dim"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(skip="fc"), "skip"),
    (dict(skip=[1]), "skip"),
    (dict(skip=None), "skip"),
    (dict(skip=["("]), "skip"),
    (dict(overrides=[("fc", {})]), "overrides"),
    (dict(overrides={"(": {"max_rank": 4}}), "overrides"),
    (dict(overrides={1: {"max_rank": 4}}), "overrides"),
    (dict(overrides={"fc": 4}), "overrides"),
    (dict(overrides={"fc": {"max_rnk": 4}}), "max_rnk"),
    (dict(overrides={"fc": {"max_rank": 0}}), "max_rank"),
    (dict(overrides={"fc": {"init": "foo"}}), "init"),
    (dict(overrides={"fc": {"skip": "yes"}}), "skip"),
    (dict(overrides={"fc": {"skip": 1}}), "skip"),
]


@pytest.mark.parametrize("kwargs, field", INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        TensorizeConfig(**kwargs)
    assert field in str(info.value)


def test_override_errors_name_the_pattern():
    with pytest.raises(ValueError, match=r"overrides\['fc'\]"):
        TensorizeConfig(overrides={"fc": {"rank_ratio": 2.0}})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_rank=None),
        dict(max_rank=1),
        dict(rank_ratio=1),
        dict(rank_ratio=0.25),
        dict(rel_tol=0),
        dict(rel_tol=1.0),
        dict(num_modes=1),
        dict(num_modes=12),
        dict(max_pad_fraction=0),
        dict(max_pad_fraction=1),
        dict(min_numel=0),
        dict(min_dim=1),
        dict(seed=0),
        dict(skip=["fc", r"^head\."]),
        dict(row_modes=[4, 8]),
        dict(overrides={"fc": {"skip": False, "max_rank": 4}}),
    ],
)
def test_valid_boundary_values_are_accepted(kwargs):
    TensorizeConfig(**kwargs)


def test_layer_settings_validates_too():
    with pytest.raises(ValueError, match="LayerSettings.max_rank"):
        LayerSettings(max_rank=0)


def test_strings_are_coerced_to_enums():
    config = TensorizeConfig(init="random", linear_format="ttm", embedding_format="tt")
    assert config.init is Init.RANDOM
    assert config.linear_format is TTFormat.TTM
    assert config.embedding_format is TTFormat.TT
    assert TensorizeConfig(init=Init.SVD, linear_format=TTFormat.TT).init is Init.SVD
    assert config.format_for("embedding") is TTFormat.TT and config.format_for("linear") is TTFormat.TTM


def test_sequences_become_tuples():
    config = TensorizeConfig(skip=["a", "b"], row_modes=[4, 8], col_modes=[2, 16])
    assert config.skip == ("a", "b")
    assert config.row_modes == (4, 8) and config.col_modes == (2, 16)


def test_config_is_frozen():
    config = TensorizeConfig()
    with pytest.raises(AttributeError):
        config.max_rank = 4


def test_settings_for_applies_matching_overrides_in_order():
    config = TensorizeConfig(
        max_rank=32, rel_tol=0.1, overrides={r"fc": {"max_rank": 4, "init": "random"}, r"fc2": {"max_rank": 8}}
    )
    fc1 = config.settings_for("fc1.weight")
    assert (fc1.max_rank, fc1.init, fc1.rel_tol) == (4, Init.RANDOM, 0.1)
    fc2 = config.settings_for("fc2.weight")  # both match: the later entry wins for max_rank, init stays from the first
    assert (fc2.max_rank, fc2.init, fc2.rel_tol) == (8, Init.RANDOM, 0.1)
    other = config.settings_for("head.weight")
    assert (other.max_rank, other.init, other.rel_tol) == (32, Init.SVD, 0.1)
    assert isinstance(other, LayerSettings) and not isinstance(other, TensorizeConfig)

    reversed_order = TensorizeConfig(max_rank=32, overrides={r"fc2": {"max_rank": 8}, r"fc": {"max_rank": 4}})
    assert reversed_order.settings_for("fc2.weight").max_rank == 4


def test_settings_for_uses_search_not_full_match():
    config = TensorizeConfig(overrides={r"attn\.c_proj": {"max_rank": 3}, r"^lm_head": {"max_rank": 5}})
    assert config.settings_for("transformer.h.0.attn.c_proj.weight").max_rank == 3
    assert config.settings_for("lm_head.weight").max_rank == 5
    assert config.settings_for("x.lm_head.weight").max_rank == 32


def test_override_values_are_coerced_when_resolved():
    config = TensorizeConfig(overrides={"emb": {"embedding_format": "tt", "row_modes": [10, 10]}})
    settings = config.settings_for("emb.weight")
    assert settings.embedding_format is TTFormat.TT
    assert settings.row_modes == (10, 10)


def test_is_skipped():
    config = TensorizeConfig(skip=[r"^head\."], overrides={r"fc": {"skip": True}, r"fc1": {"skip": False}})
    assert config.is_skipped("head.weight")
    assert not config.is_skipped("x.head.weight")
    assert config.is_skipped("fc2.weight")
    assert not config.is_skipped("fc1.weight")  # the later override wins
    assert not config.is_skipped("emb.weight")
    assert not TensorizeConfig().is_skipped("anything")


def test_is_large():
    config = TensorizeConfig(min_numel=4096, min_dim=64)
    assert config.is_large((64, 64))
    assert not config.is_large((63, 4096))
    assert not config.is_large((64, 63))
    assert not config.is_large((32, 32))
    assert not config.is_large((64, 64, 1))  # only matrices
    assert TensorizeConfig().is_large((256, 256)) and not TensorizeConfig().is_large((255, 256))


def test_to_dict_from_dict_round_trip_through_json():
    config = TensorizeConfig(
        max_rank=12,
        rank_ratio=0.5,
        rel_tol=0.01,
        init="random",
        num_modes=3,
        row_modes=(4, 8),
        col_modes=(8, 4),
        linear_format="ttm",
        embedding_format="tt",
        max_pad_fraction=0.1,
        min_numel=100,
        min_dim=8,
        seed=7,
        skip=["a", "b"],
        overrides={"fc": {"max_rank": 4, "skip": False}, "head": {"skip": True}},
    )
    data = config.to_dict()
    assert data["init"] == "random" and data["linear_format"] == "ttm" and data["skip"] == ["a", "b"]
    restored = TensorizeConfig.from_dict(json.loads(json.dumps(data)))
    assert restored == config
    assert restored.to_dict() == data
    assert TensorizeConfig.from_dict(TensorizeConfig().to_dict()) == TensorizeConfig()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        TensorizeConfig.from_dict({"max_rank": 4, "bogus": 1})


def test_from_dict_validates_values():
    with pytest.raises(ValueError, match="max_rank"):
        TensorizeConfig.from_dict({"max_rank": 0})


def test_replace_validates():
    config = TensorizeConfig(max_rank=4)
    assert config.replace(max_rank=9).max_rank == 9
    with pytest.raises(ValueError, match="max_rank"):
        config.replace(max_rank=-3)


# ------------------------------------------------------------------------------------- renamed: param_budget


def test_param_budget_spelling_warns_and_means_size_target():
    with pytest.warns(DeprecationWarning, match="size_target"):
        old = TensorizeConfig(param_budget=0.3, min_numel=1000)
    assert old == TensorizeConfig(size_target=0.3, min_numel=1000)
    with pytest.warns(DeprecationWarning, match="size_target"):
        assert old.replace(param_budget=500) == old.replace(size_target=500)
    with pytest.warns(DeprecationWarning, match="size_target"):
        assert old.param_budget == 0.3
    with pytest.warns(DeprecationWarning, match="size_target"):  # a dict logged before the rename
        logged = {**TensorizeConfig().to_dict(), "param_budget": 0.3}
        logged.pop("size_target")
        assert TensorizeConfig.from_dict(logged) == TensorizeConfig(size_target=0.3)
    with pytest.raises(TypeError, match="size_target"):
        TensorizeConfig(param_budget=0.3, size_target=0.3)


def test_summary_budget_spelling_warns_and_returns_the_size_target():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 64))
    summary = comera_fx.tensorize_(model, TensorizeConfig(size_target=0.3, min_numel=1000))
    with pytest.warns(DeprecationWarning, match="size_target"):
        assert summary.budget is summary.size_target
    dense = 128 * 96 + 96 * 64
    assert summary.size_target.asked == round(0.3 * dense) and summary.size_target.dense == dense


# -- a config of the wrong type fails at the call, naming the config to write --------------------------------------


def _small_mlp():
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40))


@pytest.mark.parametrize(
    "config, fix",
    [
        ({"max_rank": 8}, "TensorizeConfig(max_rank=8)"),
        ({"max_rank": 8, "init": "random"}, "TensorizeConfig(max_rank=8, init='random')"),
        (8, "TensorizeConfig(max_rank=32)"),
    ],
)
def test_tensorize_with_a_dict_or_a_number_says_which_config_to_write(config, fix):
    model = _small_mlp()
    with pytest.raises(TypeError, match="takes a TensorizeConfig") as info:
        comera_fx.tensorize_(model, config)
    assert fix in str(info.value)
    assert not any(isinstance(m, comera_fx.TTLinear) for m in model.modules()), "nothing may be converted"


def test_the_graph_pass_refuses_a_dict_too():
    gm = torch.fx.symbolic_trace(_small_mlp())
    with pytest.raises(TypeError, match=r"TensorizeConfig\(max_rank=8\)"):
        comera_fx.passes.tensorize(gm, {"max_rank": 8})


@pytest.mark.parametrize("config", [0.5, {"keep_fraction": 0.5}])
def test_rank_adaptive_with_a_number_or_a_dict_names_the_configs(config):
    model = _small_mlp()
    comera_fx.tensorize_(model, TensorizeConfig(min_numel=1, min_dim=1, max_rank=8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"takes a BudgetConfig or a CoMERAConfig, .*BudgetConfig\(keep_fraction=0.5, "):
        comera_fx.RankAdaptive(model, optimizer, config)
