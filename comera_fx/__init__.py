"""comera_fx: compress the large weight matrices of any model into tensor-train form.

Public API::

    comera_fx.tensorize_(model, config, example_inputs=...)   # in place, before building the optimizer
    comera_fx.report(model)                                   # per-layer table / dict
    comera_fx.plan(layer, batch=4096)                         # the contraction order chosen per batch interval
    comera_fx.passes.tensorize(gm, config)                    # GraphModule -> GraphModule for custom compilers
    comera_fx.RankAdaptive(model, opt, comera_fx.BudgetConfig(size_target=0.1, total_steps=n))  # rank adaptation
    comera_fx.randomize_backward_(model, rho=0.25)            # RMM: linear backward keeps a sketch of its input
    cal = comera_fx.calibrate(model, batches)                 # input statistics for activation-aware TT-SVD
    comera_fx.tensorize_(model, TensorizeConfig(size_target=0.25, allocation="energy"), calibration=cal)
    comera_fx.refit_sequential_(model, teacher, batches)      # refit layer by layer on the compressed model's inputs
    comera_fx.save_tensorized(model, path); comera_fx.load_tensorized(path, build_fn)  # no dense weights on load
    comera_fx.quantize_(model, bits=8)                        # TT cores on an int8 grid; saved as int8 codes
    plan = comera_fx.choose_formats(model, cal, byte_budget=0.125); comera_fx.apply_formats_(model, plan, cal)
    comera_fx.distill_(student, teacher, batches, size_target=0.25, budget_seconds=600)  # compress a trained model
    comera_fx.compress_(student, teacher, batches, byte_budget=0.125, budget_seconds=600)  # the whole recipe, one call
    torch.compile(model, backend=comera_fx.backend)          # or backend="comera_fx"; comera_fx.compile(model, config)
    comera_fx.compile_regions(model)                          # each repeated block compiled once, shared by all
    program = comera_fx.export(model.eval(), (x,), dynamic_shapes=({0: Dim("b", max=64)},))  # one plan per range
    comera_fx.package(program, "model.pt2")                  # AOTInductor: runs with torch alone
"""

from . import passes
from .backend import BackendConfig, ComeraBackend, DenseWeightsWarning, backend, compile, compile_regions, make_backend
from .checkpoint import load_tensorized, save_tensorized
from .config import Allocation, Init, LayerSettings, TensorizeConfig
from .passes.randomize import RandomizeSummary, randomize_backward_, restore_backward_
from .passes.tensorize import TensorizeSummary, tensorize_
from .quantize import QuantizeSummary, quantize_
from .packed import PackedLinear, pack_linears_
from .pretrained import (
    Calibration,
    CompressSummary,
    DistillConfig,
    DistillSummary,
    FormatPlan,
    InputStats,
    RefitSummary,
    apply_formats_,
    calibrate,
    choose_formats,
    compress_,
    distill_,
    refit_sequential_,
)
from .report import Report, report
from .rmm import RMMConfig
from .runtime import BudgetConfig, CoMERAConfig, RankAdaptive, param_groups
from .serving import ExportRangeError, RangePlan, export, frozen, package, plan_for_range
from .tt import TTEmbedding, TTFormat, TTLinear, TTMatrix
from .tt.plan import plan

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "Calibration",
    "InputStats",
    "calibrate",
    "load_tensorized",
    "save_tensorized",
    "BackendConfig",
    "ComeraBackend",
    "DenseWeightsWarning",
    "DistillSummary",
    "ExportRangeError",
    "backend",
    "compile",
    "compile_regions",
    "distill_",
    "compress_",
    "CompressSummary",
    "DistillConfig",
    "PackedLinear",
    "pack_linears_",
    "export",
    "frozen",
    "make_backend",
    "refit_sequential_",
    "Init",
    "RankAdaptive",
    "BudgetConfig",
    "CoMERAConfig",
    "LayerSettings",
    "RMMConfig",
    "RangePlan",
    "RandomizeSummary",
    "RefitSummary",
    "Report",
    "TTEmbedding",
    "TTFormat",
    "TTLinear",
    "TTMatrix",
    "TensorizeConfig",
    "TensorizeSummary",
    "package",
    "apply_formats_",
    "choose_formats",
    "FormatPlan",
    "quantize_",
    "QuantizeSummary",
    "param_groups",
    "plan",
    "plan_for_range",
    "passes",
    "randomize_backward_",
    "report",
    "restore_backward_",
    "tensorize_",
]
