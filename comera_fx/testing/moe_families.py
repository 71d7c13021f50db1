"""Tiny random-init mixture-of-experts causal LMs from the installed transformers, one per family.

Every ``*ForCausalLM`` of a transformers model folder whose modeling file defines experts is a family; its config
class is built at its defaults and shrunk by setting the size fields it has (``SIZES``, then the family's own
``OVERRIDES``). Families whose tiny config does not run are reported by ``build`` with the error, not hidden: the
tests and ``benchmarks/bench_moe.py`` list them.
"""

from __future__ import annotations

import importlib
import pathlib
import re
from collections.abc import Mapping

import torch
from torch import nn

#: Size fields set on every family's config when it has them.
SIZES: Mapping[str, object] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    moe_layer_freq=1,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    pad_token_id=0,
)

#: Per-family fixes on top of ``SIZES`` (head sizes that must agree, layer-type lists, nested configs).
OVERRIDES: Mapping[str, Mapping[str, object]] = {
    "jamba": dict(
        attn_layer_period=1, attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False
    ),
    "qwen3_next": dict(layer_types=["full_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["full_attention", "full_attention"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    # 2 zero-computation (identity) experts, not 256: with 4 real ones the router hardly ever picks a real expert
    "longcat_flash": dict(qk_head_dim=16, zero_expert_num=2),
    "nemotron_h": dict(layer_types=["full_attention", "moe"]),
    "gemma4": dict(enable_moe_block=True, top_k_experts=2),  # its MoE block is off by default
    # the QSA indexer has no defaults (its config's validation says what fits: one kv head, budget % ratio == 0)
    "qwen4_exp": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4
    ),
    "mistral4": dict(qk_head_dim=16, head_dim=16),
    "qwen3_5_moe": dict(layer_types=["full_attention", "full_attention"]),
}


def families() -> list[tuple[str, str]]:
    """(model folder, causal-LM class name) for every transformers model whose modeling file defines experts."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for folder in sorted(root.iterdir()):
        source = folder / f"modeling_{folder.name}.py"
        if not source.exists():
            continue
        text = source.read_text()
        if "Experts" not in text:
            continue
        names = re.findall(r"class (\w+ForCausalLM)\(", text)
        if names:
            found.append((folder.name, names[0]))
    return found


def tiny_config(family: str, class_name: str):
    """The family's default config with every size field of ``SIZES`` / ``OVERRIDES`` it has set."""
    module = importlib.import_module(f"transformers.models.{family}")
    config = getattr(module, class_name).config_class()
    if getattr(config, "is_heterogeneous", False):  # per-layer values (Gemma 4, Dots3-Note): one value for all
        config.per_layer_config = None  # layers, or the global size fields below are refused as ambiguous
    layers = SIZES["num_hidden_layers"]
    fitted = {}
    if isinstance(getattr(config, "mlp_layer_types", None), list):  # one dense layer, then sparse ones
        fitted["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) > layers:  # keep a full-attention layer (hybrids need one)
        attention = [t for t in types if "attention" in t and "linear" not in t]
        fitted["layer_types"] = types[: layers - 1] + (attention[:1] or types[layers - 1 : layers])
    for key, value in {**SIZES, **fitted, **OVERRIDES.get(family, {})}.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # a per-layer attribute, a property: the family keeps its own value
                pass
    return config


def build(family: str, class_name: str, seed: int = 0, **changes) -> nn.Module:
    """A tiny random-init model of the family (eval mode, float32); ``changes`` set more config fields. Raises
    what the family raises when its tiny config does not build or run."""
    module = importlib.import_module(f"transformers.models.{family}")
    config = tiny_config(family, class_name)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(module, class_name)(config).eval()
    for name, p in model.named_parameters():  # zero-initialised biases would hide a bias the TT form dropped
        if p.dim() == 1 and "norm" not in name and p.device.type != "meta" and not bool(p.detach().any()):
            with torch.no_grad():
                p.normal_(0, 0.05)
    return model


def expert_parameters(model: nn.Module) -> int:
    """Parameters of the routed experts: 3D expert weights (dense) or their TT banks (converted)."""
    from ..moe.bank import TTExpertBank
    from ..moe.shared import SharedTTExpertBank

    from ..tt.layers import TTMatrix

    total, in_tt = 0, set()
    for _, module in model.named_modules():
        if isinstance(module, (TTExpertBank, SharedTTExpertBank)):
            total += sum(p.numel() for p in module.parameters())
        if isinstance(module, TTMatrix):
            in_tt.update(id(p) for p in module.parameters())
    for _, p in model.named_parameters():
        if p.dim() == 3 and id(p) not in in_tt and p.shape[-1] > 4:  # convolution weights (… × 1 × 4): not experts
            total += p.numel()
    return total


def train_with_rank_adaptive(model: nn.Module, ids: torch.Tensor, steps: int = 8) -> dict:
    """``steps`` training steps of a tensorized family model on ``ids`` (Adam 3e-3, ``RankAdaptive`` with
    ``BudgetConfig(keep_fraction=0.5, total_steps=steps, prunes=2)``): the losses and the expert banks' TT
    parameters before and after, what tests and ``bench_moe_families_training.py`` judge a family by."""
    from ..moe.bank import TTExpertBank
    from ..runtime.rank_adaptive import RankAdaptive
    from ..runtime.rank_config import BudgetConfig

    banks = [m for m in model.modules() if isinstance(m, TTExpertBank)]
    before = sum(tt.layout.num_params for b in banks for tt in b)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    hook = RankAdaptive(model, optimizer, BudgetConfig(keep_fraction=0.5, total_steps=steps, prunes=2))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        hook.observe(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    after = sum(tt.layout.num_params for b in banks for tt in b)
    return dict(banks=len(banks), before=before, after=after, losses=losses)


def compiled_step_differences(model: nn.Module, ids: torch.Tensor, backend: str = "aot_eager") -> dict:
    """One training step of ``model`` eager and of a deep copy under ``torch.compile(backend=backend)``, the same
    seed before each (a router that samples draws alike): both losses, the worst relative gradient difference over
    the parameters both sides gave a gradient, and the parameters one side left without a gradient while the
    other's is nonzero (None and zeros both mean "not reached")."""
    import copy

    twin = copy.deepcopy(model)
    torch.manual_seed(0)
    eager = model(ids, labels=ids).loss
    eager.backward()
    torch.manual_seed(0)
    compiled = torch.compile(twin, backend=backend)(ids, labels=ids).loss
    compiled.backward()
    want = dict(model.named_parameters())
    worst, mismatched = 0.0, []
    for name, p in twin.named_parameters():
        a, b = want[name].grad, p.grad
        if a is None or b is None:
            other = a if b is None else b
            if other is not None and bool(other.any()):
                mismatched.append(name)
        elif a.norm() > 0:
            worst = max(worst, float((b - a).norm() / a.norm()))
    return dict(eager=eager.detach(), compiled=compiled.detach(), worst_grad=worst, mismatched=mismatched)
