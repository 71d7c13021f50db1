"""comera_fx.refit_sequential_ and calibrate(token_mask=...), against float64 references computed from the
models' actual activations (least squares by torch.linalg.lstsq, errors from the layer outputs)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig

from helpers_models import MLP, Anisotropic

SMALL = TensorizeConfig(min_numel=1000)


def mixed_model() -> Anisotropic:
    """A fixed input mixing (a buffer) before an MLP: a student with another mixing sees other inputs at fc1."""
    return Anisotropic(decay=1.5)


def batches(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 8, 128, generator=g) for _ in range(n)]


def layer_io(model, name, data):
    """(inputs, outputs) of one module over the batches, float64, from a forward hook."""
    module = model.get_submodule(name)
    seen = []
    handle = module.register_forward_hook(
        lambda m, a, o: seen.append((a[0].reshape(-1, a[0].shape[-1]), o.reshape(-1, o.shape[-1])))
    )
    with torch.no_grad():
        for batch in data:
            model(batch)
    handle.remove()
    return torch.cat([s[0] for s in seen]).double(), torch.cat([s[1] for s in seen]).double()


def student_of(teacher, config, perturb=0.3, seed=2):
    student = copy.deepcopy(teacher)
    comera_fx.tensorize_(student, config)
    g = torch.Generator().manual_seed(seed)
    student.mix.mul_(1 + perturb * torch.randn(student.mix.shape, generator=g))  # the student's inputs differ
    return student


def test_full_rank_refit_is_the_least_squares_fit():
    """At full rank nothing is truncated: fc1 becomes the least-squares map from the student's inputs (with a bias
    column) to the teacher's outputs, which lstsq computes from the raw rows."""
    torch.manual_seed(0)
    teacher = mixed_model()
    student = student_of(teacher, SMALL.replace(max_rank=10_000))
    data = batches()
    x_t, y_t = layer_io(teacher, "net.fc1", data)
    x_s, _ = layer_io(student, "net.fc1", data)
    summary = comera_fx.refit_sequential_(student, teacher, data, eps=1e-12)
    assert [l.name for l in summary.layers] == ["net.fc1", "net.fc2"] and all(l.refit for l in summary.layers)
    design = torch.cat([x_s, torch.ones(len(x_s), 1, dtype=torch.float64)], 1)
    solution = torch.linalg.lstsq(design, y_t).solution
    fc1 = student.net.fc1
    torch.testing.assert_close(fc1.weight.detach().double().T, solution[:-1], rtol=2e-3, atol=2e-4)
    torch.testing.assert_close(fc1.bias.detach().double(), solution[-1], rtol=2e-3, atol=2e-4)
    residual = (design @ solution - y_t).norm() / y_t.norm()
    assert summary.layers[0].error_after == pytest.approx(float(residual), rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("rank", [4, 12])
def test_reported_errors_are_the_layers_real_errors(rank):
    """error_after of each layer equals ||teacher layer on teacher inputs - student layer on student inputs|| /
    ||teacher output||, measured on the refit model: the later layer was fit on the refit earlier layer's outputs."""
    torch.manual_seed(0)
    teacher = mixed_model()
    student = student_of(teacher, SMALL.replace(max_rank=rank))
    data = batches()
    before = {}
    for name in ("net.fc1", "net.fc2"):
        _, y_t = layer_io(teacher, name, data)
        _, y_s = layer_io(student, name, data)
        before[name] = float((y_s - y_t).norm() / y_t.norm())
    summary = comera_fx.refit_sequential_(student, teacher, data)
    for layer in summary.layers:
        _, y_t = layer_io(teacher, layer.name, data)
        _, y_s = layer_io(student, layer.name, data)
        real = float((y_s - y_t).norm() / y_t.norm())
        assert layer.error_after == pytest.approx(real, rel=2e-3)
        assert layer.tokens == 6 * 32 * 8
    # fc1's error before is measured on the unchanged model; fc2's before is on fc1's refit outputs, so only fc1's
    # can be compared with the untouched student
    assert summary.layers[0].error_before == pytest.approx(before["net.fc1"], rel=2e-3)
    assert all(l.error_after < l.error_before for l in summary.layers)
    with torch.no_grad():  # and the model's output moved towards the teacher's
        out_t = torch.cat([teacher(b) for b in data])
        out_s = torch.cat([student(b) for b in data])
    assert float((out_s - out_t).norm() / out_t.norm()) < before["net.fc2"]


def test_refit_leaves_the_teacher_flags_rng_and_requires_grad_alone():
    torch.manual_seed(0)
    teacher = mixed_model()
    teacher.train()
    student = student_of(teacher, SMALL.replace(max_rank=6))
    student.train()
    student.net.fc2.bias.requires_grad_(False)
    teacher_state = copy.deepcopy(teacher.state_dict())
    rng = torch.get_rng_state()
    grad_flags = {n: p.requires_grad for n, p in student.named_parameters()}
    comera_fx.refit_sequential_(student, teacher, batches(2))
    assert torch.equal(torch.get_rng_state(), rng)
    assert teacher.training and student.training and torch.is_grad_enabled()
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_state.items())
    assert grad_flags == {n: p.requires_grad for n, p in student.named_parameters()}


def test_batches_callable_and_errors():
    torch.manual_seed(0)
    teacher = mixed_model()
    student = student_of(teacher, SMALL.replace(max_rank=6))
    g = torch.Generator().manual_seed(3)
    summary = comera_fx.refit_sequential_(student, teacher, lambda: torch.randn(4, 128, generator=g), max_batches=3)
    assert summary.batches == 3 and all(l.tokens == 12 for l in summary.layers)
    with pytest.raises(ValueError, match="no batches"):
        comera_fx.refit_sequential_(student, teacher, [])
    with pytest.raises(ValueError, match="max_batches"):
        comera_fx.refit_sequential_(student, teacher, batches(1), max_batches=0)
    other = mixed_model()
    other.net.fc1 = nn.Linear(128, 128)
    with pytest.raises(ValueError, match="the teacher this student was"):
        comera_fx.refit_sequential_(student, other, batches(1))
    assert "no TT linear" in str(comera_fx.refit_sequential_(copy.deepcopy(teacher), teacher, batches(1)))
    with pytest.raises(ValueError, match="saw no input row"):
        comera_fx.refit_sequential_(student, teacher, batches(1), token_mask=lambda b: torch.zeros(b.shape[:2]))


def tiny_bert():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=300,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def padded_batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(3, 17, (6,), generator=g)
        mask = (torch.arange(16)[None] < lengths[:, None]).long()
        out.append({"input_ids": torch.randint(1, 300, (6, 16), generator=g) * mask, "attention_mask": mask})
    return out


def test_token_mask_leaves_padding_out_of_calibration():
    model = tiny_bert()
    data = padded_batches()
    cal = comera_fx.calibrate(
        model, data, config=TensorizeConfig(min_numel=4000), token_mask=lambda b: b["attention_mask"]
    )
    rows = []
    hook = model.encoder.layer[0].attention.self.query.register_forward_hook(lambda m, a, o: rows.append(a[0]))
    with torch.no_grad():
        for b in data:
            model(**b)
    hook.remove()
    real = torch.cat([r[b["attention_mask"].bool()] for r, b in zip(rows, data)]).double()
    stats = cal["encoder.layer.0.attention.self.query.weight"]
    assert stats.tokens == real.shape[0] == sum(int(b["attention_mask"].sum()) for b in data)
    torch.testing.assert_close(stats.second_moment, real.T @ real / real.shape[0], rtol=1e-5, atol=1e-7)


def test_bert_refit_groups_qkv_and_masks_padding():
    teacher = tiny_bert()
    data = padded_batches()
    student = copy.deepcopy(teacher)
    config = TensorizeConfig(min_numel=4000, size_target=0.3, allocation="energy", max_rank=None)
    cal = comera_fx.calibrate(student, data, config=config, token_mask=lambda b: b["attention_mask"])
    comera_fx.tensorize_(student, config, calibration=cal)
    summary = comera_fx.refit_sequential_(student, teacher, data, token_mask=lambda b: b["attention_mask"])
    names = [l.name for l in summary.layers]
    assert len(names) == 12 and names[:3] == [f"encoder.layer.0.attention.self.{n}" for n in ("query", "key", "value")]
    tokens = sum(int(b["attention_mask"].sum()) for b in data)
    assert all(l.tokens == tokens for l in summary.layers)
    assert all(l.error_after <= l.error_before for l in summary.layers)
    assert "12 layers on 4 batches" in str(summary)


# Two full refits of a tiny BERT (about 90 s on 2 cores): the slow suite; the default run refits whole forwards.
@pytest.mark.slow
def test_blocks_give_the_same_refit_as_whole_forwards():
    teacher = tiny_bert()
    data = padded_batches()
    config = TensorizeConfig(min_numel=4000, size_target=0.3, allocation="energy", max_rank=None)
    mask = lambda b: b["attention_mask"]  # noqa: E731
    students = []
    for blocks in ((), ("encoder.layer.0", "encoder.layer.1")):
        student = copy.deepcopy(teacher)
        comera_fx.tensorize_(
            student, config, calibration=comera_fx.calibrate(student, data, config=config, token_mask=mask)
        )
        summary = comera_fx.refit_sequential_(student, teacher, data, token_mask=mask, blocks=blocks)
        assert not summary.notes and len(summary.layers) == 12
        students.append((student, summary))
    (whole, s_whole), (chained, s_chained) = students
    for a, b in zip(s_whole.layers, s_chained.layers):
        assert a.name == b.name and a.tokens == b.tokens
        assert a.error_after == pytest.approx(b.error_after, rel=1e-4, abs=1e-7)
    for (name, p), (_, q) in zip(whole.state_dict().items(), chained.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=name)
    with pytest.raises(ValueError, match="not modules of both models"):
        comera_fx.refit_sequential_(chained, teacher, data, blocks=["encoder.layer.9"])


class TwoBranches(nn.Module):
    """Two blocks that do not chain: the second reads the model's input, not the first block's output."""

    def __init__(self):
        super().__init__()
        self.first, self.second = MLP(128, 256, 128), MLP(128, 256, 128)

    def forward(self, x):
        return self.first(x) + self.second(x)


@pytest.mark.parametrize("blocks", [("first", "second"), ("second", "first")])
def test_blocks_that_do_not_chain_fall_back_to_whole_forwards(blocks):
    torch.manual_seed(0)
    teacher = TwoBranches()
    data = batches(3)
    results = []
    for use in ((), blocks):
        student = copy.deepcopy(teacher)
        comera_fx.tensorize_(student, SMALL.replace(max_rank=6))
        results.append(comera_fx.refit_sequential_(student, teacher, data, blocks=use))
    assert any("blocks not used" in n for n in results[1].notes) and "blocks not used" in str(results[1])
    assert [l.error_after for l in results[1].layers] == pytest.approx([l.error_after for l in results[0].layers])
