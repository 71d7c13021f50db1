"""Block-wise distillation (``blockwise_fraction``): each named block of the student runs on the teacher's input.

The reference gradients are written out by hand from the definition (student block i applied to the teacher's
input of block i, float64) and compared with the gradients the loop actually applied, captured at ``observe``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra)
from torch import nn

import comera_fx
from comera_fx.pretrained import DistillConfig, match_teacher, relative_mse

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int, by_keyword: bool = False):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.by_keyword = by_keyword

    def forward(self, hidden_states, scale=1.0):
        return torch.tanh(self.linear(hidden_states)) * scale


class Stack(nn.Module):
    """Three blocks; ``by_keyword`` calls them as ``block(hidden_states=h)`` (the kwargs path of the feed)."""

    def __init__(self, width: int = 6, by_keyword: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.by_keyword = by_keyword

    def forward(self, x):
        h = x
        for block in self.blocks:
            h = block(hidden_states=h) if self.by_keyword else block(h, 1.0)
        return h


NAMES = ["blocks.0", "blocks.1", "blocks.2"]
QUIET = DistillConfig(hidden_modules=(), progress=False)  # the output only unless a test names hidden modules


def make_pair(by_keyword: bool = False, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    teacher = Stack(by_keyword=by_keyword).double()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return teacher, student


def reference_grads(
    teacher: nn.Module, student: nn.Module, x: torch.Tensor, blockwise: bool, hidden_weight: float
) -> list[torch.Tensor]:
    """d loss / d student parameters, loss = relMSE(out) + w · Σ relMSE(block outputs), written out from scratch."""
    student = copy.deepcopy(student)
    with torch.no_grad():
        t_in, h = [], x
        for block in teacher.blocks:
            t_in.append(h)
            h = torch.tanh(h @ block.linear.weight.T + block.linear.bias)
        t_out = t_in[1:] + [h]
    s_out, h = [], x
    for i, block in enumerate(student.blocks):
        inp = t_in[i] if blockwise else h
        h = torch.tanh(inp @ block.linear.weight.T + block.linear.bias)
        s_out.append(h)

    def rel(a, b):
        return (a - b).pow(2).mean() / b.pow(2).mean()

    loss = rel(s_out[-1], t_out[-1]) + hidden_weight * sum(rel(s, t) for s, t in zip(s_out, t_out))
    return list(torch.autograd.grad(loss, list(student.parameters())))


def run_and_capture(teacher, student, batches, fraction, hidden_weight=0.5):
    """Run the loop; at every step keep (the student's parameters before the step, the gradients it applies)."""
    seen = []

    def observe(loss):
        seen.append((copy.deepcopy(student), [p.grad.detach().clone() for p in student.parameters()]))

    match_teacher(
        student,
        teacher,
        batches,
        steps=len(batches),
        budget_seconds=None,
        observe=observe,
        config=QUIET.replace(
            hidden_modules=NAMES,
            hidden_weight=hidden_weight,
            lr=1e-2,
            loss_fn=relative_mse,
            blockwise_fraction=fraction,
        ),
    )
    return seen


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "hidden_states="])
def test_blockwise_gradients_match_the_definition_then_end_to_end(by_keyword):
    teacher, student = make_pair(by_keyword)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(4)]
    seen = run_and_capture(teacher, student, batches, fraction=0.5)
    assert len(seen) == 4
    for step, (before, grads) in enumerate(seen):
        blockwise = step < 2  # progress 0, 0.25 < 0.5; then 0.5, 0.75: end to end
        expected = reference_grads(teacher, before, batches[step], blockwise, hidden_weight=0.5)
        other = reference_grads(teacher, before, batches[step], not blockwise, hidden_weight=0.5)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        # control: the two modes give different gradients here, so the check above can tell them apart
        assert max(float((a - b).abs().max()) for a, b in zip(expected, other)) > 1e-4


def test_blockwise_off_is_end_to_end():
    teacher, student = make_pair()
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ((before, grads),) = run_and_capture(teacher, student, [x], fraction=0.0)
    for got, want in zip(grads, reference_grads(teacher, before, x, blockwise=False, hidden_weight=0.5)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_hooks_removed_and_teacher_untouched():
    teacher, student = make_pair()
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    x = torch.randn(5, 6, dtype=torch.float64)
    run_and_capture(teacher, student, [x, x], fraction=1.0)
    for model in (teacher, student):
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in teacher.state_dict().items())
    # after the loop the student is an ordinary model again: its blocks chain their own outputs
    with torch.no_grad():
        h = x
        for block in student.blocks:
            h = torch.tanh(block.linear(h))
        torch.testing.assert_close(student(x), h)


def test_distill_blockwise_on_a_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=8,
        attn_implementation="eager",
        initializer_range=0.2,
    )
    teacher = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 100, (4, 8), generator=g)} for _ in range(8)]
    held_out = {"input_ids": torch.randint(0, 100, (4, 8), generator=g)}
    with torch.no_grad():
        reference = teacher(**held_out).last_hidden_state.clone()
    student = copy.deepcopy(teacher)
    summary = comera_fx.distill_(
        student,
        teacher,
        batches,
        0.3,
        steps=30,
        allocation="uniform",
        tensorize_config=comera_fx.TensorizeConfig(min_numel=1, min_dim=1),
        config=QUIET.replace(
            hidden_modules=["encoder.layer.0", "encoder.layer.1"],
            hidden_weight=0.5,
            lr=3e-3,
            blockwise_fraction=0.5,
            calibration_batches=0,
        ),
    )
    assert summary.steps == 30
    with torch.no_grad():
        error = float(relative_mse(student(**held_out).last_hidden_state, reference))
    start = copy.deepcopy(teacher)
    comera_fx.tensorize_(
        start,
        comera_fx.TensorizeConfig(min_numel=1, min_dim=1, size_target=0.3, allocation="uniform", max_rank=None),
        filter_fn=lambda m, n: isinstance(m, nn.Linear),
    )
    with torch.no_grad():
        untrained = float(relative_mse(start(**held_out).last_hidden_state, reference))
    assert error < 0.7 * untrained, (error, untrained)  # block-wise then end-to-end training reduces the error


def test_blockwise_errors_name_the_fix():
    teacher, student = make_pair()
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="hidden_modules"):
        match_teacher(student, teacher, [x], steps=1, budget_seconds=None, config=QUIET.replace(blockwise_fraction=0.5))
    with pytest.raises(ValueError, match=r"blockwise_fraction must be a number in \[0, 1\]"):
        match_teacher(
            student,
            teacher,
            [x],
            steps=1,
            budget_seconds=None,
            config=QUIET.replace(hidden_modules=NAMES, hidden_weight=1.0, blockwise_fraction=1.5),
        )
    with pytest.raises(ValueError, match=r"blockwise_fraction must be a number in \[0, 1\]"):
        comera_fx.distill_(
            copy.deepcopy(teacher),
            teacher,
            [x],
            0.5,
            steps=1,
            config=QUIET.replace(hidden_modules=NAMES, hidden_weight=1.0, blockwise_fraction=-0.1),
        )


class SharedStack(nn.Module):
    """One block applied twice (ALBERT-style weight sharing): it has no single input to feed."""

    def __init__(self):
        super().__init__()
        self.block = Block(6)

    def forward(self, x):
        return self.block(self.block(x))


def test_shared_block_is_refused():
    torch.manual_seed(0)
    teacher = SharedStack().double()
    student = copy.deepcopy(teacher)
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="ran more than once in one forward"):
        match_teacher(
            student,
            teacher,
            [x],
            steps=1,
            budget_seconds=None,
            config=QUIET.replace(hidden_modules=["block"], hidden_weight=1.0, blockwise_fraction=1.0),
        )
    assert all(not m._forward_pre_hooks for m in list(teacher.modules()) + list(student.modules()))
