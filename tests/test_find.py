"""The finder: which parameters linear-like / embedding ops read, found through a Dynamo capture (or a module scan)."""

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.passes.find import Candidate, UseKind, find, find_in_model, parameter_table
from comera_fx.passes.tensorize import skip_reason
from helpers_models import MLP, FunctionalLinear, LinearAndMatmul, MatmulModel, TiedLM, Unsupported

find_module = importlib.import_module("comera_fx.passes.find")  # comera_fx.passes.find is also a function


def kinds(candidate: Candidate) -> list[UseKind]:
    return [u.kind for u in candidate.uses]


def test_mlp_finds_each_linear_weight_once():
    model = MLP()
    result = find_in_model(model, (torch.randn(4, 128),))
    assert result.method == "dynamo" and result.fallback_reason is None and result.graphs == 1
    found = result.by_fqn()
    assert list(found) == ["fc1.weight", "fc2.weight"]  # biases are 1-D: not candidates
    assert kinds(found["fc1.weight"]) == [UseKind.LINEAR]
    assert found["fc1.weight"].shape == (256, 128) and found["fc2.weight"].shape == (100, 256)
    assert found["fc1.weight"].dtype == torch.float32 and found["fc1.weight"].kind == "linear"
    assert found["fc1.weight"].aliases == ("fc1.weight",)
    assert found["fc2.weight"].unsupported_uses == []


def test_functional_linear_on_raw_parameters():
    result = find_in_model(FunctionalLinear(), torch.randn(3, 128))  # a bare tensor is one positional input
    found = result.by_fqn()
    assert set(found) == {"w1", "w2"}
    assert kinds(found["w1"]) == [UseKind.LINEAR] and kinds(found["w2"]) == [UseKind.LINEAR]


def test_module_scan_misses_functional_uses():
    result = find_in_model(FunctionalLinear())  # no example inputs: only module types are seen
    assert result.method == "module-scan" and result.candidates == []
    assert "no example_inputs" in result.fallback_reason


def test_matmul_family_is_classified_matmul():
    result = find_in_model(MatmulModel(), (torch.randn(5, 128),))
    found = result.by_fqn()
    assert set(found) == {"w_addmm", "w_matmul", "w_at", "w_method", "w_mm"}
    for fqn, cand in found.items():
        assert kinds(cand) == [UseKind.MATMUL], fqn
        assert cand.kind == "linear"


def test_weight_read_by_linear_and_matmul_lists_both_uses():
    found = find_in_model(LinearAndMatmul(), (torch.randn(5, 128),)).by_fqn()
    for fqn in ("fc.weight", "w"):
        assert sorted(u.kind.value for u in found[fqn].uses) == ["linear", "matmul"], fqn
        assert found[fqn].unsupported_uses == [] and found[fqn].kind == "linear"


def test_addmm_with_scaling_is_not_linear_like():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128))
            self.b = nn.Parameter(torch.randn(128))

        def forward(self, x):
            return torch.addmm(self.b, x, self.w, beta=0.5)

    found = find_in_model(Scaled(), (torch.randn(2, 128),)).by_fqn()
    assert kinds(found["w"]) == [UseKind.OTHER]


def test_keyword_inputs():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(128, 128)

        def forward(self, *, x, scale=1.0):
            return self.fc(x) * scale

    result = find_in_model(Kw(), {"x": torch.randn(2, 128), "scale": 2.0})
    assert result.method == "dynamo" and list(result.by_fqn()) == ["fc.weight"]


def test_tied_embedding_and_head_is_one_candidate_with_two_uses():
    model = TiedLM()
    table = parameter_table(model)
    assert list(table) == ["emb.weight", "fc.weight", "fc.bias"]  # the tied weight is listed once
    result = find_in_model(model, (torch.randint(0, 300, (2, 7)),))
    found = result.by_fqn()
    assert list(found) == ["emb.weight", "fc.weight"]
    tied = found["emb.weight"]
    assert tied.aliases == ("emb.weight", "head.weight")
    assert sorted(u.kind.value for u in tied.uses) == ["embedding", "linear"]
    assert tied.kind == "embedding"
    assert tied.shape == (300, 128)


def test_module_scan_also_merges_tied_weights():
    result = find_in_model(TiedLM())
    found = result.by_fqn()
    assert result.method == "module-scan"
    assert list(found) == ["emb.weight", "fc.weight"]
    assert sorted(u.kind.value for u in found["emb.weight"].uses) == ["embedding", "linear"]
    assert found["emb.weight"].aliases == ("emb.weight", "head.weight")


def test_unsupported_uses_are_other_and_tensorize_skips_them():
    model = Unsupported()
    x = torch.randn(128, 128)
    found = find_in_model(model, (x,)).by_fqn()
    assert kinds(found["scale"]) == [UseKind.OTHER]  # x * w
    assert kinds(found["left"]) == [UseKind.OTHER]  # w @ x: the parameter is the left operand
    assert kinds(found["fc.weight"]) == [UseKind.LINEAR]

    expected = model(x)
    summary = comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096), example_inputs=(x,))
    decisions = {d.fqn: d for d in summary.layers}
    for fqn in ("scale", "left"):
        assert not decisions[fqn].converted
        assert "cannot contract" in decisions[fqn].reason
    assert "mul" in decisions["scale"].reason
    assert decisions["fc.weight"].converted
    assert isinstance(model.scale, nn.Parameter) and isinstance(model.left, nn.Parameter)
    assert isinstance(model.fc, comera_fx.TTLinear)
    assert model(x).shape == expected.shape


def test_a_parameter_used_both_ways_is_unsupported():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128))

        def forward(self, x):
            return F.linear(x, self.w) + self.w.sum()

    found = find_in_model(Both(), (torch.randn(2, 128),)).by_fqn()
    cand = found["w"]
    assert UseKind.LINEAR in kinds(cand) and cand.unsupported_uses
    assert skip_reason(cand, TensorizeConfig(min_numel=1)) is not None


class Exploding(nn.Module):
    """Takes 128 features: inputs of another width make the capture and the model itself fail."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.emb = nn.Embedding(100, 128)

    def forward(self, x):
        return self.fc(x)


class NotUnderCompile(nn.Module):
    """Runs eagerly, but raises while Dynamo traces it: Dynamo gives up and runs the frame eagerly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)

    def forward(self, x):
        if torch.compiler.is_compiling():
            raise RuntimeError("refusing to be traced")
        return self.fc(x)


def test_example_inputs_the_model_rejects_raise_with_its_error_and_the_fix():
    """A wrong width is the caller's mistake, not Dynamo's: no silent scan, the model's own error in the message."""
    with pytest.raises(ValueError, match="graph capture failed with the given example_inputs") as info:
        find_in_model(Exploding(), (torch.randn(2, 64),))
    message = str(info.value)
    assert "2x64 and 128x128" in message, "the model's own error should be shown"
    assert "Pass example_inputs the model accepts" in message and "leave example_inputs out" in message


def test_wrong_example_inputs_leave_the_model_unconverted():
    model = Exploding()
    with pytest.raises(ValueError, match="example_inputs"):
        comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096), example_inputs=(torch.randn(2, 64),))
    assert isinstance(model.fc, nn.Linear)


def test_a_capture_error_on_a_model_that_runs_eagerly_falls_back_to_module_scan(monkeypatch):
    """Dynamo failing where eager code runs is Dynamo's limit: the scan still finds the common layers."""

    def failing_capture(model, example_inputs):
        raise RuntimeError("Dynamo could not trace this")

    monkeypatch.setattr(find_module, "capture_graphs", failing_capture)
    with pytest.warns(UserWarning, match="falling back to a module-type scan"):
        result = find_in_model(Exploding(), (torch.randn(2, 128),))
    assert result.method == "module-scan"
    assert result.fallback_reason.startswith("graph capture failed (RuntimeError: Dynamo could not trace this")
    assert list(result.by_fqn()) == ["fc.weight", "emb.weight"]
    assert kinds(result.by_fqn()["emb.weight"]) == [UseKind.EMBEDDING]


def test_capture_that_records_nothing_falls_back_to_module_scan():
    model = NotUnderCompile()
    with pytest.warns(UserWarning, match="falling back to a module-type scan"):
        result = find_in_model(model, (torch.randn(2, 128),))
    assert result.method == "module-scan" and "no graph" in result.fallback_reason
    assert list(result.by_fqn()) == ["fc.weight"]


def test_tensorize_reports_the_fallback(monkeypatch):
    def failing_capture(model, example_inputs):
        raise RuntimeError("Dynamo could not trace this")

    monkeypatch.setattr(find_module, "capture_graphs", failing_capture)
    model = Exploding()
    with pytest.warns(UserWarning):
        summary = comera_fx.tensorize_(model, TensorizeConfig(min_numel=4096), example_inputs=(torch.randn(2, 128),))
    assert summary.method == "module-scan" and "graph capture failed" in summary.fallback_reason
    assert "graph capture failed" in str(summary)
    assert isinstance(model.fc, comera_fx.TTLinear)


def test_no_example_inputs_scans_modules_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = find(MLP())
    assert result.method == "module-scan" and result.fallback_reason
    assert list(result.by_fqn()) == ["fc1.weight", "fc2.weight"]


def test_repeated_captures_of_one_class_keep_finding_weights():
    # Each capture compiles afresh; Dynamo's recompile limit (8 per frame) must not make later captures empty.
    for i in range(12):
        dtype = torch.float64 if i % 2 else torch.float32
        result = find_in_model(MLP().to(dtype), (torch.randn(3, 128, dtype=dtype),))
        assert result.method == "dynamo", i
        assert list(result.by_fqn()) == ["fc1.weight", "fc2.weight"], i


class GraphBreaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 128)
        self.fc2 = nn.Linear(128, 128)
        self.w = nn.Parameter(torch.randn(128, 128) / 11)

    def forward(self, x):
        h = self.fc1(x)
        print("graph break here")
        h = F.linear(h, self.w)
        torch._dynamo.graph_break()
        return self.fc2(h)


def test_graph_breaks_merge_several_graphs(capsys):
    result = find_in_model(GraphBreaks(), (torch.randn(2, 128),))
    assert result.method == "dynamo"
    assert result.graphs > 1
    found = result.by_fqn()
    assert list(found) == ["w", "fc1.weight", "fc2.weight"]  # named_parameters order, not graph order
    assert all(kinds(c) == [UseKind.LINEAR] for c in found.values())


def test_data_dependent_branch_is_captured_with_a_graph_break():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(128, 128)
            self.pos = nn.Linear(128, 128)

        def forward(self, x):
            h = self.pre(x)
            if h.sum() > -1e9:  # data-dependent: Dynamo breaks the graph here
                h = self.pos(h)
            return h

    result = find_in_model(Branchy(), (torch.randn(2, 128),))
    assert result.method == "dynamo" and result.graphs > 1
    assert list(result.by_fqn()) == ["pre.weight", "pos.weight"]


def test_find_on_graph_module_reads_get_attr_parameters():
    gm = torch.fx.symbolic_trace(FunctionalLinear())
    result = find(gm)
    assert result.method == "graph"
    assert set(result.by_fqn()) == {"w1", "w2"}
    assert all(kinds(c) == [UseKind.LINEAR] for c in result.candidates)


def test_large_candidates_filters_by_size():
    from comera_fx.passes.find import large_candidates

    result = find_in_model(MLP(d_out=32), (torch.randn(2, 128),))
    large = [c.fqn for c in large_candidates(result, TensorizeConfig(min_numel=4096, min_dim=64))]
    assert large == ["fc1.weight"]  # fc2 is (32, 256): a dimension below min_dim
