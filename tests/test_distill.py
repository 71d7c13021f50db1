"""comera_fx.distill_: a tensorized copy trained to match its teacher.

Reference numbers come from the teacher's outputs computed before distillation and from parameter shapes; sizes are
counted from the student's parameters, not from the summary under test.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra)
from torch import nn

import comera_fx
from comera_fx import DistillConfig, TensorizeConfig, TTLinear

SMALL = TensorizeConfig(min_numel=1, min_dim=1)  # the tiny BERT's linears are below the default size threshold
# the output matched (not the encoder layers), 8 calibration batches: the settings these tests' numbers were set on
QUIET = DistillConfig(hidden_modules=(), calibration_batches=8, progress=False)
NO_CALIBRATION = QUIET.replace(calibration_batches=0)
VOCAB, SEQ = 100, 8


def tiny_bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
        initializer_range=0.2,
    )  # weights large enough that the linears shape the output
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def make_batches(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (4, SEQ), generator=g)} for _ in range(n)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher() -> nn.Module:
    return tiny_bert()


def linear_weight_names(model: nn.Module) -> list[str]:
    return [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def tt_size(student: nn.Module) -> int:
    """Cores + gates of every TT linear, from the parameters themselves."""
    return sum(p.numel() for m in student.modules() if isinstance(m, TTLinear) for p in m.tt.parameters())


def dense_size(teacher: nn.Module, student: nn.Module) -> int:
    """Dense parameters of the teacher's linear weights that became TT layers in the student."""
    converted = {name for name, m in student.named_modules() if isinstance(m, TTLinear)}
    return sum(
        m.weight.numel() for name, m in teacher.named_modules() if isinstance(m, nn.Linear) and name in converted
    )


def relative_error(model: nn.Module, batches: list[dict], reference: list[torch.Tensor]) -> float:
    with torch.no_grad():
        num = sum(float((model(**b).last_hidden_state - r).pow(2).sum()) for b, r in zip(batches, reference))
    return num / sum(float(r.pow(2).sum()) for r in reference)


def test_distillation_beats_tt_svd_alone_at_equal_size(teacher):
    held_out = make_batches(4, seed=99)
    with torch.no_grad():
        reference = [teacher(**b).last_hidden_state.clone() for b in held_out]
    student = copy.deepcopy(teacher)
    summary = comera_fx.distill_(
        student,
        teacher,
        make_batches(8, seed=1),
        0.3,
        steps=40,
        allocation="uniform",
        tensorize_config=SMALL,
        config=QUIET.replace(lr=3e-3, calibration_batches=0),
    )
    svd_only = copy.deepcopy(teacher)
    rank = max(max(r) for r in summary.ranks.values())
    comera_fx.tensorize_(svd_only, SMALL.replace(max_rank=rank), filter_fn=lambda m, n: isinstance(m, nn.Linear))
    assert tt_size(svd_only) == tt_size(student)  # equal parameters
    before, after = relative_error(svd_only, held_out, reference), relative_error(student, held_out, reference)
    print(f"relative error: TT-SVD only {before:.4g}, distilled {after:.4g}")
    assert after < 0.5 * before, (before, after)
    assert summary.steps == 40 and len(summary.losses) == 40


@pytest.mark.parametrize(
    "target, start, allocation",
    [(0.5, None, "energy"), (0.25, None, "uniform"), (0.25, None, "energy"), (0.3, 0.8, "energy")],
)
def test_size_target_is_reached(teacher, target, start, allocation):
    student = copy.deepcopy(teacher)
    summary = comera_fx.distill_(
        student,
        teacher,
        make_batches(4, seed=2),
        target,
        start_ratio=start,
        allocation=allocation,
        steps=12,
        tensorize_config=SMALL,
        config=QUIET,
    )
    converted = [name for name, m in student.named_modules() if isinstance(m, TTLinear)]
    assert len(converted) == len(linear_weight_names(teacher))  # every linear, no embedding
    assert not any(isinstance(m, comera_fx.TTEmbedding) for m in student.modules())
    ratio = tt_size(student) / dense_size(teacher, student)
    assert 0.7 * target <= ratio <= target, ratio
    assert summary.ratio == pytest.approx(ratio)


def snapshot(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        {k: p.requires_grad for k, p in model.named_parameters()},
        {k: m.training for k, m in model.named_modules()},
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
    )


def test_teacher_is_untouched_and_frozen_parameters_stay_frozen():
    teacher = tiny_bert(seed=3)
    teacher.train()
    teacher.encoder.layer[1].train(False)  # mixed flags must come back as they were
    teacher.embeddings.word_embeddings.weight.requires_grad_(False)
    teacher.encoder.layer[0].attention.self.query.weight.requires_grad_(False)
    before = snapshot(teacher)
    student = copy.deepcopy(teacher)
    frozen_embedding = student.embeddings.word_embeddings.weight.detach().clone()
    comera_fx.distill_(
        student,
        teacher,
        make_batches(4, seed=4),
        0.5,
        steps=6,
        tensorize_config=SMALL,
        config=QUIET.replace(hidden_modules=["encoder.layer.0"], hidden_weight=1.0, lr=1e-2),
    )
    after = snapshot(teacher)
    assert before[0].keys() == after[0].keys()
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key
    assert before[1:] == after[1:]
    # frozen in the teacher -> frozen and untrained in the student; the rest trained
    assert not student.embeddings.word_embeddings.weight.requires_grad
    assert torch.equal(student.embeddings.word_embeddings.weight, frozen_embedding)
    query = student.encoder.layer[0].attention.self.query
    assert isinstance(query, TTLinear)
    assert not any(p.requires_grad for p in query.tt.parameters()) and query.bias.requires_grad
    key = student.encoder.layer[0].attention.self.key
    assert all(p.requires_grad for p in key.tt.parameters())
    # the student's own modes are restored too
    assert student.training and not student.encoder.layer[1].training


def test_batches_as_callable_iterable_tuple_and_one_shot_iterator(teacher):
    calls = []

    def draw():
        calls.append(1)
        return {"input_ids": torch.randint(0, VOCAB, (4, SEQ))}

    s = comera_fx.distill_(copy.deepcopy(teacher), teacher, draw, 0.5, steps=5, tensorize_config=SMALL, config=QUIET)
    assert len(calls) == 8 and s.steps == 5  # 8 calibration batches, which also serve as the first training batches
    calls.clear()
    s = comera_fx.distill_(
        copy.deepcopy(teacher),
        teacher,
        draw,
        0.5,
        steps=5,
        tensorize_config=SMALL,
        config=NO_CALIBRATION,
    )
    assert len(calls) == 5 and s.steps == 5
    tuples = [(b["input_ids"],) for b in make_batches(2, seed=5)]  # positional inputs, reused across passes
    s = comera_fx.distill_(copy.deepcopy(teacher), teacher, tuples, 0.5, steps=5, tensorize_config=SMALL, config=QUIET)
    assert s.steps == 5 and all(torch.isfinite(torch.tensor(s.losses)))
    tensors = [b["input_ids"] for b in make_batches(2, seed=6)]
    s = comera_fx.distill_(copy.deepcopy(teacher), teacher, tensors, 0.5, steps=3, tensorize_config=SMALL, config=QUIET)
    assert s.steps == 3
    one_shot = iter(make_batches(3, seed=7))
    s = comera_fx.distill_(
        copy.deepcopy(teacher), teacher, one_shot, 0.5, steps=10, tensorize_config=SMALL, config=QUIET
    )
    assert s.steps == 3 and any("ran out" in n for n in s.notes)


def test_output_fn_and_global_rng_untouched(teacher):
    batches = make_batches(2, seed=8)
    seen = []

    def pooled(outputs):
        seen.append(1)
        return outputs.last_hidden_state.mean(dim=1)

    state = torch.random.get_rng_state()
    s = comera_fx.distill_(
        copy.deepcopy(teacher),
        teacher,
        batches,
        0.5,
        steps=3,
        tensorize_config=SMALL,
        config=QUIET.replace(output_fn=pooled),
    )
    assert torch.equal(state, torch.random.get_rng_state())
    assert len(seen) == 6 and s.steps == 3  # teacher and student, per step


def test_augment_edits_training_batches_only(teacher):
    """``augment=``: the calibration sees the batches as given; the training steps see edited copies (both models
    the same copy), drawn from augment's own generator."""
    batches = [
        {"input_ids": b["input_ids"], "attention_mask": torch.ones_like(b["input_ids"])}
        for b in make_batches(3, seed=13)
    ]
    given = {tuple(row) for b in batches for row in b["input_ids"].tolist()}
    seen = {"teacher": [], "student": []}

    def record(name):
        def hook(module, args, kwargs):
            seen[name].append(kwargs["input_ids"].tolist())

        return hook

    student = copy.deepcopy(teacher)
    handles = [
        teacher.register_forward_pre_hook(record("teacher"), with_kwargs=True),
        student.register_forward_pre_hook(record("student"), with_kwargs=True),
    ]
    state = torch.random.get_rng_state()
    try:
        edits = comera_fx.pretrained.Augmentation(batch_fraction=1.0, span=1.0, drop=1.0, drop_rate=0.5)
        s = comera_fx.distill_(
            student,
            teacher,
            batches,
            0.5,
            steps=6,
            tensorize_config=SMALL,
            config=QUIET.replace(calibration_batches=2, augment=edits),
        )
    finally:
        for handle in handles:
            handle.remove()
    assert s.steps == 6 and torch.equal(state, torch.random.get_rng_state())
    calibration, training = seen["student"][:2], seen["student"][2:]
    assert all(tuple(row) in given for batch in calibration for row in batch)  # calibration: as given
    assert seen["teacher"] == training and len(training) == 6  # the teacher labels the same edited copies
    edited_rows = [tuple(row) for batch in training for row in batch if tuple(row) not in given]
    assert len(edited_rows) > len(training)  # spans and dropped tokens: most training rows are new text


def test_student_works_after_distillation(teacher):
    student = copy.deepcopy(teacher)
    comera_fx.distill_(student, teacher, make_batches(2, seed=9), 0.5, steps=2, tensorize_config=SMALL, config=QUIET)
    student.eval()
    x = make_batches(1, seed=10)[0]
    with torch.no_grad():
        out = student(**x).last_hidden_state
    fresh = copy.deepcopy(teacher)
    comera_fx.tensorize_(fresh, SMALL.replace(max_rank=64), filter_fn=lambda m, n: isinstance(m, nn.Linear))
    fresh.load_state_dict(student.state_dict())  # TT matrices adopt the checkpoint's ranks
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(**x).last_hidden_state, out)


@pytest.mark.slow
def test_compiles_with_the_backend_after_distillation(teacher):
    student = copy.deepcopy(teacher)
    comera_fx.distill_(student, teacher, make_batches(2, seed=11), 0.5, steps=2, tensorize_config=SMALL, config=QUIET)
    x = make_batches(1, seed=12)[0]["input_ids"]
    with torch.no_grad():
        expected = student.eval()(x).last_hidden_state
        compiled = torch.compile(student, backend=comera_fx.backend)
        torch.testing.assert_close(compiled(x).last_hidden_state, expected, rtol=1e-4, atol=1e-5)


def test_errors_name_the_fix(teacher):
    batches = make_batches(1, seed=13)
    ok = dict(steps=1, tensorize_config=SMALL)
    for bad in (0, 0.0, 1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="size_target must be a float in"):
            comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, bad, config=QUIET, **ok)
    with pytest.raises(ValueError, match="needs a budget: pass steps="):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, 0.5, tensorize_config=SMALL, config=QUIET)
    with pytest.raises(ValueError, match="budget_seconds must be"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, 0.5, budget_seconds=0, config=QUIET)
    with pytest.raises(ValueError, match="start_ratio must be"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, 0.5, start_ratio=0.4, config=QUIET, **ok)
    with pytest.raises(ValueError, match="pass a copy"):
        comera_fx.distill_(teacher, teacher, batches, 0.5, config=QUIET, **ok)
    with pytest.raises(ValueError, match="shares parameter"):
        comera_fx.distill_(copy.copy(teacher), teacher, batches, 0.5, config=QUIET, **ok)
    other = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        ),
        add_pooling_layer=False,
    )
    with pytest.raises(ValueError, match="not a copy of teacher"):
        comera_fx.distill_(other, teacher, batches, 0.5, config=QUIET, **ok)
    wide = tiny_bert()
    wide.encoder.layer[0].output.dense = nn.Linear(64, 33)  # same parameter names, one shape differs
    with pytest.raises(ValueError, match="has shape"):
        comera_fx.distill_(wide, teacher, batches, 0.5, config=QUIET, **ok)
    done = copy.deepcopy(teacher)
    comera_fx.tensorize_(done, SMALL)
    with pytest.raises(ValueError, match="already holds TT layers"):
        comera_fx.distill_(done, teacher, batches, 0.5, config=QUIET, **ok)
    with pytest.raises(ValueError, match="a batch must be a dict"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, ["text"], 0.5, config=QUIET, **ok)
    with pytest.raises(ValueError, match="yielded no batch"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, [], 0.5, config=QUIET, **ok)
    with pytest.raises(ValueError, match="hidden_modules"):
        comera_fx.distill_(
            copy.deepcopy(teacher),
            teacher,
            batches,
            0.5,
            config=QUIET.replace(hidden_modules=["nope"], hidden_weight=1.0),
            **ok,
        )
    with pytest.raises(ValueError, match="raise size_target"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, 1e-4, config=QUIET, **ok)


def test_old_keywords_and_wrong_configs_are_refused_naming_the_fix(teacher):
    """The distillation settings are one DistillConfig: a setting passed loose, a dict, or a TensorizeConfig as
    config= is a TypeError spelling the call to write, raised before the student changes; target_ratio= is gone."""
    batches = make_batches(1, seed=5)
    student = copy.deepcopy(teacher)
    with pytest.raises(TypeError, match=re.escape("config=DistillConfig(lr=0.001, calibration_batches=1)")):
        comera_fx.distill_(student, teacher, batches, 0.3, steps=1, lr=1e-3, calibration_batches=1)
    with pytest.raises(TypeError, match=re.escape("DistillConfig(lr=0.001)")):
        comera_fx.distill_(student, teacher, batches, 0.3, steps=1, config={"lr": 1e-3})
    with pytest.raises(TypeError, match="as tensorize_config="):
        comera_fx.distill_(student, teacher, batches, 0.3, steps=1, config=SMALL)
    with pytest.raises(TypeError, match="pass size_target"):
        comera_fx.distill_(student, teacher, batches, 0.3, steps=1, target_ratio=0.3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        comera_fx.distill_(student, teacher, batches, 0.3, steps=1, nope=1)
    from comera_fx.pretrained import match_teacher

    with pytest.raises(TypeError, match=re.escape("match_teacher(..., config=DistillConfig(quant_aware=0.3))")):
        match_teacher(student, teacher, batches, steps=1, quant_aware=0.3)
    assert not any(isinstance(m, TTLinear) for m in student.modules())


def test_rank_settings_it_would_not_use_are_refused(teacher):
    """distill_ sizes the layers by size_target: a config's max_rank / rank_ratio / rel_tol (or size_target) is
    refused by name before anything runs, never dropped; its defaults and max_rank=None pass."""
    batches = make_batches(1, seed=13)
    ok = dict(size_target=0.5, steps=1)
    for changes, named in (
        (dict(max_rank=8), "max_rank=8"),
        (dict(max_rank=None, rank_ratio=0.5), "rank_ratio=0.5"),
        (dict(max_rank=None, rel_tol=0.1), "rel_tol=0.1"),
        (dict(overrides={"query": {"max_rank": 4}}), "overrides['query']['max_rank']"),
        (dict(size_target=0.9), "size_target=0.9"),
    ):
        student = copy.deepcopy(teacher)
        with pytest.raises(ValueError, match=re.escape(named)):
            comera_fx.distill_(
                student, teacher, batches, tensorize_config=SMALL.replace(**changes), config=NO_CALIBRATION, **ok
            )
        assert not any(isinstance(m, TTLinear) for m in student.modules())  # refused before any change
    summary = comera_fx.distill_(
        copy.deepcopy(teacher),
        teacher,
        batches,
        tensorize_config=SMALL.replace(max_rank=None),
        config=NO_CALIBRATION,
        **ok,
    )
    assert summary.steps == 1


def test_a_size_target_below_rank_one_is_its_own_exception_type(teacher):
    from comera_fx.passes.sizing import SizeTargetTooSmall

    batches = make_batches(1, seed=13)
    with pytest.raises(SizeTargetTooSmall, match="raise size_target"):
        comera_fx.distill_(
            copy.deepcopy(teacher),
            teacher,
            batches,
            1e-4,
            steps=1,
            tensorize_config=SMALL,
            config=NO_CALIBRATION,
        )
    with pytest.raises(SizeTargetTooSmall, match="rank 1"):
        comera_fx.tensorize_(copy.deepcopy(teacher), SMALL.replace(size_target=10))
    assert issubclass(SizeTargetTooSmall, ValueError)  # callers catching ValueError keep working


def test_refit_runs_on_the_calibration_batches(teacher):
    """distill_(refit=True): the summary's refit errors are the layers' real errors on the calibration batches
    (measured here from the layers' outputs), and the refit student is closer to the teacher than the plain one."""
    batches = make_batches(16, seed=21)
    reference = [teacher(**b).last_hidden_state.detach() for b in batches]
    config = QUIET.replace(lr=1e-12, calibration_batches=16)
    kwargs = dict(size_target=0.4, steps=1, tensorize_config=SMALL)
    plain = copy.deepcopy(teacher)
    comera_fx.distill_(plain, teacher, batches, config=config, **kwargs)
    refit = copy.deepcopy(teacher)
    summary = comera_fx.distill_(refit, teacher, batches, refit=True, config=config, **kwargs)
    assert summary.refit is not None and len(summary.refit.layers) == 12 and summary.refit.batches == 16
    assert any(n.startswith("refit_sequential_: 12 layers") for n in summary.notes)
    for layer in summary.refit.layers[:3]:
        outs = {}
        for name, model in (("t", teacher), ("s", refit)):
            seen = []
            handle = model.get_submodule(layer.name).register_forward_hook(lambda m, a, o: seen.append(o))
            with torch.no_grad():
                for b in batches:
                    model(**b)
            handle.remove()
            outs[name] = torch.cat([o.reshape(-1, o.shape[-1]) for o in seen]).double()
        real = float((outs["s"] - outs["t"]).norm() / outs["t"].norm())
        assert layer.error_after == pytest.approx(real, rel=1e-3)
    assert relative_error(refit, batches, reference) < relative_error(plain, batches, reference)
    with pytest.raises(ValueError, match="calibration_batches >= 1"):
        comera_fx.distill_(copy.deepcopy(teacher), teacher, batches, refit=True, config=NO_CALIBRATION, **kwargs)


def test_compress_pretrained_example_quick(tmp_path):
    """examples/compress_pretrained.py on a tiny random BERT (no package needed): every cell runs (training batches
    mixed with code) at the requested size, and what it reports moves the right way. The teacher scores cosine 1
    against its own embeddings; calibrated TT-SVD is closer to the teacher than uniform TT-SVD, and distillation
    (3 steps, starting from that uniform TT-SVD at the same size) closer than the TT-SVD it starts from (both
    margins are wide: ~0.35 -> 0.98 and ~0.35 -> 0.6); the report and plots are written, and the saved student
    loads back to the same embeddings."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "compress_pretrained.py"
    spec = importlib.util.spec_from_file_location("compress_pretrained", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = module.main(
        [
            "--quick",
            "--tiny",
            "--max-files",
            "30",
            "--threads",
            "1",
            "--no-progress",
            "--code-fraction",
            "0.3",
            "--out",
            str(tmp_path),
        ]
    )
    cells = {r["method"]: r for r in out["results"]}
    assert cells.keys() == set(module.METHODS)
    assert abs(out["teacher"]["cosine"] - 1) < 1e-5, out["teacher"]
    for r in out["results"]:
        assert 0.2 <= r["ratio"] <= 0.25, r  # --quick asks for 0.25
    cosine = {method: r["cosine"] for method, r in cells.items()}
    assert cosine["tt-svd calibrated+energy"] > cosine["tt-svd uniform"], cosine
    assert (
        cells["distill uniform"]["steps"] == 3 and cells["distill uniform"]["ratio"] == cells["tt-svd uniform"]["ratio"]
    ), cells
    assert cosine["distill uniform"] > cosine["tt-svd uniform"], cosine
    assert out["saved"]["max_abs_diff"] < 1e-5
    report = (tmp_path / "report.md").read_text()
    assert "cosine_vs_compression.png" in report and (tmp_path / "ranks_per_layer.png").exists()
