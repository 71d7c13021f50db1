"""The model zoo: architectures written by others (``transformers`` configs, random init, tiny widths) and one
CNN + MLP hybrid, each tensorized through a Dynamo capture and checked against the untouched original.

Per architecture (parametrized, so a failure names it):

* default run: full-rank equivalence in float32 (relative error <= 1e-5 of the output RMS, element-wise, on the
  capture's input and on another batch / length), every large 2-D weight converted, and a ``state_dict`` round
  trip into a freshly tensorized model built from other weights at another rank;
* slow (``-m slow``): 20 training steps under ``torch.compile`` with comera_fx's backend without Inductor
  (AOTAutograd's graphs as captured) with ``RankAdaptive`` — the loss falls, the model shrinks, the last compiled
  loss equals the eager loss of the pruned model and no graph break comes from comera_fx (breaks from
  ``transformers`` are listed in ``TRANSFORMERS_BREAKS``); greedy ``generate()`` of the causal and encoder-decoder
  LMs equals the original's; bf16 parameters and bf16 autocast on CPU. The CNN + MLP hybrid's compiled training
  (without Inductor) also runs by default; with Inductor (the default backend, ``comera_fx.backend``) in the slow
  suite.

Widths are 64 (heads of 16, 2 key/value heads for GQA), so the config lowers ``min_numel`` / ``min_dim`` until
every projection (the 64 × 32 key/value projections of GQA included) counts as large.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency (pyproject's [test] extra)
from torch import Tensor, nn

import comera_fx
from comera_fx import TensorizeConfig, TTLinear
from comera_fx.testing import assert_rewrite_equivalent
from helpers_models import large_2d_parameters, relative_tolerance

ZOO = TensorizeConfig(max_rank=10**9, min_numel=2048, min_dim=32)  # full rank: exact TT-SVD
VOCAB = 1000
DIMS = dict(hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # compiled = eager, step by step


def ids(shape, seed):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------- the CNN + MLP hybrid


class ConvMLP(nn.Module):
    """Conv / BatchNorm / pooling stem, then an MLP: two nn.Linear and an F.linear on a raw parameter (which
    tensorize_ gives a reconstructing property and the backend turns into a planned contraction). The conv weights
    are 4-D, so they stay dense."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.fc1 = nn.Linear(512, 256)
        self.w2 = nn.Parameter(torch.randn(128, 256) / 16)
        self.head = nn.Linear(128, num_classes)

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None):
        h = self.stem(pixel_values).flatten(1)
        logits = self.head(F.gelu(F.linear(F.gelu(self.fc1(h)), self.w2)))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)


# ------------------------------------------------------------------------------------------------ architectures


@dataclass(frozen=True)
class Arch:
    """How to build one architecture and feed it."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int], dict]  # seed -> keyword inputs (no labels)
    labels: Callable[[dict], dict]  # inputs -> {"labels": ...} for the model's own loss
    generate: str | None = None  # "causal" / "seq2seq": greedy generate() is checked
    other: dict = field(default_factory=lambda: {"batch": 3, "length": 20})  # the second input's shape


def _text(seed, batch=2, length=12, cache=None):
    x = {"input_ids": ids((batch, length), seed)}
    return x if cache is None else x | {"use_cache": cache}


def _seq2seq(seed, batch=2, length=12):
    return {
        "input_ids": ids((batch, length), seed),
        "decoder_input_ids": ids((batch, length - 5), seed + 100),
        "use_cache": False,
    }


def _pixels(seed, batch=2, size=32):
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))}


def _lm_labels(x):
    return {"labels": x["input_ids"]}


def _seq2seq_labels(x):
    return {"labels": x["decoder_input_ids"]}


def _class_labels(x):
    return {"labels": torch.arange(len(x["pixel_values"])) % 10}


ARCHS: dict[str, Arch] = {
    # masked LMs: the decoder of the MLM head is tied to the word embeddings
    "bert": Arch(
        lambda: transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=1, **DIMS, **NO_DROPOUT)),
        _text,
        _lm_labels,
    ),
    "roberta": Arch(
        lambda: transformers.RobertaForMaskedLM(
            transformers.RobertaConfig(
                num_hidden_layers=1, pad_token_id=1, **DIMS | {"max_position_embeddings": 66}, **NO_DROPOUT
            )
        ),
        _text,
        _lm_labels,
    ),
    # Conv1D weights (addmm, stored in × out), tied wte / lm_head
    "gpt2": Arch(
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=1,
                n_embd=64,
                n_head=4,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        functools.partial(_text, cache=False),
        _lm_labels,
        "causal",
    ),
    # GQA (2 key/value heads of 16 for 4 query heads), RoPE, RMSNorm, no biases, untied head
    "llama": Arch(
        lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                num_hidden_layers=1, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0, **DIMS
            )
        ),
        functools.partial(_text, cache=False),
        _lm_labels,
        "causal",
    ),
    # GQA with biases on q/k/v only
    "qwen2": Arch(
        lambda: transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                num_hidden_layers=1, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0, **DIMS
            )
        ),
        functools.partial(_text, cache=False),
        _lm_labels,
        "causal",
    ),
    # one `shared` embedding for encoder, decoder and (tied) head; relative position bias (small, stays dense)
    "t5": Arch(
        lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=VOCAB,
                d_model=64,
                d_kv=16,
                d_ff=256,
                num_layers=1,
                num_heads=4,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        ),
        _seq2seq,
        _seq2seq_labels,
        "seq2seq",
    ),
    # patch embedding is a Conv2d (4-D, stays dense); the 64 × 10 classifier is below the threshold
    "vit": Arch(
        lambda: transformers.ViTForImageClassification(
            transformers.ViTConfig(
                hidden_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=256,
                image_size=32,
                patch_size=8,
                num_labels=10,
                **NO_DROPOUT,
            )
        ),
        _pixels,
        _class_labels,
        other={"batch": 3},
    ),
    # encoder-decoder with learned positions, shared embedding tied to the head
    "bart": Arch(
        lambda: transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                vocab_size=VOCAB,
                d_model=64,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=256,
                decoder_ffn_dim=256,
                max_position_embeddings=64,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                bos_token_id=0,
                pad_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
        ),
        _seq2seq,
        _seq2seq_labels,
        "seq2seq",
    ),
    "conv_mlp": Arch(ConvMLP, _pixels, _class_labels, other={"batch": 3, "size": 40}),
}


def logits(model: nn.Module, inputs: dict) -> Tensor:
    return model(**inputs).logits


@functools.cache
def zoo(name: str):
    """(original, full-rank TT copy, tensorize summary), built once per architecture; tests must not change them
    (training works on a deep copy). The TT copy is captured with Dynamo on ``inputs(1)``."""
    torch.manual_seed(0)
    dense = ARCHS[name].build().eval()
    model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(model, ZOO, example_inputs=ARCHS[name].inputs(1))
    return dense, model, summary


def second_input(name: str) -> dict:
    arch = ARCHS[name]
    return arch.inputs(2, **arch.other)


# Structural facts that make each architecture worth having here: (what, check on the TT model).
def _tt_of(module: nn.Module):
    """The TTMatrix behind a holder's weight: a TT module's ``tt``, or a reconstructing property's ``weight_tt``."""
    return module.tt if isinstance(module, (TTLinear, comera_fx.TTEmbedding)) else module.weight_tt


def _one_tt(*modules) -> bool:
    return len({id(_tt_of(m)) for m in modules}) == 1


STRUCTURE: dict[str, tuple[str, Callable[[nn.Module], bool]]] = {
    "bert": (
        "MLM decoder shares the word embeddings' TT matrix",
        lambda m: _one_tt(m.bert.embeddings.word_embeddings, m.cls.predictions.decoder),
    ),
    "roberta": (
        "MLM decoder shares the word embeddings' TT matrix",
        lambda m: _one_tt(m.roberta.embeddings.word_embeddings, m.lm_head.decoder),
    ),
    "gpt2": (
        "Conv1D became TTLinear; lm_head shares wte's TT matrix",
        lambda m: isinstance(m.transformer.h[0].attn.c_attn, TTLinear) and _one_tt(m.transformer.wte, m.lm_head),
    ),
    "llama": (
        "GQA k/v projections (64 -> 32) converted, no biases",
        lambda m: all(
            isinstance(p, TTLinear) and p.bias is None
            for p in (m.model.layers[0].self_attn.k_proj, m.model.layers[0].self_attn.v_proj, m.lm_head)
        ),
    ),
    "qwen2": (
        "GQA k/v projections converted with their biases, o_proj without",
        lambda m: (
            m.model.layers[0].self_attn.k_proj.bias is not None
            and isinstance(m.model.layers[0].self_attn.k_proj, TTLinear)
            and m.model.layers[0].self_attn.o_proj.bias is None
        ),
    ),
    "t5": (
        "shared / encoder / decoder embeddings and lm_head: one TT matrix",
        lambda m: _one_tt(m.shared, m.encoder.embed_tokens, m.decoder.embed_tokens, m.lm_head),
    ),
    "vit": (
        "attention and MLP linears converted, patch Conv2d left dense",
        lambda m: (
            isinstance(m.vit.layers[0].attention.q_proj, TTLinear)
            and type(m.vit.embeddings.patch_embeddings.projection) is nn.Conv2d
        ),
    ),
    # BartScaledWordEmbedding overrides nn.Embedding.forward (it scales), so it is not swapped for a TTEmbedding:
    # its weight becomes a reconstructing property (exact, but eager and compiled lookups rebuild the table)
    "bart": (
        "scaled embeddings behind a property; shared / encoder / decoder embeddings and lm_head: one TT",
        lambda m: (
            isinstance(m.model.shared.weight_tt, comera_fx.TTMatrix)
            and _one_tt(m.model.shared, m.model.encoder.embed_tokens, m.model.decoder.embed_tokens, m.lm_head)
        ),
    ),
    "conv_mlp": (
        "raw parameter w2 behind a reconstructing property, fc1 a TTLinear",
        lambda m: isinstance(m.w2_tt, comera_fx.TTMatrix) and isinstance(m.fc1, TTLinear),
    ),
}


# ----------------------------------------------------------------------------------- default run: every model


@pytest.mark.parametrize("name", list(ARCHS))
def test_full_rank_equals_the_original(name):
    dense, model, summary = zoo(name)
    assert summary.method == "dynamo"
    assert [d.fqn for d in summary.converted] == large_2d_parameters(dense, ZOO)
    what, holds = STRUCTURE[name]
    assert holds(model), what
    for inputs in (ARCHS[name].inputs(1), second_input(name)):
        assert_rewrite_equivalent(
            dense,
            lambda _copy: model,
            inputs,
            dtype=torch.float32,
            grads=False,
            graph=False,
            **relative_tolerance(dense, inputs, 1e-5),
        )


@pytest.mark.parametrize("name", list(ARCHS))
def test_state_dict_round_trip_into_a_fresh_model(name):
    """Save, load into a model tensorized afresh from other weights at rank 2 (random init): the
    checkpoint's ranks are adopted and the outputs are those of the saved model."""
    _, model, _ = zoo(name)
    torch.manual_seed(1)
    fresh = ARCHS[name].build().eval()
    # module scan (cheap) where it finds what the capture found; the hybrid's F.linear on w2 needs the capture
    capture = ARCHS[name].inputs(1) if name == "conv_mlp" else None
    comera_fx.tensorize_(
        fresh,
        TensorizeConfig(max_rank=2, init="random", seed=0, min_numel=ZOO.min_numel, min_dim=ZOO.min_dim),
        example_inputs=capture,
    )
    inputs = second_input(name)
    with torch.no_grad():
        expected, before = logits(model, inputs), logits(fresh, inputs)
    assert not torch.allclose(before, expected, rtol=1e-2, atol=1e-3)  # else the load would prove nothing
    state = model.state_dict()
    assert fresh.state_dict().keys() == state.keys()
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(logits(fresh, inputs), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- compiled training with RankAdaptive

# Graph breaks that transformers itself causes, by architecture: (file under site-packages, line's function).
# GPT-2's head calls ``self.loss_function``, whose first use logs a warning (``loss_type=None``) - Dynamo breaks
# the graph there. Any other break, and any break with a comera_fx frame on its stack, fails the test.
TRANSFORMERS_BREAKS: dict[str, set[str]] = {"gpt2": {"transformers/models/gpt2/modeling_gpt2.py"}}
DEFAULT_TRAINED = ("conv_mlp",)  # the rest of the zoo trains in the slow suite (each 1-3 min on 2 busy cores)
COMERA_DIR = str(comera_fx.__file__).rsplit("/", 1)[0]


def _breaks(explained) -> list[tuple[str, list[str]]]:
    """(reason, files on the user stack, innermost last) of every graph break seen."""
    return [(br.reason, [f.filename for f in br.user_stack]) for br in explained.break_reasons]


def train_compiled(name: str, inductor: bool, steps: int = 20, prunes: int = 2):
    """``steps`` AdamW steps on one batch under torch.compile with comera_fx's backend (``inductor=True``: the
    default backend, ``comera_fx.backend``; False: AOTAutograd's graphs run as captured, seconds per compile),
    RankAdaptive taking the TT size to half by 80% of them. Returns losses, the eager loss at the last step's
    parameters, the hook, the explain record and the backend."""
    _, tt_model, _ = zoo(name)
    model = copy.deepcopy(tt_model).train()
    arch = ARCHS[name]
    batch = arch.inputs(1)
    batch |= arch.labels(batch)
    inner = comera_fx.make_backend(inductor=inductor)
    explained = torch._dynamo.backends.debugging.ExplainWithBackend(inner)
    torch._dynamo.reset()  # the same transformers forward may have been compiled for another model
    compiled = torch.compile(model, backend=explained)
    optimizer = torch.optim.AdamW(comera_fx.param_groups(model, lr_cores=3e-3, lr_gates=3e-3, lr_other=3e-3))
    hook = comera_fx.RankAdaptive(
        model, optimizer, comera_fx.BudgetConfig(keep_fraction=0.5, total_steps=steps, prunes=prunes)
    )
    losses = []
    try:
        for step in range(steps):
            loss = compiled(**batch).loss
            if step == steps - 1:
                with torch.no_grad():
                    eager = model(**batch).loss  # same parameters, eagerly: a stale or wrong graph shows here
            loss.backward()
            hook.observe(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch._dynamo.reset()
    return losses, float(eager), hook, explained, inner


# Without Inductor for every architecture; with Inductor (the default backend) for the hybrid, in the slow suite:
# each pruning changes the cores' shapes, so its 20 steps compile forward and backward three times (minutes here).
TRAIN_CASES = [
    pytest.param(n, False, marks=() if n in DEFAULT_TRAINED else pytest.mark.slow, id=f"{n}-aot_autograd")
    for n in ARCHS
]
TRAIN_CASES += [pytest.param(n, True, marks=pytest.mark.slow, id=f"{n}-inductor") for n in DEFAULT_TRAINED]


@pytest.mark.parametrize("name, inductor", TRAIN_CASES)
def test_compiled_training_with_rank_adaptation(name, inductor):
    losses, eager_last, hook, explained, backend = train_compiled(name, inductor)
    assert losses[-1] < 0.5 * losses[0], losses
    torch.testing.assert_close(losses[-1], eager_last, rtol=1e-3, atol=1e-5)
    assert hook.live_tt_params() <= 0.55 * hook.initial_tt_params, hook.summary()
    assert backend.stats.graphs >= 1 and not backend.stats.dense_reported
    if name == "conv_mlp":
        assert backend.stats.reconstructed_contracted >= 1  # F.linear(h, w2) on the property: contracted
    breaks = _breaks(explained)
    ours = [(reason, files) for reason, files in breaks if any(f.startswith(COMERA_DIR) for f in files)]
    assert not ours, f"graph breaks inside comera_fx: {ours}"
    where = {files[-1].split("site-packages/")[-1] for _, files in breaks if files}
    assert where == TRANSFORMERS_BREAKS.get(name, set()), breaks


# ---------------------------------------------------------------------------------- generate, bf16 (slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a.generate])
def test_greedy_generate_equals_the_original(name):
    """Eager generate() with the KV cache (one-token steps: the planner's smallest batch interval)."""
    dense, model, _ = zoo(name)
    prompt = ids((2, 6), 11)
    settings = dict(
        max_new_tokens=6,
        do_sample=False,
        num_beams=1,
        return_dict_in_generate=True,
        output_scores=True,
        attention_mask=torch.ones_like(prompt),
    )
    with torch.no_grad():
        want = dense.generate(input_ids=prompt, **settings)
        got = model.generate(input_ids=prompt, **settings)
    assert torch.equal(got.sequences, want.sequences)
    assert got.sequences.shape[1] > (prompt.shape[1] if ARCHS[name].generate == "causal" else 1)
    scores, expected = torch.stack(got.scores), torch.stack(want.scores)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5 * float(expected.pow(2).mean().sqrt()))


def _rel(actual: Tensor, expected: Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


def _to(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS))
def test_bf16_parameters_and_autocast(name):
    """bf16 is held to the dense model's own bf16 error (the reference: the original in float32): the TT model's
    error may be at most 3× that of the original run the same way (bf16 weights; bf16 autocast), and under 5%."""
    dense, model, _ = zoo(name)
    inputs = ARCHS[name].inputs(1)
    with torch.no_grad():
        reference = logits(dense, inputs)
        # bf16 parameters: the full-rank TT model cast, and tensorize_ of the bf16 original
        dense16 = copy.deepcopy(dense).to(torch.bfloat16)
        tt16 = copy.deepcopy(model).to(torch.bfloat16)
        fresh16 = copy.deepcopy(dense16)
        comera_fx.tensorize_(fresh16, ZOO, example_inputs=_to(inputs, torch.bfloat16))
        assert all(p.dtype == torch.bfloat16 for p in fresh16.parameters())
        dense_error = _rel(logits(dense16, _to(inputs, torch.bfloat16)), reference)
        for tt in (tt16, fresh16):
            y = logits(tt, _to(inputs, torch.bfloat16))
            assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
            assert _rel(y, reference) <= max(3 * dense_error, 1e-2) and _rel(y, reference) < 5e-2
    # autocast: float32 parameters, bf16 matmuls; forward and backward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            dense_y = logits(dense, inputs)  # bf16, or float32 where the head adds a float32 buffer (BART)
        dense_error = _rel(dense_y, reference)
        trained = copy.deepcopy(model)
        y = logits(trained, inputs)
    assert y.dtype == dense_y.dtype and torch.isfinite(y).all()  # a biased TTLinear head returned float32
    assert _rel(y.detach(), reference) <= max(3 * dense_error, 1e-2) and _rel(y.detach(), reference) < 5e-2
    y.float().pow(2).mean().backward()
    grads = [p.grad for p in trained.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
