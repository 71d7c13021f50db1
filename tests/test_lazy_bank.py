"""The weight-space form reads ``P[e]`` from expert e's cores alone (``comera_fx.moe.lazy_bank``): results equal the
dense model's (float64) and the whole-bank rebuild's, only the routed experts are rebuilt and get gradients, and an
index reads what it reads on the dense P. References: the dense models (deep copies before conversion), the dense
3D weight a bank was decomposed from.
"""

from __future__ import annotations

import copy

import pytest
import torch

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.moe import TTExpertBank
from comera_fx.moe.lazy_bank import LazyBank
from comera_fx.moe.shared import SharedTTExpertBank

transformers = pytest.importorskip("transformers")
from comera_fx.testing.moe_families import build, families, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = dict(families())
FULL = TensorizeConfig(max_rank=10**6, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head"))
#: Ergo computes its norms, rotary and router in float32 whatever the model's dtype: float32 tolerances there.
TOLERANCE = {"ergo": {"rtol": 1e-4, "atol": 1e-6}}


def tokens(batch: int = 2, length: int = 8):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))


def converted(family: str, config: TensorizeConfig = FULL, **changes):
    """(converted float64 model, its dense float64 twin) of a family at experts_implementation="eager"."""
    counts = {
        k: 8
        for k in ("num_local_experts", "num_experts", "n_routed_experts")
        if hasattr(tiny_config(family, FAMILIES[family]), k)
    }
    model = build(family, FAMILIES[family], **counts, **changes).double()
    model.config._experts_implementation = "eager"
    dense = copy.deepcopy(model)
    comera_fx.tensorize_(model, config)
    return model, dense


def whole_bank_rebuild(monkeypatch):
    """Today's path before the lazy bank: every read of the forward sees the whole rebuilt bank."""
    monkeypatch.setattr("comera_fx.moe.weight_space.plain_eager", lambda: False)


ROUTED_LOOPS = [(f, i) for f in ("gpt_oss", "deepseek_v4", "ergo") for i in ("eager", "batched_mm")] + [
    ("jetmoe", "eager")
]  # JetMoE has no experts_implementation switch


@pytest.mark.parametrize("family,impl", ROUTED_LOOPS)
def test_routed_reads_equal_the_dense_model_and_the_whole_bank_rebuild(family, impl, monkeypatch):
    model, dense = converted(family)
    model.config._experts_implementation = dense.config._experts_implementation = impl
    with torch.no_grad():
        lazy = model(tokens()).logits
        torch.testing.assert_close(lazy, dense(tokens()).logits, **TOLERANCE.get(family, {"rtol": 1e-9, "atol": 1e-10}))
        whole_bank_rebuild(monkeypatch)
        torch.testing.assert_close(lazy, model(tokens()).logits, rtol=0, atol=1e-12)


def gpt_oss_experts(form: str = "per_expert"):
    model, dense = converted("gpt_oss", FULL.replace(expert_form=form))
    return model.model.layers[0].mlp.experts, dense.model.layers[0].mlp.experts


def routing(num_tokens: int, experts: tuple[int, ...]):
    """Top-2 routing of ``num_tokens`` tokens to the given experts only, and its weights."""
    index = torch.tensor([[experts[t % len(experts)], experts[(t + 1) % len(experts)]] for t in range(num_tokens)])
    weights = torch.softmax(
        torch.randn(num_tokens, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64), dim=-1
    )
    return index, weights


def test_only_the_routed_experts_are_rebuilt_and_get_non_zero_gradients():
    experts, dense = gpt_oss_experts()
    banks = {attr: getattr(experts, f"{attr}_tt") for attr in ("gate_up_proj", "down_proj")}
    rebuilt = []
    for attr, bank in banks.items():
        original = bank.dense_expert
        bank.dense_expert = lambda e, attr=attr, original=original: rebuilt.append((attr, e)) or original(e)
    hidden = torch.randn(10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    index, weights = routing(10, (1, 6))
    x = hidden.clone().requires_grad_()
    x_dense = hidden.clone().requires_grad_()
    out = experts(x, index, weights)
    expected = dense(x_dense, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert sorted(rebuilt) == sorted((attr, e) for attr in banks for e in (1, 6))
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-9, atol=1e-11)
    for attr, bank in banks.items():  # every expert gets a gradient (DDP expects one), zero where no token went
        assert all(p.grad is not None for p in bank.parameters())
        reached = {e for e in range(len(bank)) if all(bool(p.grad.any()) for p in bank[e].parameters())}
        untouched = {e for e in range(len(bank)) if not any(bool(p.grad.any()) for p in bank[e].parameters())}
        assert reached == {1, 6} and untouched == set(range(8)) - {1, 6}
        dense_grad = getattr(dense, attr).grad  # the dense model's gradient is non-zero on the same experts
        assert {e for e in range(8) if bool(dense_grad[e].any())} == reached


def test_core_gradients_equal_the_whole_bank_rebuild(monkeypatch):
    experts, _ = gpt_oss_experts()
    twin = copy.deepcopy(experts)
    hidden = torch.randn(10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    index, weights = routing(10, (0, 3, 5))
    experts(hidden, index, weights).pow(2).sum().backward()
    whole_bank_rebuild(monkeypatch)
    twin(hidden, index, weights).pow(2).sum().backward()
    grads = dict(experts.named_parameters())
    for name, p in twin.named_parameters():
        if grads[name].grad is None:  # an expert no token reached: the whole rebuild gives it zeros
            assert not bool(p.grad.any()), name
        else:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-9, atol=1e-12)


def test_the_shared_form_reads_routed_experts_too():
    experts, dense = gpt_oss_experts("shared")
    assert isinstance(experts.gate_up_proj_tt, SharedTTExpertBank)
    hidden = torch.randn(10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    index, weights = routing(10, (2, 7))
    torch.testing.assert_close(experts(hidden, index, weights), dense(hidden, index, weights), rtol=1e-9, atol=1e-11)


@pytest.fixture
def bank_and_weight():
    weight = torch.randn(5, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return TTExpertBank.from_dense(weight, "matmul", max_rank=10**6), weight


@pytest.mark.parametrize(
    "index",
    [
        3,
        -1,
        torch.tensor(2),
        torch.tensor([4, 0, 4, -2]),
        slice(1, 3),
        torch.tensor([True, False, True, False, True]),
        (2, slice(None), 0),
    ],
    ids=["int", "negative", "0-dim", "ids", "slice", "mask", "tuple"],
)
def test_an_index_reads_what_it_reads_on_the_dense_weight(bank_and_weight, index):
    bank, weight = bank_and_weight
    got = LazyBank(bank)[index]
    assert got.shape == weight[index].shape
    torch.testing.assert_close(got, weight[index], rtol=1e-10, atol=1e-12)


def test_whole_bank_reads_and_attributes(bank_and_weight):
    bank, weight = bank_and_weight
    lazy = LazyBank(bank)
    x = torch.randn(5, 3, 12, dtype=torch.float64)
    torch.testing.assert_close(torch.bmm(x, lazy), torch.bmm(x, weight), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lazy.transpose(-2, -1), weight.transpose(-2, -1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lazy * 2, weight * 2, rtol=1e-10, atol=1e-12)
    assert (lazy.shape, lazy.dtype, lazy.dim(), len(lazy)) == (weight.shape, weight.dtype, 3, 5)


@pytest.mark.parametrize("index", [5, -6, torch.tensor(7), torch.tensor([0, 5])])
def test_an_index_out_of_range_raises(bank_and_weight, index):
    with pytest.raises(IndexError, match="out of bounds"):
        LazyBank(bank_and_weight[0])[index]


def test_an_in_place_write_to_a_routed_expert_raises(bank_and_weight):
    with pytest.raises(RuntimeError, match="TT cores"):
        LazyBank(bank_and_weight[0])[1].mul_(2)


def test_rank_adaptive_trains_and_shrinks_with_routed_reads(tmp_path):
    """Experts no token reaches get a zero gradient in a step (as the dense weight's rows): the schedule must
    still prune the others, and a pruned model must save and load."""
    from comera_fx import RankAdaptive, BudgetConfig

    model = build("gpt_oss", FAMILIES["gpt_oss"], num_local_experts=8).train()
    model.config._experts_implementation = "eager"
    comera_fx.tensorize_(model, FULL.replace(max_rank=8))
    banks = [m for m in model.modules() if isinstance(m, TTExpertBank)]
    before = sum(tt.layout.num_params for b in banks for tt in b)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=8, prunes=2))
    ids = tokens(1, 4)  # 4 tokens, top-2 of 8 experts: some experts get no token
    losses, untouched = [], 0
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        untouched += sum(all(not bool(p.grad.any()) for p in tt.parameters()) for b in banks for tt in b)
        hook.observe(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert untouched and losses[-1] < losses[0]
    assert sum(tt.layout.num_params for b in banks for tt in b) < before
    model.eval()
    path = tmp_path / "pruned.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(
        path, lambda: build("gpt_oss", FAMILIES["gpt_oss"], seed=9, num_local_experts=8)
    ).eval()
    loaded.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)
