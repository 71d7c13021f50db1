"""Pretrained compression: all-MiniLM-L6-v2, TT vs plain low-rank, with and without distillation.

Cells per size target (TT size / dense size of the encoder's linear weights): TT-SVD only (uniform; calibrated +
energy-allocated), uniform ranks + distillation, calibrated + allocated ranks + distillation, and plain low-rank
(matrix SVD of every linear, one rank per layer giving the same parameter count, trained by the same loop:
``comera_fx.pretrained.match_teacher``) + distillation. Data, evaluation and loss are those of
examples/compress_pretrained.py.

Issue 29's cells compare at equal *bytes* of the encoder's weight matrices, on held-out stdlib text and on
other-source text (numpy / sympy docstrings): ``int8 dynamic`` (``quantize_dynamic``), ``int8 group64`` /
``int4 group64`` / ``int4 per-row`` (weight fake-quantization), ``layer drop distill`` (``+int8`` / ``+int4``: then
rounded per output channel), ``low-rank distill``, ``low-rank distill +int8`` (whitened, int8 factors, at the byte
target), ``distill calibrated+energy +int8`` (a TT student, then ``quantize_``), and ``formats`` / ``formats
distill`` (``choose_formats`` at ``--ratios`` read as a fraction of the fp32 bytes, then optionally distilled in
float for the budget and rounded back onto each layer's grid; ``formats output [distill]``: candidates scored at
the model's output on two calibration batches; ``... qat``: the last 30 % of the budget quantization-aware).
``benchmarks/plot_frontier.py`` draws cosine against bytes from the ``results.json`` files. Run timing-relevant
runs under ``flock /tmp/comera_timing.lock``:

    flock /tmp/comera_timing.lock .venv/bin/python benchmarks/bench_distill.py --ratios 0.25 \\
        --methods "distill calibrated+energy" --budget-seconds 600 --threads 1 --out runs/bench_distill_4x
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
from torch import nn

import common  # benchmarks/ is this script's sys.path[0]

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
import comera_fx  # noqa: E402
from comera_fx.pretrained.augment import Augmentation  # noqa: E402
from comera_fx.pretrained import DistillConfig, match_teacher  # noqa: E402
from weight_baselines import ENCODER_PREFIX, fake_quant_, weight_bytes  # noqa: E402  (benchmarks/ is sys.path[0])
from comera_fx.quantize import quantized_bytes, requantize_, stored_bytes  # noqa: E402

cp = common.load_example("compress_pretrained")


class LowRankLinear(nn.Module):
    """y = B(Ax) + b with A (r × in), B (out × r) from the truncated SVD W ≈ (U√S)(√S Vᵀ)."""

    def __init__(self, linear: nn.Linear, rank: int):
        super().__init__()
        u, s, vh = torch.linalg.svd(linear.weight.detach().double(), full_matrices=False)
        root = s[:rank].sqrt()
        self.a = nn.Parameter((root[:, None] * vh[:rank]).to(linear.weight.dtype))
        self.b = nn.Parameter((u[:, :rank] * root).to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        return nn.functional.linear(nn.functional.linear(x, self.a), self.b, self.bias)


def to_low_rank_(model: nn.Module, ratio: float) -> tuple[int, int]:
    """Every encoder nn.Linear at rank floor(ratio · in · out / (in + out)); returns (params, dense params)."""
    params = dense = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module.weight.numel() >= 2**16:
            out_f, in_f = module.weight.shape
            rank = max(1, int(ratio * in_f * out_f / (in_f + out_f)))
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], LowRankLinear(module, rank))
            params += rank * (in_f + out_f)
            dense += in_f * out_f
    return params, dense


def scored(student, data, args, start: float, info: dict) -> dict:
    """``info`` with the student's evaluation (cosine, retrieval, other-source text) and the seconds since ``start``."""
    info.update(cp.evaluate(student, data, args.reference))
    info["total_s"] = time.perf_counter() - start
    return info


def run_low_rank(teacher, data, ratio, args) -> dict:
    student = copy.deepcopy(teacher)
    start = time.perf_counter()
    params, dense = to_low_rank_(student, ratio)
    cp.freeze_word_embedding(student, args)
    losses, seconds, _ = match_teacher(
        student,
        teacher,
        cp.training_sampler(data, args, seed=args.seed),
        steps=args.steps,
        budget_seconds=args.budget_seconds,
        config=DistillConfig(
            hidden_modules=cp.hidden_layers(teacher),
            hidden_weight=1 / 6,
            lr=args.lr,
            loss_fn=cp.distill_loss,
            quant_aware=0.0,
            progress=not args.no_progress,
        ),
    )
    info = {
        "steps": len(losses),
        "train_s": seconds,
        "ratio": params / dense,
        "ranks": {},
        "bytes_ratio": weight_bytes(student) / weight_bytes(teacher),
    }
    return scored(student, data, args, start, info)


def run_int8_dynamic(teacher, data, ratio, args) -> dict:
    """torch.ao.quantization.quantize_dynamic on the encoder's linears (int8 weights, one scale per tensor;
    activations quantized on the fly): what a user picks today. ``ratio`` is ignored (always 4x fewer bytes)."""
    start = time.perf_counter()
    student = copy.deepcopy(teacher)
    student.bert.encoder = torch.ao.quantization.quantize_dynamic(student.bert.encoder, {nn.Linear}, torch.qint8)
    info = {
        "steps": 0,
        "train_s": 0.0,
        "ratio": 1.0,
        "ranks": {},
        "bytes_ratio": weight_bytes(teacher, bits=8) / weight_bytes(teacher),
    }
    return scored(student, data, args, start, info)


def run_int_group(
    teacher, data, ratio, args, bits: int = 4, group_size: int | None = 64, per_row: bool = False
) -> dict:
    """Symmetric group-wise weight fake-quantization of every encoder linear (groups of 64 along each row, fp32
    scales; ``per_row``: one scale per output channel; activations stay float), no training: int4 in groups of 64
    about 7x fewer bytes, per row about 7.8x; int8 about 3.8x. ``ratio`` is ignored."""
    start = time.perf_counter()
    student = fake_quant_(copy.deepcopy(teacher), bits, group_size, per_row=per_row)
    info = {
        "steps": 0,
        "train_s": 0.0,
        "ratio": 1.0,
        "ranks": {},
        "bytes_ratio": weight_bytes(teacher, bits, group_size, per_row=per_row) / weight_bytes(teacher),
    }
    return scored(student, data, args, start, info)


def run_layer_drop(teacher, data, ratio, args, bits: int = 32) -> dict:
    """Keep every other encoder layer (0, 2, 4 of 6: 2x fewer encoder bytes), then distill the output embedding
    with the same loop and budget (no hidden-state loss: the layers no longer line up). ``bits`` 8 or 4: then
    round the kept weights onto that grid with one fp32 scale per output channel (int8: 2 x 4 = 8x, int4:
    2 x 8 = 16x fewer bytes, 1-2 % over the target for the scales); the same student in groups of 64 (more bytes)
    is kept under ``g64_*``, its float figure under ``float_cosine_other``. ``ratio`` is ignored."""
    student = copy.deepcopy(teacher)
    start = time.perf_counter()
    student.bert.encoder.layer = nn.ModuleList(list(student.bert.encoder.layer)[::2])
    student.bert.config.num_hidden_layers = len(student.bert.encoder.layer)
    cp.freeze_word_embedding(student, args)
    losses, seconds, _ = match_teacher(
        student,
        teacher,
        cp.training_sampler(data, args, seed=args.seed),
        steps=args.steps,
        budget_seconds=args.budget_seconds,
        config=DistillConfig(
            hidden_modules=(), lr=args.lr, loss_fn=cp.distill_loss, quant_aware=0.0, progress=not args.no_progress
        ),
    )
    info = {"steps": len(losses), "train_s": seconds, "ranks": {}}
    if bits < 16:
        grouped = fake_quant_(copy.deepcopy(student), bits, 64)
        info.update({f"g64_{k}": v for k, v in cp.evaluate(grouped, data, args.reference).items()})
        info["g64_bytes_ratio"] = weight_bytes(student, bits, 64) / weight_bytes(teacher)
        info["float_cosine_other"] = cp.evaluate(student, data, args.reference).get("cosine_other")
        fake_quant_(student, bits, per_row=True)
    info["bytes_ratio"] = info["ratio"] = (
        weight_bytes(student, bits, per_row=True) if bits < 16 else weight_bytes(student)
    ) / weight_bytes(teacher)
    return scored(student, data, args, start, info)


def run_low_rank_int8(teacher, data, ratio, args) -> dict:
    """The library's whitened (activation-aware) low-rank student (two TT cores per weight, calibrated + energy
    ranks), distilled for the budget, then its factors int8 in groups of 64 (``quantize_``): its parameter share
    is chosen so the stored bytes are ``ratio`` of the fp32 weights (int8 + one fp32 scale per 64 weights)."""
    int8_bytes = quantized_bytes(64, 8, 64) / 64  # per weight, its scale's share included
    params = ratio * 4 / int8_bytes
    student, info = cp.run_tt(teacher, data, params, "energy", True, args, num_modes=1)
    start = time.perf_counter()
    info.update({f"float_{k}": info[k] for k in ("cosine", "worst", "cosine_other", "worst_other") if k in info})
    comera_fx.quantize_(student, 8, 64)
    info["bytes_ratio"] = stored_bytes(student, ENCODER_PREFIX) / weight_bytes(teacher)
    info.update(cp.evaluate(student, data, args.reference))
    info["total_s"] += time.perf_counter() - start
    return info


def run_tt_int8(teacher, data, ratio, args) -> dict:
    """TT distill (calibrated + energy ranks) at ``ratio``, then ``comera_fx.quantize_``: every TT core int8 in
    groups of 64 values with fp32 scales: the composition of issue 29 (0.25 x int8 ~ 16x fewer bytes). The figures of
    the float student before quantization are kept under ``float_*``."""
    student, info = cp.run_tt(teacher, data, ratio, "energy", True, args)
    start = time.perf_counter()
    info.update({f"float_{k}": info[k] for k in ("cosine", "worst", "cosine_other", "worst_other") if k in info})
    comera_fx.quantize_(student, 8, 64)  # what save_tensorized then stores as int8 codes
    info["bytes_ratio"] = stored_bytes(student, ENCODER_PREFIX) / weight_bytes(teacher)
    info.update(cp.evaluate(student, data, args.reference))
    info["total_s"] += time.perf_counter() - start
    return info


OUTPUT_BATCHES = 2  # calibration batches that score candidates at the output in the "formats output" cells
QUANT_AWARE = 0.3  # the last share of the budget the "qat" cell trains at the rounded weights
ENCODER_ONLY = comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"])  # the embedding never reads the pooler


def formats_student(teacher, data, ratio, args, output_batches: int = 0):
    """``choose_formats`` + ``apply_formats_`` at ``ratio`` of the encoder linears' fp32 bytes (calibrated on the
    training text; ``output_batches``: that many of those batches score the candidates at the model's output):
    returns (student, info). Cells that share the choice (``formats output distill`` and its ``aug`` twin) reuse
    one choice per run: the choice takes minutes, and the same start makes the cells comparable."""
    cache = vars(args).setdefault("_formats_cache", {})
    key = (ratio, output_batches)
    if key not in cache:
        cache[key] = _choose_formats(teacher, data, ratio, args, output_batches)
    student, info = cache[key]
    return copy.deepcopy(student), dict(info)


def _choose_formats(teacher, data, ratio, args, output_batches: int):
    student = copy.deepcopy(teacher)
    draw = cp.training_sampler(data, args, seed=args.seed)
    start = time.perf_counter()
    batches = [draw() for _ in range(args.calibration_batches)]
    calibration = comera_fx.calibrate(student, batches, token_mask=cp.real_tokens, config=ENCODER_ONLY)
    plan = comera_fx.choose_formats(
        student, calibration, ratio, config=ENCODER_ONLY, batches=batches[:output_batches] or None
    )
    comera_fx.apply_formats_(student, plan, calibration)
    print(plan, flush=True)
    info = {
        "steps": 0,
        "train_s": 0.0,
        "setup_s": time.perf_counter() - start,
        "ratio": ratio,
        "ranks": {},
        "formats": {fqn: c.label() for fqn, c in plan.choices.items()},
        "planned_error": plan.total_error,
        "bytes_ratio": stored_bytes(student, ENCODER_PREFIX) / weight_bytes(teacher),
    }
    return student, info


def run_formats(teacher, data, ratio, args, output_batches: int = 0) -> dict:
    """A format per layer (int8 / int4 / TT with int8 or int4 cores) under one byte budget, no training."""
    start = time.perf_counter()
    student, info = formats_student(teacher, data, ratio, args, output_batches)
    return scored(student, data, args, start, info)


def run_formats_distill(
    teacher, data, ratio, args, output_batches: int = 0, augment: bool = False, quant_aware: float = 0.0
) -> dict:
    """The same, then distilled in float for the budget and rounded back onto each layer's grid (``augment``: on
    ``comera_fx.pretrained.Augmentation()`` edits of the batches: spans / dropped tokens / shuffled chunks / spliced
    rows; ``quant_aware``: that last fraction of the budget trains at the rounded weights, straight-through)."""
    start = time.perf_counter()
    student, info = formats_student(teacher, data, ratio, args, output_batches)
    info.update(
        {
            f"start_{k}": v
            for k, v in cp.evaluate(student, data, args.reference).items()
            if k in ("cosine", "cosine_other")
        }
    )
    cp.freeze_word_embedding(student, args)
    losses, seconds, _ = match_teacher(
        student,
        teacher,
        cp.training_sampler(data, args, seed=args.seed),
        steps=args.steps,
        budget_seconds=args.budget_seconds,
        config=DistillConfig(
            hidden_modules=cp.hidden_layers(teacher),
            hidden_weight=1 / 6,
            lr=args.lr,
            loss_fn=cp.distill_loss,
            quant_aware=quant_aware,
            augment=Augmentation(max_growth=2.0) if augment else None,
            progress=not args.no_progress,
        ),
    )
    info["float_cosine_other"] = cp.evaluate(student, data, args.reference).get("cosine_other")  # before rounding
    requantize_(student)
    info.update(
        {
            "steps": len(losses),
            "train_s": seconds,
            "bytes_ratio": stored_bytes(student, ENCODER_PREFIX) / weight_bytes(teacher),
        }
    )
    return scored(student, data, args, start, info)


BASELINES = {
    "low-rank distill": run_low_rank,
    "int8 dynamic": run_int8_dynamic,
    "int4 group64": run_int_group,
    "int8 group64": lambda *a: run_int_group(*a, bits=8),
    "int4 per-row": lambda *a: run_int_group(*a, bits=4, group_size=None, per_row=True),
    "layer drop distill": run_layer_drop,
    "distill calibrated+energy +int8": run_tt_int8,
    "layer drop distill +int8": lambda *a: run_layer_drop(*a, bits=8),
    "layer drop distill +int4": lambda *a: run_layer_drop(*a, bits=4),
    "low-rank distill +int8": run_low_rank_int8,
    "formats": run_formats,
    "formats distill": run_formats_distill,
    "formats output": lambda *a: run_formats(*a, output_batches=OUTPUT_BATCHES),
    "formats output distill": lambda *a: run_formats_distill(*a, output_batches=OUTPUT_BATCHES),
    "formats output distill aug": lambda *a: run_formats_distill(*a, output_batches=OUTPUT_BATCHES, augment=True),
    "formats output distill qat": lambda *a: run_formats_distill(
        *a, output_batches=OUTPUT_BATCHES, quant_aware=QUANT_AWARE
    ),
}


def main() -> None:
    load_before = common.loadavg()
    result = cp.main(sys.argv[1:], extra=BASELINES)
    record = {
        "teacher": result["teacher"],
        "results": result["results"],
        "loadavg_before": load_before,
        "loadavg_after": common.loadavg(),
        "argv": sys.argv[1:],
    }
    (result["out"] / "bench.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("loadavg_before", "loadavg_after")}))


if __name__ == "__main__":
    main()
