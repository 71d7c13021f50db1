"""compress_: one call from a trained model to a packed student under a byte budget, and its refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.packed import PackedLinear, PackedTTLinear, bf16_native
from comera_fx.pretrained import DistillConfig, compress_
from comera_fx.pretrained.distill_config import repeated_blocks, resolved
from comera_fx.pretrained.format_select import CORE_BITS
from comera_fx.tt.layers import TTLinear

SMALL = TensorizeConfig(min_numel=1, min_dim=1)
VOCAB, SEQ = 100, 8
QUICK = DistillConfig(calibration_batches=4, output_batches=2, progress=False)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_bert(seed: int = 0, attention: str = "eager") -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        attn_implementation=attention,
        initializer_range=0.2,
    )
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def batches(n: int, seed: int, vocab: int = VOCAB) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(4, SEQ, dtype=torch.long)
        mask[1:, SEQ - 3 :] = 0  # right padding
        out.append({"input_ids": torch.randint(0, vocab, (4, SEQ), generator=g), "attention_mask": mask})
    return out


def layer_bytes(module: nn.Module) -> int:
    """Bytes of a built layer as stored, counted from its modules (codes + one fp32 scale per group)."""
    if isinstance(module, PackedTTLinear):
        return module.nbytes()  # the cores' codes and scales, as stored (tests/test_packed.py checks it)
    if isinstance(module, PackedLinear):
        n, spec = module.in_features * module.out_features, module.spec
        return math.ceil(n * spec.bits / 8) + 4 * (1 if spec.group_size is None else math.ceil(n / spec.group_size))
    specs = comera_fx.quantize.quantized_specs(module)
    total = 0
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            spec = specs[name]
            total += math.ceil(p.numel() * spec.bits / 8) + 4 * math.ceil(p.numel() / spec.group_size)
    return total


def test_one_call_builds_trains_rounds_and_packs(tmp_path):
    teacher = tiny_bert()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = copy.deepcopy(teacher)
    data = batches(6, 0)
    summary = compress_(
        student, teacher, data, byte_budget=0.2, budget_seconds=None, steps=5, config=QUICK, tensorize_config=SMALL
    )
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in before.items())
    assert summary.steps == 5 and len(summary.losses) == 5
    assert summary.hidden_modules == ("encoder.layer.0", "encoder.layer.1")
    assert set(summary.seconds) == {"calibrate", "choose_formats", "build", "distill"}
    assert len(summary.formats) == 12
    total = 0
    for fqn, choice in summary.plan.choices.items():
        module = student.get_submodule(fqn.removesuffix(".weight"))
        kind = PackedTTLinear if choice.format in CORE_BITS else PackedLinear
        assert isinstance(module, kind), fqn
        total += layer_bytes(module)
    assert total == summary.stored_bytes <= 0.2 * summary.dense_bytes
    assert comera_fx.quantize.stored_bytes(student, "encoder.") == total  # packed layers count as stored
    assert str(summary).startswith("comera_fx.compress_: 12 layers")
    # the bf16 hint appears exactly where this CPU has native bf16 (comera_fx.packed.set_compute_dtype_)
    assert any("set_compute_dtype_" in note for note in summary.notes) == bf16_native()
    comera_fx.save_tensorized(student, tmp_path / "s.st")
    loaded = comera_fx.load_tensorized(tmp_path / "s.st", tiny_bert)
    with torch.no_grad():
        for b in data[:2]:
            assert torch.equal(loaded(**b).last_hidden_state, student(**b).last_hidden_state)


def test_distill_config_is_data_and_refuses_bad_fields():
    """Model-derived defaults resolve against the models: the teacher's repeated blocks at 1 / their number each,
    no quantization-aware tail for a float student (test_quantize: the whole run for a quantized one)."""
    teacher = tiny_bert()
    settings = resolved(DistillConfig(), copy.deepcopy(teacher), teacher)
    assert settings.hidden_modules == ("encoder.layer.0", "encoder.layer.1") and settings.hidden_weight == 0.5
    assert settings.quant_aware == 0.0
    assert resolved(settings, teacher, teacher) == settings  # resolving twice changes nothing
    with pytest.raises(ValueError, match="calibration_batches"):
        DistillConfig(calibration_batches=-1)
    with pytest.raises(ValueError, match="quant_aware"):
        DistillConfig(quant_aware=1.5)
    with pytest.raises(ValueError, match="output_batches"):
        DistillConfig(calibration_batches=2, output_batches=3)
    with pytest.raises(ValueError, match="calibration_batches >= 1"):  # compress_ chooses formats from statistics
        compress_(copy.deepcopy(teacher), teacher, batches(2, 0), steps=1, config=QUICK.replace(calibration_batches=0))
    with pytest.raises(TypeError, match=r"DistillConfig\(lr=0.001\)"):
        compress_(copy.deepcopy(teacher), teacher, batches(2, 0), steps=1, config={"lr": 1e-3})


def test_repeated_blocks_are_the_longest_module_list():
    assert repeated_blocks(tiny_bert()) == ("encoder.layer.0", "encoder.layer.1")
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2))) == ()


def other_calibration():
    other = tiny_bert(1)
    other.encoder.layer = other.encoder.layer[:1]
    return comera_fx.calibrate(other, batches(2, 3), config=SMALL)


@pytest.mark.parametrize("case", ["budget", "foreign batches", "not a copy", "foreign calibration", "same object"])
def test_bad_input_is_refused_before_any_weight_changes(case):
    teacher = tiny_bert()
    student = copy.deepcopy(teacher)
    kwargs = dict(byte_budget=0.2, budget_seconds=None, steps=2, config=QUICK, tensorize_config=SMALL)
    data = batches(6, 0)
    match = {
        "budget": "byte_budget",
        "foreign batches": "do not run",
        "not a copy": "not a copy",
        "foreign calibration": "does not belong",
        "same object": "teacher itself",
    }[case]
    if case == "budget":
        kwargs["byte_budget"] = 0.001
    elif case == "foreign batches":
        data = batches(6, 0, vocab=5000)  # another tokenizer's ids
    elif case == "not a copy":
        with torch.no_grad():
            student.encoder.layer[0].output.dense.weight.add_(0.01)
    elif case == "foreign calibration":
        kwargs["calibration"] = other_calibration()
    elif case == "same object":
        student = teacher
    state = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises((ValueError, IndexError), match=match):
        compress_(student, teacher, data, **kwargs)
    assert student.state_dict().keys() == state.keys()
    assert all(torch.equal(student.state_dict()[k], v) for k, v in state.items())
    assert not any(isinstance(m, (TTLinear, PackedLinear, PackedTTLinear)) for m in student.modules())


def test_autocast_distills_in_bf16_with_attention_in_fp32():
    """``DistillConfig(autocast=torch.bfloat16)``: the forward passes under autocast, attention kept in fp32
    (``FullPrecisionAttention``), the loss close to the fp32 one from the same weights, the weights and their
    optimizer in fp32; a dtype autocast cannot run is refused."""
    import torch.nn.functional as F

    from comera_fx.pretrained.match import FullPrecisionAttention, match_teacher

    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16), FullPrecisionAttention():
        attended = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
        projected = F.linear(q, torch.randn(16, 16))  # everything else still autocasts
    assert attended.dtype == torch.float32 and projected.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(*(t.bfloat16().float() for t in (q, k, v)))
    torch.testing.assert_close(attended, expected, rtol=0, atol=0)

    teacher = tiny_bert(attention="sdpa")
    data = batches(4, 1)
    start = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a student that is not the teacher yet
    losses = {}
    for dtype in (None, torch.bfloat16):
        student = copy.deepcopy(start)
        config = DistillConfig(progress=False, autocast=dtype, lr=1e-3)
        losses[dtype], _, _ = match_teacher(student, teacher, data, steps=3, config=config)
        assert all(p.dtype == torch.float32 for p in student.parameters())
    assert all(math.isfinite(x) for x in losses[torch.bfloat16])
    assert losses[torch.bfloat16][0] == pytest.approx(losses[None][0], rel=0.05)  # the same weights, bf16 GEMMs
    assert losses[torch.bfloat16][0] != losses[None][0]  # it did run in bf16
    with pytest.raises(ValueError, match="autocast must be torch.bfloat16"):
        DistillConfig(autocast=torch.float64)
