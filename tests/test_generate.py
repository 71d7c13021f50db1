"""Greedy generation of a small Hugging Face GPT-2 tensorized by ``tensorize_`` (TT embedding, tied TT head, TT
Conv1D layers) gives the same tokens under ``torch.compile(backend=comera_fx.backend)`` as eagerly, with the KV
cache, and both match the dense model whose weights are the TT matrices (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.tt import TTEmbedding, TTLinear

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_compiled_greedy_generate_gives_eager_tokens():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    dense = transformers.GPT2LMHeadModel(config).double().eval()
    model = copy.deepcopy(dense)
    comera_fx.tensorize_(
        model,
        TensorizeConfig(max_rank=8, min_numel=2**12),
        example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)},
    )
    assert isinstance(model.transformer.wte, TTEmbedding)
    reference = copy.deepcopy(dense)  # dense weights equal to the TT matrices
    for name, module in model.named_modules():
        if isinstance(module, (TTLinear, TTEmbedding)) and name != "lm_head":
            target = reference.get_submodule(name)
            weight = module.weight.detach()
            target.weight.data = (
                weight.t().clone() if isinstance(target, transformers.pytorch_utils.Conv1D) else weight.clone()
            )

    prompt = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    options = dict(
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    with torch.no_grad():
        expected = reference.generate(prompt, **options)
        eager = model.generate(prompt, **options)
        compiled_model = copy.deepcopy(model)
        backend = comera_fx.make_backend()
        torch._dynamo.reset()
        compiled_model.forward = torch.compile(compiled_model.forward, backend=backend)
        compiled = compiled_model.generate(prompt, **options)
        graphs = backend.stats.graphs
        longer = compiled_model.generate(prompt, **{**options, "max_new_tokens": 20, "min_new_tokens": 20})
        graphs_after = backend.stats.graphs
    torch._dynamo.reset()
    assert torch.equal(eager, expected)
    assert torch.equal(compiled, eager)
    assert torch.equal(longer[:, : compiled.shape[1]], compiled)
    # Dynamo makes the growing cache length dynamic after its first recompile: a longer generation (other cache
    # lengths) compiles nothing new, so the compiled path does not recompile per generated length.
    assert graphs <= 4 and graphs_after == graphs, (graphs, graphs_after)
