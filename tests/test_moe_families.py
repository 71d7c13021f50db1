"""Every MoE causal-LM family of the installed transformers, on a tiny random config: its routed experts are converted
at default settings (contracted through ``TTExperts`` / ``ExpertWeight`` where that computes the module's function,
in the weight-space form otherwise), full rank reproduces the dense logits, default ranks shrink the experts,
``state_dict`` round-trips, ``RankAdaptive`` trains and shrinks them, and the compiled step (aot_eager) equals
eager. The default run checks a representative handful of families (``REPRESENTATIVE``; the compiled step on gpt-oss
only); the slow suite checks every family (the compiled step: the families of ``COMPILED``). Saving, the in-place
write guard and the size accounting are checked on gpt-oss. References are the dense models (deep copies taken
before conversion), and for Llama 4's training step the dense float64 model with its weights rebuilt from the TT
cores by opt_einsum.
"""

from __future__ import annotations

import copy

import pytest
import torch

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.moe import TTExpertBank, TTExperts
from comera_fx.moe.weight_space import is_bank_holder

transformers = pytest.importorskip("transformers")
from comera_fx.testing.moe_families import (  # noqa: E402
    build,
    compiled_step_differences,
    expert_parameters,
    families,
    train_with_rank_adaptive,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = dict(families())
#: Families whose tiny config does not build or run in this transformers (the reason is theirs, not ours).
UNBUILT = {
    "dbrx": "DbrxConfig: 'DbrxAttentionConfig' object has no attribute 'rope_theta' at model construction",
}
BUILT = sorted(set(FAMILIES) - set(UNBUILT))
#: The path each family's experts take, and why (the summary says so too).
WEIGHT_SPACE = {
    "gpt_oss",
    "deepseek_v4",
    "inkling2",
    "inkling2_loop",
    "jetmoe",
    "llama4",
    "minimax_m3_vl",
    "hy_v4",
    "bailing_hybrid",
    "beam",
    "ergo",
}
FULL = TensorizeConfig(max_rank=10**6, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head"))


def every_family(representative: set[str], families=BUILT) -> list:
    """``families`` as pytest params, all but ``representative`` marked slow (the slow suite runs them all)."""
    return [f if f in representative else pytest.param(f, marks=pytest.mark.slow) for f in families]


#: Checked in the default run; every other family runs in the slow suite (the per-family checks cost seconds to
#: minutes each). One per path and layout: transformers experts (contracted, with a shared expert), gpt-oss's own
#: gating (weight-space, eager loop), Llama 4 (weight-space, bmm over every expert, in-place add on its output).
REPRESENTATIVE = {"mixtral", "deepseek_v3", "gpt_oss", "llama4"}


def tokens(batch: int = 2, length: int = 8):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def holds_experts(module, path) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def expert_weights(model) -> set[str]:
    """FQNs of the dense model's routed expert weights: 3D parameters with the expert count first."""
    return {
        n
        for n, p in model.named_parameters()
        if p.dim() == 3 and p.shape[-1] > 4 and p.shape[0] in (4, 8) and ".cores." not in n
    }


def test_every_family_with_experts_is_built_or_named():
    assert set(FAMILIES) >= {
        "gpt_oss",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "deepseek_v2",
        "deepseek_v3",
        "granitemoe",
        "jamba",
        "phimoe",
        "llama4",
        "glm4_moe",
        "ernie4_5_moe",
        "qwen3_next",
    }
    assert set(UNBUILT) <= set(FAMILIES)


@pytest.mark.parametrize("family", every_family(REPRESENTATIVE))
def test_full_rank_reproduces_the_dense_logits(family):
    model = build(family, FAMILIES[family])
    dense = copy.deepcopy(model)
    experts = expert_weights(model)
    assert experts, f"{family}: the tiny config has no routed experts"
    summary = comera_fx.tensorize_(model, FULL)
    decided = {d.fqn: d for d in summary.layers if d.kind == "experts"}
    assert experts <= set(decided)
    for fqn in experts:
        d = decided[fqn]
        assert d.converted, f"{fqn}: {d.reason}"
        path = "weight-space" if family in WEIGHT_SPACE else "contracted"
        assert any(n.startswith(path) for n in d.notes), d.notes
    assert not expert_weights(model)  # no dense expert weight is left
    with torch.no_grad():
        assert rel(model(tokens()).logits, dense(tokens()).logits) <= 1e-4


@pytest.mark.parametrize("family", every_family(REPRESENTATIVE))
def test_default_ranks_shrink_the_experts_and_state_dict_round_trips(family):
    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256)
    model = build(family, FAMILIES[family], **sizes)
    before = expert_parameters(model)
    config = TensorizeConfig()  # the defaults, on the experts alone (the test's time)
    summary = comera_fx.tensorize_(model, config, filter_fn=holds_experts)
    left = {d.fqn: d.reason for d in summary.skipped if d.kind == "experts"}
    assert all("size threshold" in reason for reason in left.values()), left  # only the small ones stay dense
    assert expert_weights(model) == set(left)
    assert before >= 2 * expert_parameters(model)
    fresh = build(family, FAMILIES[family], seed=3, **sizes)
    comera_fx.tensorize_(fresh, config, filter_fn=holds_experts)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


def gpt_oss(**changes):
    return build("gpt_oss", FAMILIES["gpt_oss"], **changes)


def test_gpt_oss_experts_keep_their_own_forward_exactly_in_float64():
    model = gpt_oss().double()
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 path
    dense = copy.deepcopy(model)
    comera_fx.tensorize_(model, FULL)
    experts = model.model.layers[0].mlp.experts
    assert is_bank_holder(experts) and isinstance(experts, type(dense.model.layers[0].mlp.experts))
    assert isinstance(experts.gate_up_proj_tt, TTExpertBank) and "gate_up_proj" not in experts._parameters
    hidden = torch.randn(12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    router = dense.model.layers[0].mlp.router
    _, weights, index = router(hidden)
    torch.testing.assert_close(
        experts(hidden, index, weights),
        dense.model.layers[0].mlp.experts(hidden, index, weights),
        rtol=1e-10,
        atol=1e-12,
    )
    for impl in ("eager", "batched_mm"):
        model.config._experts_implementation = dense.config._experts_implementation = impl
        torch.testing.assert_close(model(tokens()).logits, dense(tokens()).logits, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("family", every_family(REPRESENTATIVE))
def test_rank_adaptive_trains_and_shrinks_the_experts(family):
    """The experts alone are converted: with every layer in TT form the budget may be met elsewhere (Qwen4-Exp's
    hyper-connection and linear-attention weights go to rank 0 and its experts keep their ranks)."""
    model = build(family, FAMILIES[family]).train()
    config = TensorizeConfig(max_rank=8, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head"))
    comera_fx.tensorize_(model, config, filter_fn=holds_experts)
    banks = [m for m in model.modules() if isinstance(m, TTExpertBank)]
    assert banks
    if family in WEIGHT_SPACE:
        assert any(is_bank_holder(m) for m in model.modules())
    if family == "mixtral":
        assert any(isinstance(m, TTExperts) for m in model.modules())
    run = train_with_rank_adaptive(model, tokens(4, 16))
    assert run["losses"][-1] < run["losses"][0] and run["after"] < run["before"]


#: The compiled step's families: tracing costs 0.5-4 min a family on 2 cores (the contracted families' experts loop
#: breaks the graph per expert), so all of them would take over an hour of CI's slow suite. gpt-oss in the default
#: run; in the slow suite one cheap family per path and layout (weight-space: Llama 4's bmm, Ergo, Inkling2's loop;
#: contracted: a shared expert, a hybrid with state-space layers, PhiMoE's sampling router).
#: ``benchmarks/bench_moe_families_training.py compile`` runs every family (history/2026-12-05-issue-45-session2.md).
COMPILED = ("gpt_oss", "llama4", "ergo", "inkling2_loop", "granitemoeshared", "nemotron_h", "phimoe")


@pytest.mark.parametrize("family", every_family({"gpt_oss"}, COMPILED))
def test_the_compiled_step_equals_eager(family):
    """One training step's loss and every gradient, compiled (aot_eager: Dynamo and AOT autograd, no Inductor)
    against eager, on the families of ``COMPILED``."""
    model = build(family, FAMILIES[family]).train()
    comera_fx.tensorize_(model, FULL.replace(max_rank=6))
    found = compiled_step_differences(model, tokens())  # PhiMoE's router samples in training: one seed both ways
    assert any(p.grad is not None for n, p in model.named_parameters() if "_tt" in n or ".tt." in n)
    torch.testing.assert_close(found["compiled"], found["eager"], rtol=1e-5, atol=1e-6)
    assert found["worst_grad"] < 1e-4 and not found["mismatched"], found


def test_save_tensorized_round_trips_the_weight_space_form(tmp_path):
    model = gpt_oss()
    comera_fx.tensorize_(model, FULL.replace(max_rank=6))
    expected = model(tokens()).logits
    path = tmp_path / "gpt_oss.safetensors"
    comera_fx.save_tensorized(model, path)
    loaded = comera_fx.load_tensorized(path, lambda: gpt_oss(seed=9)).eval()
    assert is_bank_holder(loaded.model.layers[0].mlp.experts)
    torch.testing.assert_close(loaded(tokens()).logits, expected, rtol=0, atol=0)
    clone = copy.deepcopy(model)  # the run-time class deep-copies (and pickles) through __reduce_ex__
    torch.testing.assert_close(clone(tokens()).logits, expected, rtol=0, atol=0)


def test_an_in_place_write_to_a_rebuilt_expert_weight_raises():
    model = gpt_oss()
    comera_fx.tensorize_(model, FULL)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(RuntimeError, match="TT cores"):
        torch.nn.init.normal_(experts.gate_up_proj)
    with pytest.raises(AttributeError, match="gate_up_proj_tt"):
        experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 32, 96))


def test_randomize_backward_names_the_weight_space_banks_it_cannot_randomize():
    model = gpt_oss().train()
    comera_fx.tensorize_(model, FULL.replace(max_rank=6))
    summary = comera_fx.randomize_backward_(model, rho=0.5, min_numel=0)
    banks = [d for d in summary.layers if d.kind == "tt_experts"]
    assert banks and all(not d.randomized and "weight-space" in d.reason for d in banks)
    assert all(getattr(m, "rmm", None) is None for m in model.modules() if isinstance(m, TTExpertBank))


def test_report_and_the_size_accounting_count_the_weight_space_banks():
    from comera_fx.tt.inventory import matrix_sizes

    model = gpt_oss()
    dense = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    comera_fx.tensorize_(model, FULL.replace(max_rank=6), filter_fn=holds_experts)
    banks = [m for m in model.modules() if isinstance(m, TTExpertBank)]
    stored = sum(p.numel() for b in banks for p in b.parameters())
    rows = comera_fx.report(model).layers
    assert len(rows) == sum(len(b) for b in banks) and all("_tt." in r.fqn for r in rows)
    assert matrix_sizes(model) == (stored, dense) and comera_fx.report(model).tt_params == stored < dense


def rebuilt_reference_weights(model, dense, leaves) -> dict:
    """{dense parameter name: that weight rebuilt with opt_einsum from ``leaves``, the TT model's cores and gates}
    for every TT matrix of ``model`` (in a ``TTLinear``, a bank, or a functional ``<attr>_tt``): the dense
    reference's converted weights, computed without the TT products under test."""
    from comera_fx.tt import TTLinear, TTMatrix
    from test_plan_autograd import dense_reference

    def matrix(tt, prefix):
        cores = [leaves[f"{prefix}.cores.{k}"] for k in range(len(tt.cores))]
        gates = [leaves[f"{prefix}.gates.{k}"] for k in range(len(tt.gates))]
        return dense_reference(cores, gates, tt.layout)

    weights, held = {}, set()
    for path, module in model.named_modules():
        if isinstance(module, TTLinear):  # M's rows are the input features unless transposed
            m = matrix(module.tt, f"{path}.tt")
            weights[f"{path}.weight"] = m if module.transposed else m.t()
            held.add(f"{path}.tt")
        elif isinstance(module, TTExpertBank):
            slices = [matrix(tt, f"{path}.{e}") for e, tt in enumerate(module)]
            weights[path.removesuffix("_tt")] = torch.stack(
                [m.t() if module.slice_use == "linear" else m for m in slices]
            )
            held.update(f"{path}.{e}" for e in range(len(module)))
    for path, module in model.named_modules():
        if isinstance(module, TTMatrix) and path not in held:  # a functional weight: M or Mᵀ, whichever it equals
            name, m = path.removesuffix("_tt"), matrix(module, path)
            target = dense.get_parameter(name).detach()
            square = m.shape[0] == m.shape[1]
            same = m.shape == target.shape and (not square or rel(m.detach(), target) < rel(m.detach().t(), target))
            weights[name] = m if same else m.t()
    return weights


def test_llama4_trains_a_step_with_the_gradients_of_the_dense_float64_model():
    """Llama 4's MoE block adds the routed output into its shared expert's output in place (``out.add_``); the
    shared expert's down_proj is a TTLinear whose planned product is a custom autograd Function. Its output was a
    view made inside the Function, which autograd refuses to modify in place: training failed. Reference: the dense
    float64 model with every converted weight rebuilt from the TT leaves by opt_einsum (``functional_call``)."""
    model = build("llama4", FAMILIES["llama4"]).double().train()
    dense = copy.deepcopy(model)
    comera_fx.tensorize_(model, FULL)
    assert isinstance(model.model.layers[0].feed_forward.shared_expert.down_proj, comera_fx.tt.TTLinear)
    assert is_bank_holder(model.model.layers[0].feed_forward.experts)
    ids = tokens(2, 8)
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    rebuilt = rebuilt_reference_weights(model, dense, leaves)
    params = {n: rebuilt[n] if n in rebuilt else leaves[n] for n, _ in dense.named_parameters()}
    for name, weight in rebuilt.items():  # full rank: the rebuilt weights are the dense model's
        torch.testing.assert_close(weight, dense.get_parameter(name), rtol=1e-10, atol=1e-12)
    used = {n for n in leaves if ".cores." in n or ".gates." in n} | {n for n in params if n not in rebuilt}
    assert used == set(leaves)  # every TT-model parameter feeds the reference

    def reference_loss(values):
        weights = rebuilt_reference_weights(model, dense, values)
        merged = {n: weights[n] if n in weights else values[n] for n, _ in dense.named_parameters()}
        return torch.func.functional_call(dense, merged, (ids,), {"labels": ids}).loss

    want = reference_loss(leaves)
    want_grads = torch.autograd.grad(want, list(leaves.values()), allow_unused=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for (name, p), expected in zip(model.named_parameters(), want_grads):
        if expected is None:
            assert p.grad is None or not bool(p.grad.any()), name
        else:
            torch.testing.assert_close(p.grad, expected, rtol=1e-8, atol=1e-11, msg=name)
    lr = 0.05
    torch.optim.SGD(model.parameters(), lr=lr).step()  # the step, against the same step on the reference's leaves
    stepped = {n: v - lr * g if g is not None else v for (n, v), g in zip(leaves.items(), want_grads)}
    with torch.no_grad():
        after = model(ids, labels=ids).loss
        torch.testing.assert_close(after, reference_loss(stepped), rtol=1e-10, atol=1e-12)
    assert after < loss
