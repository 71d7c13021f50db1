"""Mixture-of-experts weights in TT form (comera_fx.moe): found, converted, equivalent at full rank, trained under
RankAdaptive (an expert no token reached keeps its ranks), saved and loaded.

Models: tiny random-init Mixtral and Qwen2-MoE / Qwen3-MoE from transformers (1 layer, 4 experts, top-2), and two
hand-written MoE layers: experts as an nn.ModuleList of linears (the older layout) and raw 3D parameters read
through torch.bmm. References are the dense originals (deep copies taken before conversion), in float64 where
the model's expert path has one.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import comera_fx
from comera_fx import RankAdaptive, BudgetConfig, TensorizeConfig
from comera_fx.moe import ExpertWeight, TTExpertBank, TTExperts
from comera_fx.passes import find_experts
from comera_fx.runtime.shrink import shrink_

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = TensorizeConfig(max_rank=10**6, min_numel=0, min_dim=1)
EXPERTS_ONLY = dict(skip=(r"embed", r"lm_head", r"self_attn", r"mlp\.gate\.", r"shared_expert"))
VOCAB, HIDDEN, FFN, EXPERTS = 64, 32, 48, 4


def mixtral(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(cfg).eval()


def qwen2_moe(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=64,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def qwen3_moe(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=FFN,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


HF_MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


def tokens(seed: int = 1, batch: int = 3, length: int = 8):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def experts_of(model):
    return model.model.layers[0].mlp.experts


class ExpertMLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w_in, self.w_out = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x)))


class ListMoE(nn.Module):
    """Top-2 MoE with its experts in an nn.ModuleList (the older layout), looping over the experts hit."""

    def __init__(self, d: int = HIDDEN, f: int = FFN, experts: int = EXPERTS):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP(d, f) for _ in range(experts)])

    def forward(self, x):
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class BmmMoE(nn.Module):
    """Top-1 MoE whose experts are raw 3D parameters used through torch.bmm (every expert sees every token,
    masked: the expert dimension is bmm's batch dimension)."""

    def __init__(self, d: int = HIDDEN, f: int = FFN, experts: int = EXPERTS):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, f) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, f, d) / f**0.5)

    def forward(self, x):
        probs = self.router(x).softmax(-1)  # (T, E)
        top, index = probs.max(-1)
        mask = F.one_hot(index, probs.shape[-1]).to(x.dtype).t()[..., None]  # (E, T, 1)
        xs = x.expand(probs.shape[-1], *x.shape) * mask
        y = torch.bmm(F.gelu(torch.bmm(xs, self.w_in)), self.w_out)
        return (y * mask).sum(0) * top[:, None]


def wrapped(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Identity(), layer)  # tensorize_ does not replace the root's own parameters


# ------------------------------------------------------------------------------------------------------- finding


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_transformers_experts_are_found_with_their_expert_dimension(name):
    model = HF_MODELS[name]()
    scan = find_experts(model)
    experts = experts_of(model)
    assert {c.fqn.rpartition(".")[2] for c in scan.candidates} == {"gate_up_proj", "down_proj"}
    for cand in scan.candidates:
        assert cand.layout == "hf-experts" and cand.expert_dim == 0 and cand.num_experts == EXPERTS
        assert cand.shape == tuple(getattr(experts, cand.fqn.rpartition(".")[2]).shape)
        assert f"expert dim 0 of {cand.shape}" in cand.describe()
    # with example inputs, the eager loop's ops tell which experts the tokens reached
    model.config._experts_implementation = "eager"
    traced = find_experts(model, (tokens(),))
    for cand in traced.candidates:
        assert cand.uses == ["linear(x, P[e])"] and cand.experts_seen and set(cand.experts_seen) <= set(range(4))


def test_the_bmm_parameters_are_found_only_by_running_the_model():
    model = wrapped(BmmMoE())
    assert find_experts(model).candidates == []  # a module scan cannot know how a raw 3D parameter is read
    scan = find_experts(model, (torch.randn(10, HIDDEN),))
    assert [(c.fqn, c.layout, c.slice_use) for c in scan.candidates] == [
        ("1.w_in", "3d-parameter", "matmul"),
        ("1.w_out", "3d-parameter", "matmul"),
    ]
    assert all(c.uses == ["bmm(x, P)"] and c.experts_seen == (0, 1, 2, 3) for c in scan.candidates)


def test_a_3d_parameter_read_by_an_unsupported_op_gets_the_weight_space_form():
    class Einsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN))

        def forward(self, x):
            return torch.bmm(x, self.w) + torch.einsum("etd,edf->etf", x, self.w)

    model = wrapped(Einsum()).double()
    dense = copy.deepcopy(model)
    x = torch.randn(EXPERTS, 3, HIDDEN, dtype=torch.float64)
    summary = comera_fx.tensorize_(model, FULL, example_inputs=(x,))
    (decision,) = [d for d in summary.layers if d.kind == "experts"]
    assert decision.converted and any("weight-space" in n and "einsum" in n for n in decision.notes)
    assert "w" not in dict(model[1].named_parameters()) and isinstance(model[1].w_tt, TTExpertBank)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-10, atol=1e-10)  # the module's own forward, exact
    # a 3D weight no op reads as experts is no candidate at all
    conv = nn.Sequential(nn.Identity(), nn.Conv1d(4, 4, 3))
    summary = comera_fx.tensorize_(conv, FULL, example_inputs=(torch.randn(2, 4, 8),))
    assert not [d for d in summary.layers if d.kind == "experts"]


# ----------------------------------------------------------------------------------------- full-rank equivalence


@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_full_rank_transformers_moe_reproduces_the_dense_model_in_float64(name, implementation):
    model = HF_MODELS[name]().double()
    model.config._experts_implementation = implementation
    dense = copy.deepcopy(model)
    ids = tokens()
    summary = comera_fx.tensorize_(model, FULL.replace(**EXPERTS_ONLY))
    converted = {d.fqn.rpartition(".")[2] for d in summary.converted}
    assert converted == {"gate_up_proj", "down_proj"} and all(d.kind == "experts" for d in summary.converted)
    assert isinstance(experts_of(model), TTExperts) and type(model.model.layers[0].mlp) is type(
        dense.model.layers[0].mlp
    )  # the router and the block around the experts are untouched
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters())

    # the experts module alone, on the same routing: float64 to rounding
    hidden = torch.randn(24, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _, weights, index = dense.model.layers[0].mlp.gate(hidden)
    weights = weights.to(torch.float64)
    torch.testing.assert_close(
        experts_of(model)(hidden, index, weights), experts_of(dense)(hidden, index, weights), rtol=1e-10, atol=1e-12
    )
    # the whole model (its RMSNorm computes in float32, so the logits agree to float32 rounding)
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-6)


def test_full_rank_matches_the_grouped_mm_path_in_float32():
    model = mixtral()
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default here
    dense = copy.deepcopy(model)
    ids = tokens()
    comera_fx.tensorize_(model, FULL.replace(**EXPERTS_ONLY), example_inputs=(ids,))
    assert isinstance(experts_of(model), TTExperts)
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-5)


def test_each_expert_is_its_own_tt_matrix_with_its_own_gates():
    model = mixtral().double()
    dense = copy.deepcopy(experts_of(model))
    comera_fx.tensorize_(model, FULL.replace(max_rank=4, **EXPERTS_ONLY))
    bank = experts_of(model).gate_up_proj
    assert isinstance(bank, TTExpertBank) and len(bank) == EXPERTS
    gates = [id(g) for tt in bank for g in tt.gates]
    assert len(set(gates)) == len(gates)
    # truncated: each expert is the rank-4 TT-SVD of its own slice (no sharing between experts)
    for e in range(EXPERTS):
        alone = comera_fx.tt.make_tt_matrix(dense.gate_up_proj[e].detach().t(), kind="linear", max_rank=4)
        torch.testing.assert_close(bank.dense_expert(e), alone.dense().t(), rtol=1e-9, atol=1e-10)


def test_the_module_list_layout_converts_each_expert_and_names_it():
    model = wrapped(ListMoE()).double()
    dense = copy.deepcopy(model)
    x = torch.randn(20, HIDDEN, dtype=torch.float64)
    summary = comera_fx.tensorize_(model, FULL.replace(skip=(r"router",)), example_inputs=(x,))
    converted = {d.fqn: d for d in summary.converted}
    assert len(converted) == 2 * EXPERTS
    assert "expert 2 of 4 in the nn.ModuleList '1.experts'" in " ".join(converted["1.experts.2.w_in.weight"].notes)
    assert all(isinstance(m, comera_fx.TTLinear) for e in model[1].experts for m in (e.w_in, e.w_out))
    torch.testing.assert_close(model(x), dense(x), rtol=1e-10, atol=1e-12)


def test_the_shared_form_of_an_expert_list_is_exact_trains_and_saves(tmp_path):
    from comera_fx.moe.expert_list import SharedExpertLinear
    from comera_fx.moe.shared import SharedTTExpertBank

    model = wrapped(ListMoE()).double()
    dense = copy.deepcopy(model)
    x = torch.randn(20, HIDDEN, dtype=torch.float64)
    summary = comera_fx.tensorize_(model, FULL.replace(skip=(r"router",), expert_form="shared"), example_inputs=(x,))
    assert [d.fqn for d in summary.converted] == ["1.experts.*.w_in.weight", "1.experts.*.w_out.weight"]
    assert all(isinstance(m, SharedExpertLinear) for e in model[1].experts for m in (e.w_in, e.w_out))
    assert isinstance(model[1].experts_w_in_shared, SharedTTExpertBank)
    assert not [n for n in dict(model.named_parameters()) if n.endswith(".weight") and "experts" in n]
    torch.testing.assert_close(model(x), dense(x), rtol=1e-10, atol=1e-12)  # full rank: exact

    low = wrapped(ListMoE())
    comera_fx.tensorize_(
        low, FULL.replace(max_rank=4, skip=(r"router",), expert_form="shared"), example_inputs=(x.float(),)
    )
    chain = low[1].experts_w_in_shared.tt
    low(x.float()).square().sum().backward()
    assert chain.cores[0].grad is not None and max(chain.ranks) <= 4
    expected = low(x.float())
    clone = copy.deepcopy(low)  # one chain in the copy too, shared by its experts' linears
    assert clone[1].experts[0].w_in.bank is clone[1].experts_w_in_shared is not low[1].experts_w_in_shared
    path = tmp_path / "list.safetensors"
    comera_fx.save_tensorized(low, path)
    loaded = comera_fx.load_tensorized(path, lambda: wrapped(ListMoE()))
    assert loaded[1].experts[2].w_out.bank is loaded[1].experts_w_out_shared
    torch.testing.assert_close(loaded(x.float()), expected, rtol=0, atol=0)


def test_the_bmm_layout_reproduces_the_dense_layer_in_float64():
    model = wrapped(BmmMoE()).double()
    dense = copy.deepcopy(model)
    x = torch.randn(20, HIDDEN, dtype=torch.float64)
    summary = comera_fx.tensorize_(model, FULL.replace(skip=(r"router",)), example_inputs=(x,))
    assert {d.fqn for d in summary.converted} == {"1.w_in", "1.w_out"}
    assert "3d-parameter: expert dim 0" in " ".join(summary.converted[0].notes)
    assert isinstance(model[1].w_in, ExpertWeight) and "w_in" not in dict(model[1].named_parameters())
    out, ref = model(x), dense(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # gradients reach every expert's cores (bmm gives each expert its masked tokens)
    out.square().sum().backward()
    assert all(tt.cores[0].grad is not None for tt in model[1].w_in_tt)
    # indexing gives a slice whose F.linear / matmul run that expert's product
    torch.testing.assert_close(x @ model[1].w_in[2], x @ dense[1].w_in[2], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(F.linear(x, model[1].w_out[1]), F.linear(x, dense[1].w_out[1]), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------- rank adaptation


def _route_away_from(model, expert: int):
    """A forward hook on the router that sends every choice of ``expert`` to the next expert: no token reaches it
    (the routing code itself is not touched)."""

    def hook(module, args, out):
        logits, weights, index = out
        return logits, weights, torch.where(index == expert, (index + 1) % EXPERTS, index)

    return model.model.layers[0].mlp.gate.register_forward_hook(hook)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_rank_adaptive_trains_the_experts_and_spares_an_expert_no_token_reached(set_to_none):
    model = mixtral()
    model.config._experts_implementation = "eager"
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, **EXPERTS_ONLY))
    _route_away_from(model, 3)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(keep_fraction=0.5, total_steps=8, prunes=2, warmup_fraction=0.25, final_fraction=0.25),
    )
    banks = [experts_of(model).gate_up_proj, experts_of(model).down_proj]
    names = {m.name for m in hook.matrices}
    assert {f"model.layers.0.mlp.experts.gate_up_proj.{e}" for e in range(EXPERTS)} <= names
    before = [[tt.ranks for tt in bank] for bank in banks]
    ids = tokens(batch=4, length=16)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        hook.observe(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
    after = [[tt.ranks for tt in bank] for bank in banks]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert hook.live_tt_params() < hook.initial_tt_params
    assert all(a[3] == b[3] for a, b in zip(after, before))  # the expert no token reached keeps its ranks
    assert any(a[e] != b[e] for a, b in zip(after, before) for e in range(3))  # the others adapted
    assert not any("experts.down_proj.3" in name or "gate_up_proj.3" in name for name in hook.zeroed)


# ---------------------------------------------------------------------------------------------- save and load


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_state_dict_and_save_tensorized_round_trip_a_pruned_moe(name, tmp_path):
    model = HF_MODELS[name]()
    model.config._experts_implementation = "eager"
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, **EXPERTS_ONLY))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    _hook = RankAdaptive(
        model,
        optimizer,
        BudgetConfig(keep_fraction=0.6, total_steps=4, prunes=1, warmup_fraction=0.25, final_fraction=0.5),
    )
    ids = tokens()
    for _ in range(4):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    pruned = {n: tt.ranks for n, tt in experts_of(model).named_modules() if isinstance(tt, comera_fx.TTMatrix)}
    assert len(set(pruned.values())) > 1
    expected = model(ids).logits

    # state_dict into a freshly converted model adopts the pruned ranks
    fresh = HF_MODELS[name](seed=5)
    fresh.config._experts_implementation = "eager"
    comera_fx.tensorize_(fresh, TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, **EXPERTS_ONLY))
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(ids).logits, expected, rtol=0, atol=0)

    path = tmp_path / "moe.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, lambda: HF_MODELS[name](seed=7)).eval()
    assert isinstance(experts_of(loaded), TTExperts)
    assert {n: tt.ranks for n, tt in experts_of(loaded).named_modules() if isinstance(tt, comera_fx.TTMatrix)} == pruned
    loaded.config._experts_implementation = "eager"
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def test_save_tensorized_round_trips_the_bmm_layout(tmp_path):
    torch.manual_seed(0)
    model = wrapped(BmmMoE())
    x = torch.randn(12, HIDDEN)
    comera_fx.tensorize_(
        model, TensorizeConfig(max_rank=4, min_numel=0, min_dim=1, skip=(r"router",)), example_inputs=(x,)
    )
    path = tmp_path / "bmm.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, lambda: wrapped(BmmMoE()))
    assert isinstance(loaded[1].w_in, ExpertWeight)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- RMM and compilation


def _experts_and_routing(seed: int = 0, tokens_: int = 24):
    model = mixtral(seed).double()
    comera_fx.tensorize_(model, TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, **EXPERTS_ONLY))
    hidden = torch.randn(tokens_, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, weights, index = model.model.layers[0].mlp.gate(hidden)
    return model, hidden, index, weights.detach().to(torch.float64)


def _grads(experts, hidden, index, weights):
    x = hidden.clone().requires_grad_(True)
    out = experts(x, index, weights)
    out.square().sum().backward()
    cores = [None if tt.cores[1].grad is None else tt.cores[1].grad.clone() for tt in experts.gate_up_proj]
    experts.zero_grad(set_to_none=True)
    return out.detach(), x.grad, cores


def test_randomize_backward_reaches_each_experts_products():
    model, hidden, index, weights = _experts_and_routing()
    experts = experts_of(model).train()
    exact_out, exact_dx, exact_cores = _grads(experts, hidden, index, weights)
    summary = comera_fx.randomize_backward_(model, rho=0.5, min_numel=0)
    banks = [d for d in summary.layers if d.kind == "tt_experts"]
    assert [d.fqn for d in banks] == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    assert all(d.randomized for d in banks)
    shown = comera_fx.report(model)
    expert_rows = [r for r in shown.layers if ".experts." in r.fqn]
    assert expert_rows and all(r.backward.startswith("rmm rho=0.5") for r in expert_rows), expert_rows
    assert {r.fqn for r in shown.randomized} >= {d.fqn for d in banks}
    out, dx, cores = _grads(experts, hidden, index, weights)
    torch.testing.assert_close(out, exact_out, rtol=1e-12, atol=1e-12)  # forward exact
    torch.testing.assert_close(dx, exact_dx, rtol=1e-10, atol=1e-12)  # dX exact
    assert all(torch.isfinite(c).all() for c in cores)
    assert all(not torch.allclose(c, e) for c, e in zip(cores, exact_cores))  # sketched core gradients
    assert comera_fx.restore_backward_(model) >= 2
    _, _, restored = _grads(experts, hidden, index, weights)
    for c, e in zip(restored, exact_cores):
        torch.testing.assert_close(c, e, rtol=1e-10, atol=1e-12)


def test_the_backend_compiles_the_experts_products():
    """One small check in the default run (the backend's eager mode: no Inductor): forward and gradients of the
    compiled experts module equal the eager ones. Two experts are hit, to keep the trace short."""
    model, hidden, index, weights = _experts_and_routing(tokens_=12)
    index = index % 2
    experts = experts_of(model)
    expected, expected_dx, expected_cores = _grads(experts, hidden, index, weights)
    backend = comera_fx.make_backend(inductor=False)
    out, dx, cores = _grads(torch.compile(experts, backend=backend), hidden, index, weights)
    assert backend.stats.graphs >= 1
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx, expected_dx, rtol=1e-10, atol=1e-12)
    assert [c is None for c in cores] == [c is None for c in expected_cores] == [False] * 4  # zero where unreached
    assert not cores[2].any() and not cores[3].any()
    for c, e in zip(cores[:2], expected_cores[:2]):
        torch.testing.assert_close(c, e, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------- shared form


def test_the_shared_form_at_full_rank_reproduces_the_experts_and_shares_all_but_one_core():
    from comera_fx.moe.shared import SharedTTExpertBank

    model = mixtral().double()
    model.config._experts_implementation = "eager"
    dense = copy.deepcopy(model)
    experts = experts_of(model)
    up = SharedTTExpertBank.from_dense(experts.gate_up_proj, "linear", max_rank=10**6)
    down = SharedTTExpertBank.from_dense(experts.down_proj, "linear", max_rank=10**6)
    torch.testing.assert_close(up.dense(), experts.gate_up_proj.detach(), rtol=1e-10, atol=1e-12)
    assert up.tt.col_modes[0] == EXPERTS and up.tt.cores[len(up.tt.row_modes)].shape[1] == EXPERTS  # expert core
    # at one rank cap, the shared chain stores the non-expert cores once: fewer parameters than E chains
    capped = SharedTTExpertBank.from_dense(experts.gate_up_proj, "linear", max_rank=4)
    assert capped.tt.layout.num_params < sum(
        tt.layout.num_params for tt in TTExpertBank.from_dense(experts.gate_up_proj, "linear", max_rank=4)
    )
    model.model.layers[0].mlp.experts = TTExperts.from_hf(experts, up, down)
    ids = tokens()
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-6)
    # truncated, it still trains: the gradient reaches the shared cores through every expert hit
    small = SharedTTExpertBank.from_dense(dense.model.layers[0].mlp.experts.down_proj, "linear", max_rank=4)
    x = torch.randn(5, FFN, dtype=torch.float64)
    torch.testing.assert_close(small.linear(1, x), x @ small.dense_expert(1).t(), rtol=1e-10, atol=1e-12)
    small.linear(1, x).sum().backward()
    assert all(c.grad is not None for c in small.tt.cores)


def test_save_tensorized_round_trips_the_shared_form_after_a_prune(tmp_path):
    from comera_fx.moe.shared import SharedTTExpertBank

    model = mixtral()
    model.config._experts_implementation = "eager"
    experts = experts_of(model)
    up = SharedTTExpertBank.from_dense(experts.gate_up_proj, "linear", max_rank=6)
    down = SharedTTExpertBank.from_dense(experts.down_proj, "linear", max_rank=6)
    model.model.layers[0].mlp.experts = TTExperts.from_hf(experts, up, down)
    with torch.no_grad():  # a prune: the shared chain's stored ranks differ from a fresh TT-SVD's
        for gate in up.tt.gates:
            gate[-1] = 0.0
    assert shrink_(up.tt) is not None
    ids = tokens()
    expected = model(ids).logits
    path = tmp_path / "shared.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, mixtral)
    loaded.config._experts_implementation = "eager"
    banks = experts_of(loaded)
    assert isinstance(banks.up, SharedTTExpertBank) and isinstance(banks.down_proj, SharedTTExpertBank)
    assert banks.up.tt.ranks == up.tt.ranks and banks.up.num_experts == EXPERTS
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------- size target


def _expert_tt_params(model) -> int:
    return sum(tt.layout.num_params for bank in (experts_of(model).up, experts_of(model).down_proj) for tt in bank)


@pytest.mark.parametrize("allocation", ["uniform", "energy"])
def test_a_size_target_sizes_the_experts_with_the_other_layers(allocation):
    """The experts count towards the size target (each expert's matrix sized like a layer), the target holds over
    everything converted, and with room for full ranks everywhere the model equals the dense one."""
    model = mixtral().double()
    model.config._experts_implementation = "eager"
    dense = copy.deepcopy(model)
    config = TensorizeConfig(
        size_target=0.3, max_rank=None, allocation=allocation, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head")
    )
    summary = comera_fx.tensorize_(model, config)
    assert isinstance(experts_of(model), TTExperts)
    converted = [d for d in summary.layers if d.converted]
    dense_total = sum(math.prod(d.shape) for d in converted)
    tt_total = sum(m.layout.num_params for m in model.modules() if isinstance(m, comera_fx.TTMatrix))
    assert summary.size_target.reached == tt_total <= 0.3 * dense_total  # experts inside the target
    full = mixtral().double()
    comera_fx.tensorize_(full, FULL.replace(skip=(r"embed", r"lm_head")))
    assert 0 < _expert_tt_params(model) < _expert_tt_params(full)  # sized, not left at full rank
    ids = tokens()
    with torch.no_grad():
        got, want = model(ids).logits, dense(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1.0  # a compressed model, not a broken one

    loose = mixtral().double()
    loose.config._experts_implementation = "eager"
    comera_fx.tensorize_(loose, config.replace(size_target=10**9))  # room for every bond at full rank: exact
    with torch.no_grad():
        torch.testing.assert_close(loose(ids).logits, want, rtol=1e-6, atol=1e-8)


def test_a_size_target_covers_bmm_experts():
    torch.manual_seed(0)
    model = wrapped(BmmMoE()).double()
    x = torch.randn(12, HIDDEN, dtype=torch.float64)
    expected = model(x)
    summary = comera_fx.tensorize_(
        model,
        TensorizeConfig(size_target=10**9, max_rank=None, min_numel=0, min_dim=1, skip=(r"router",)),
        example_inputs=(x,),
    )
    assert isinstance(model[1].w_in, ExpertWeight) and isinstance(model[1].w_out, ExpertWeight)
    assert summary.size_target.reached == sum(
        tt.layout.num_params for bank in (model[1].w_in_tt, model[1].w_out_tt) for tt in bank
    )
    torch.testing.assert_close(model(x), expected, rtol=1e-8, atol=1e-10)


def test_tensorize_builds_the_shared_form_when_asked_and_leaves_bmm_experts_per_expert():
    from comera_fx.moe.shared import SharedTTExpertBank
    from comera_fx.tt.inventory import tt_matrices

    model = mixtral().double()
    model.config._experts_implementation = "eager"
    dense = copy.deepcopy(model)
    summary = comera_fx.tensorize_(model, FULL.replace(expert_form="shared", **EXPERTS_ONLY))
    experts = experts_of(model)
    assert isinstance(experts.up, SharedTTExpertBank) and isinstance(experts.down_proj, SharedTTExpertBank)
    notes = [n for d in summary.layers if d.kind == "experts" and d.converted for n in d.notes]
    assert sum("shared form" in n for n in notes) == 2
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-6, atol=1e-8)  # full rank: exact
    assert {m.name for m in tt_matrices(model)} == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }  # RankAdaptive sees both

    torch.manual_seed(0)
    bmm = wrapped(BmmMoE())
    x = torch.randn(12, HIDDEN)
    summary = comera_fx.tensorize_(
        bmm,
        TensorizeConfig(max_rank=4, min_numel=0, min_dim=1, skip=(r"router",), expert_form="shared"),
        example_inputs=(x,),
    )
    assert isinstance(bmm[1].w_in, ExpertWeight)
    assert any("expert_form='shared' needs a transformers experts module" in n for d in summary.layers for n in d.notes)
    with pytest.raises(ValueError, match="expert_form"):
        TensorizeConfig(expert_form="shared", init="random")


class GroupedExperts(nn.Module):
    """Tokens already grouped per expert (E × n × d), read through bmm and one expert's slice: traceable."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN**0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN**0.5)

    def forward(self, x):
        return torch.bmm(F.gelu(torch.bmm(x, self.w_in)), self.w_out) + x[0] @ self.w_in[0] @ self.w_out[0]


def test_the_graph_pass_converts_expert_weights_in_a_traced_module():
    layer = GroupedExperts().double()
    x = torch.randn(EXPERTS, 5, HIDDEN, dtype=torch.float64)
    expected = layer(x)
    gm = torch.fx.symbolic_trace(layer)
    gm = comera_fx.passes.tensorize(gm, FULL)
    decisions = {d.fqn: d for d in gm.meta["comera_fx"].layers if d.kind == "experts"}
    assert set(decisions) == {"w_in", "w_out"} and all(d.converted for d in decisions.values())
    assert not [n for n, p in gm.named_parameters() if p.dim() == 3 and ".cores." not in n]
    torch.testing.assert_close(gm(x), expected, rtol=1e-10, atol=1e-12)  # full rank: exact
    low = comera_fx.passes.tensorize(torch.fx.symbolic_trace(GroupedExperts()), FULL.replace(max_rank=4))
    banks = [m for m in low.modules() if isinstance(m, TTExpertBank)]
    assert len(banks) == 2 and all(max(tt.ranks) <= 4 for b in banks for tt in b)
    low(torch.randn(EXPERTS, 5, HIDDEN)).sum().backward()
    assert all(tt.cores[0].grad is not None for b in banks for tt in b)


def test_randomize_backward_reaches_the_shared_form():
    model = mixtral().double()
    comera_fx.tensorize_(
        model, TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, expert_form="shared", **EXPERTS_ONLY)
    )
    experts = experts_of(model).train()
    hidden = torch.randn(24, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, weights, index = model.model.layers[0].mlp.gate(hidden)
    weights = weights.detach()

    def grads():
        x = hidden.clone().requires_grad_(True)
        out = experts(x, index, weights)
        out.square().sum().backward()
        core = experts.gate_up_proj.tt.cores[0].grad.clone()
        experts.zero_grad(set_to_none=True)
        return out.detach(), x.grad, core

    exact_out, exact_dx, exact_core = grads()
    summary = comera_fx.randomize_backward_(model, rho=0.5, min_numel=0)
    assert [d.randomized for d in summary.layers if d.kind == "tt_experts"] == [True, True]
    assert {r.fqn for r in comera_fx.report(model).randomized} >= {"model.layers.0.mlp.experts.gate_up_proj"}
    out, dx, core = grads()
    torch.testing.assert_close(out, exact_out, rtol=1e-12, atol=1e-12)  # forward exact
    torch.testing.assert_close(dx, exact_dx, rtol=1e-10, atol=1e-12)  # dX exact
    assert torch.isfinite(core).all() and not torch.allclose(core, exact_core)  # a sketched shared-core gradient
    assert comera_fx.restore_backward_(model) >= 2
    torch.testing.assert_close(grads()[2], exact_core, rtol=1e-10, atol=1e-12)


def test_an_experts_class_whose_loop_differs_is_not_swapped_but_read_in_weight_space():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class ScaledExperts(nn.Module):
        """transformers' flags and layout, but its own loop scales every expert's output: TTExperts would not."""

        def __init__(self, config):
            super().__init__()
            self.num_experts = EXPERTS
            self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) / HIDDEN**0.5)
            self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / FFN**0.5)
            self.act_fn = nn.SiLU()

        def forward(self, hidden, index, weights):
            out = torch.zeros_like(hidden)
            for e in range(self.num_experts):
                token, slot = torch.where(index == e)
                gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * (1.5 + e)
                out = out.index_add(0, token, y * weights[token, slot, None])
            return out

    config = transformers.PretrainedConfig()
    config._experts_implementation = "eager"
    model = wrapped(ScaledExperts(config)).double()
    dense = copy.deepcopy(model)
    summary = comera_fx.tensorize_(model, FULL)
    notes = [" ".join(d.notes) for d in summary.converted]
    assert len(notes) == 2 and all("weight-space" in n and "probe" in n for n in notes)
    assert not isinstance(model[1], TTExperts)
    hidden = torch.randn(12, HIDDEN, dtype=torch.float64)
    index = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, dtype=torch.float64)
    torch.testing.assert_close(
        model[1](hidden, index, weights), dense[1](hidden, index, weights), rtol=1e-10, atol=1e-12
    )


def _tt_svd_error_bound(stacked: torch.Tensor, layout) -> float:
    """The TT-SVD bound on ||W - W_tt||_F for a chain of ``layout``'s ranks: the square root of the summed tail
    energies of the chain's unfoldings (each from its own SVD, computed here, not by the code under test)."""
    padded = F.pad(stacked, (0, layout.padded_cols - stacked.shape[1], 0, layout.padded_rows - stacked.shape[0]))
    chain = padded.reshape(*layout.row_modes, *layout.col_modes)
    total = 0.0
    for k, rank in enumerate(layout.ranks[1:-1], start=1):
        sigma = torch.linalg.svdvals(chain.reshape(math.prod(chain.shape[:k]), -1))
        total += float((sigma[rank:] ** 2).sum())
    return total**0.5


@pytest.mark.parametrize("allocation", ["uniform", "energy"])
def test_the_shared_form_meets_a_size_target(allocation):
    """``expert_form="shared"`` with a size target: each shared chain is one layer of the allocation, the target
    holds (counted from the model's parameters), each chain is within the TT-SVD bound of the dense experts at its
    ranks (SVDs computed here), the model computes the dense float64 model with its experts replaced by the
    chains' weights (rebuilt by opt_einsum), and a target with room for full ranks is exact."""
    from comera_fx.moe.shared import SharedTTExpertBank
    from test_plan_autograd import dense_reference

    model = mixtral().double()
    model.config._experts_implementation = "eager"
    dense = copy.deepcopy(model)
    config = TensorizeConfig(
        size_target=0.3, max_rank=None, allocation=allocation, expert_form="shared", min_numel=0, min_dim=1,
        **EXPERTS_ONLY,
    )  # fmt: skip
    summary = comera_fx.tensorize_(model, config)
    experts = experts_of(model)
    banks = {"gate_up_proj": experts.up, "down_proj": experts.down_proj}
    assert all(isinstance(b, SharedTTExpertBank) for b in banks.values())
    assert {d.fqn for d in summary.converted} == {f"model.layers.0.mlp.experts.{n}" for n in banks}
    dense_total = sum(math.prod(d.shape) for d in summary.converted)
    tt_total = sum(p.numel() for b in banks.values() for p in b.parameters())
    assert summary.size_target.reached == tt_total <= 0.3 * dense_total
    assert tt_total >= 0.15 * dense_total  # sized to the target, not collapsed
    rebuilt = {}
    for name, bank in banks.items():
        tt = bank.tt
        assert tt.col_modes[0] == EXPERTS and tt.ranks != tt.full_ranks  # truncated by the target
        weight = getattr(dense.model.layers[0].mlp.experts, name).detach()
        stacked = torch.cat([p.t() for p in weight], dim=1)  # in × E·out: the experts side by side
        got = dense_reference(list(tt.cores), list(tt.gates), tt.layout).detach()
        assert float((got - stacked).norm()) <= _tt_svd_error_bound(stacked, tt.layout) * (1 + 1e-9) + 1e-12
        rebuilt[f"model.layers.0.mlp.experts.{name}"] = torch.stack([m.t() for m in got.chunk(EXPERTS, dim=1)])
    ids = tokens()
    with torch.no_grad():
        want = torch.func.functional_call(dense, {**dict(dense.named_parameters()), **rebuilt}, (ids,)).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-9, atol=1e-11)

    loose = mixtral().double()
    loose.config._experts_implementation = "eager"
    comera_fx.tensorize_(loose, config.replace(size_target=10**9))  # room for every bond at full rank: exact
    with torch.no_grad():
        torch.testing.assert_close(loose(ids).logits, dense(ids).logits, rtol=1e-6, atol=1e-8)


def test_under_a_size_target_an_expert_list_stays_per_expert_and_says_so():
    """The shared chains of expert lists are not sized by a size target: their linears are converted per expert,
    sized with the other layers, and the summary says why."""
    model = wrapped(ListMoE()).double()
    x = torch.randn(20, HIDDEN, dtype=torch.float64)
    config = TensorizeConfig(size_target=0.3, max_rank=None, expert_form="shared", min_numel=0, min_dim=1)
    summary = comera_fx.tensorize_(model, config.replace(skip=(r"router",)), example_inputs=(x,))
    assert not hasattr(model[1], "experts_w_in_shared")
    linears = [d for d in summary.layers if ".experts." in d.fqn]
    assert len(linears) == 2 * EXPERTS and all(d.converted for d in linears)
    assert all(any("not under a size target" in n for n in d.notes) for d in linears)
    dense_total = sum(math.prod(d.shape) for d in summary.converted)
    tt_total = sum(p.numel() for m in model.modules() if isinstance(m, comera_fx.TTMatrix) for p in m.parameters())
    assert summary.size_target.reached == tt_total <= 0.3 * dense_total
