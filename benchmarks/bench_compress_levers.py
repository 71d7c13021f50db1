"""Issue 46 (quality): which training lever lifts ``compress_``'s cosine on text from another source than the
training text, compared at a fixed number of steps (a 600 s budget gives another step count under every load).

One process prepares the README recipe's data (bench_distill_formats.py ``compress``: stdlib docstrings, batches of
32 by length, 64 tokens, half the batches of joined 128-token rows, word embedding frozen, ``loss_fn=distill_loss``),
calibrates and chooses the formats once (cached in ``--cache`` per byte budget and ``choose_formats`` options:
``--formats``, ``--num-modes``, ``--ranks``; later runs skip the two minutes), then trains one fresh copy per variant
from that same start and prints one JSON line each: cosine to the teacher on held-out stdlib text and on the
other-source text (numpy + sympy docstrings), the latter also by token length.

    flock /tmp/timing.lock python benchmarks/bench_compress_levers.py --budget 0.125 --steps 300 \\
        --variants base qa=1.0 lr=1e-3 data=short

A variant is ``key=value`` pairs joined by ``,`` (``base``: compress_'s defaults): ``lr``, ``qa`` (quant_aware),
``hw`` (hidden_weight), ``val`` (validation_batches; 0: the last step's weights are returned), ``warmup`` /
``floor`` (the schedule's warm-up share and final lr factor), ``bal`` (1: ``balance_cores_`` on the built student,
every TT chain's cores at one RMS entry), ``data`` (the share of the batches made of
consecutive training texts joined into long rows, ``examples/compress_pretrained.py --long-fraction``: ``base`` the
recipe's 0.5; ``short`` 0, ``mix`` 0.5, ``long`` 1, or a number), ``ref`` (the share of the batches from the Python
reference topics, ``examples/compress_pretrained.py --reference-fraction``; taken from the single texts' share),
``clip`` (0: int grids at max|w| scales, for the format choice and the build, as before 2026-12-06; 1, the default:
scales searched with the calibrated input importance, ``comera_fx.quantize.CLIP_RATIOS``; each its own cached start),
``hm`` (``sub``: the attention sublayer's and the intermediate (GELU) output of every block matched too,
``all``: and the attention's context; ``block``: the blocks only, the default), ``bs`` (rows a training batch; the
recipe's 32; the calibration batches stay the recipe's), ``pack`` (0: ``DistillConfig(pack=False)``), ``amp``
(``bf16``: ``DistillConfig(autocast=torch.bfloat16)``), ``flr`` / ``ilr`` (learning-rate multipliers for the TT
cores, low-rank factors among them, and for the weights of the int-grid layers; the schedule scales them alike),
``cb`` (``calibration_batches``; the cached start stays calibrated on the recipe's 32, so give a ``--start``
calibrated on as many: ``cb`` then moves where the validation batches are drawn from), ``pkg`` (the installed packages
whose docstrings join the stdlib's as training prose, single texts and joined long rows alike, joined by ``+``, in
place of the recipe's ``extra_packages`` (torch); ``pkg=none``: the stdlib's alone; never numpy or sympy, whose
docstrings are the other-source text). The recipe's start is cached per ``extra_packages`` (its calibration batches
are drawn from the training prose).
``baselines`` as a variant: int8 and int4 per output channel and int4 in groups of 64, rounded, no training, with
max|w| scales and with searched ones.
``--save DIR`` keeps each variant's student (``save_tensorized``), e.g. for ``bench_distill_formats.py serve
--student``. ``--start FILE``: train from another start, ``torch.save((calibration, plan), FILE)`` made on this
teacher (e.g. the format choice on other calibration batches), instead of the cached recipe start, for every
variant (``clip=0`` too: the file's plan was measured with the grids it was made with).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.use_this_checkout()
cp = common.load_example("compress_pretrained")

import comera_fx  # noqa: E402
from comera_fx import quantize as quantize_module  # noqa: E402
from comera_fx.pretrained import DistillConfig, compress_  # noqa: E402
from comera_fx.pretrained import compress as compress_module  # noqa: E402
from comera_fx.pretrained import match as match_module  # noqa: E402
from comera_fx.pretrained.formats import FORMATS, input_importance  # noqa: E402
from comera_fx.tt.balance import balance_cores_  # noqa: E402

ENCODER_ONLY = comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"])
RECIPE = common.COMPRESS_RECIPE
LENGTH_BUCKETS = ((0, 32), (32, 64), (64, 129))


def parse_variant(text: str) -> dict:
    if text in ("base", "baselines"):
        return {}
    return dict(pair.split("=", 1) for pair in text.split(","))


#: ``data=`` variants: the share of the batches made of joined long rows (the recipe's is RECIPE["long_fraction"])
DATA_SHARES = {"short": 0.0, "mix": 0.5, "long": 1.0}


def sampler(data: dict, kind: str, seed: int, reference: float = 0.0, batch_size: int | None = None):
    """The recipe's batches (``kind`` "base") or those with another share of long rows (a ``DATA_SHARES`` name or
    a number); ``reference``: that share of the batches from the Python reference topics (the rest stays
    single texts); ``batch_size``: rows a batch (the recipe's 32 by default)."""
    share = RECIPE["long_fraction"] if kind == "base" else DATA_SHARES.get(kind)
    share = float(kind) if share is None else share
    ns = argparse.Namespace(
        **{
            **RECIPE,
            "long_fraction": share,
            "reference_fraction": reference,
            "batch_size": batch_size or RECIPE["batch_size"],
        }
    )
    return cp.training_sampler(data, ns, seed=seed)


def with_package_prose(data: dict, packages: str, tokenizer) -> dict:
    """``data`` with the training prose of ``examples/compress_pretrained.py --extra-packages`` ``packages`` (joined
    by ``+``; ``none``: the stdlib's alone) instead of the recipe's, single texts and joined long rows; the start
    (calibration and format choice) stays the cached one."""
    mined = cp.mine_stdlib()
    other = cp.mine_other_source(set(mined["train"]), limit=RECIPE["other_texts"])
    names = () if packages == "none" else tuple(packages.split("+"))
    prose, rows, n_extra = cp.training_prose(mined, other, names, RECIPE["long_chars"])
    print(json.dumps({"pkg": packages, "extra_texts": n_extra, "train_texts": len(prose)}), flush=True)
    return {
        **data,
        "train_enc": cp.tokenize_all(tokenizer, prose, max_length=RECIPE["train_len"]),
        "train_long_enc": cp.tokenize_all(tokenizer, rows, max_length=RECIPE["long_len"]),
    }


def cosines(model, data, reference) -> dict:
    """Mean cosine on held-out stdlib and other-source texts, and on the latter by token-length bucket."""
    stdlib = (cp.embed(model, data["test_texts_enc"]) * reference["texts"]).sum(-1)
    other = (cp.embed(model, data["other_texts_enc"]) * reference["other"]).sum(-1)
    lengths = data["other_texts_enc"]["attention_mask"].sum(1)
    result = {
        "cosine_stdlib": round(float(stdlib.mean()), 4),
        "cosine_other": round(float(other.mean()), 4),
        "worst_other": round(float(other.min()), 4),
    }
    for lo, hi in LENGTH_BUCKETS:
        inside = (lengths >= lo) & (lengths < hi)
        result[f"other_len{lo}-{hi - 1}"] = round(float(other[inside].mean()), 4) if inside.any() else None
    return result


def recipe_calibration(teacher, data):
    """(calibration, its batches) as ``compress_`` makes them: the recipe's first ``calibration_batches`` batches
    (seed 0), padding masked."""
    draw = cp.training_sampler(data, argparse.Namespace(**RECIPE), seed=0)
    drawn = [draw() for _ in range(DistillConfig().calibration_batches)]
    return comera_fx.calibrate(teacher, drawn, config=ENCODER_ONLY, token_mask=cp.real_tokens), drawn


def start_of(teacher, data, budget: float, cache: Path | None, choose_options: dict | None = None):
    """(calibration, plan) at ``budget``: from ``cache`` if there, else made as compress_ makes them
    (``choose_options``: extra ``choose_formats`` arguments, part of the cache's file name)."""
    choose_options = choose_options or {}
    suffix = "".join(
        f"_{key}{'-'.join(map(str, v)) if isinstance(v, tuple) else v}" for key, v in choose_options.items()
    )
    if RECIPE["long_fraction"]:  # the calibration batches are the recipe's, long rows among them
        suffix += f"_long{RECIPE['long_fraction']}"
    if RECIPE["extra_packages"]:  # and drawn from its training prose
        suffix += "_pkg-" + "-".join(RECIPE["extra_packages"])
    if quantize_module.CLIP_RATIOS != (1.0,):  # int candidates measured on searched scales
        suffix += f"_clip{len(quantize_module.CLIP_RATIOS)}"
    path = cache / f"start_{budget}{suffix}.pt" if cache else None
    if path is not None and path.exists():
        return torch.load(path, weights_only=False)
    calibration, drawn = recipe_calibration(teacher, data)
    plan = comera_fx.choose_formats(
        teacher, calibration, budget, config=ENCODER_ONLY, batches=drawn[:2], fast=True, **choose_options
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save((calibration, plan), path)
    return calibration, plan


@contextlib.contextmanager
def rounding(clip: str):
    """``clip=0``: int grids at max|w| scales (what the format choice and ``apply_formats_`` did before their
    scales were searched); ``1`` (default): ``quantize.CLIP_RATIOS`` as shipped."""
    original = quantize_module.CLIP_RATIOS
    quantize_module.CLIP_RATIOS = original if int(clip) else (1.0,)
    try:
        yield
    finally:
        quantize_module.CLIP_RATIOS = original


def schedule(warmup: float, floor: float):
    import math

    def factor(progress: float) -> float:
        if progress < warmup:
            return (progress + 1e-3) / warmup
        p = min(1.0, (progress - warmup) / (1 - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))

    return factor


#: ``hm=`` variants: which outputs of each encoder block are matched besides the block's own
SUBLAYERS = {
    "block": (),
    "sub": ("attention.output", "intermediate"),
    "all": ("attention.self", "attention.output", "intermediate"),
}


def matched_modules(model, kind: str) -> tuple[str, ...]:
    """The block outputs (compress_'s default) and, per block, the outputs of the sublayers ``SUBLAYERS[kind]``."""
    blocks = cp.hidden_layers(model)
    return tuple(f"{b}.{s}" for b in blocks for s in SUBLAYERS[kind]) + tuple(blocks)


def scaled_adamw(student, factored: float, grid: float):
    """An ``AdamW`` factory for ``match_teacher``: its parameters in three groups, the TT cores (``*.tt.cores.*``)
    at ``factored`` × the learning rate, the int-grid layers' weights (modules with a recorded grid) at ``grid`` ×,
    the rest at 1 ×. ``match_teacher`` sets every group's lr each step; the optimizer applies the factor inside
    ``step``."""
    adamw = torch.optim.AdamW

    class ScaledAdamW(adamw):
        def step(self, closure=None):
            rates = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] *= group["scale"]
            try:
                return super().step(closure)
            finally:
                for group, lr in zip(self.param_groups, rates):
                    group["lr"] = lr

    def make(params, **kwargs):
        params = list(params)
        scale = {}
        for name, module in student.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if name.endswith(".cores"):  # a TTMatrix's ParameterList (low-rank factors are two-core chains)
                    scale[id(p)] = factored
                elif pname in getattr(module, quantize_module.SPEC_ATTR, {}):
                    scale[id(p)] = grid
        groups = {}
        for p in params:
            groups.setdefault(scale.get(id(p), 1.0), []).append(p)
        print(json.dumps({"lr_groups": {str(k): sum(p.numel() for p in v) for k, v in groups.items()}}), flush=True)
        return ScaledAdamW([{"params": v, "scale": k} for k, v in groups.items()], **kwargs)

    return make


def run_variant(name, teacher, data, start, args) -> dict:
    spec = parse_variant(name)
    student = copy.deepcopy(teacher)
    cp.freeze_word_embedding(student, argparse.Namespace(**RECIPE))
    config = DistillConfig(loss_fn=cp.distill_loss, progress=False)
    if "lr" in spec:
        config = config.replace(lr=float(spec["lr"]))
    if "qa" in spec:
        config = config.replace(quant_aware=float(spec["qa"]))
    if "hw" in spec:
        config = config.replace(hidden_weight=float(spec["hw"]))
    if "val" in spec:
        config = config.replace(validation_batches=int(spec["val"]))
    if "cb" in spec:  # cb=64: DistillConfig(calibration_batches=64); a cached start is made on the recipe's 32
        config = config.replace(calibration_batches=int(spec["cb"]))
    if "pack" in spec:  # pack=0: the int layers stay fake-quantized fp32 (the same values, no packed kernels)
        config = config.replace(pack=bool(int(spec["pack"])))
    if "hm" in spec:  # hm=sub: every sublayer's output matched too, not only each block's
        config = config.replace(hidden_modules=matched_modules(teacher, spec["hm"]))
    if "amp" in spec:  # amp=bf16: DistillConfig.autocast
        config = config.replace(autocast={"bf16": torch.bfloat16, "fp16": torch.float16}[spec["amp"]])
    original = match_module.lr_factor
    match_module.lr_factor = schedule(float(spec.get("warmup", 0.05)), float(spec.get("floor", 0.1)))
    original_match = compress_module.match_teacher
    original_adamw = torch.optim.AdamW
    if "flr" in spec or "ilr" in spec:
        torch.optim.AdamW = scaled_adamw(student, float(spec.get("flr", 1.0)), float(spec.get("ilr", 1.0)))
    if int(spec.get("bal", 0)):

        def balanced_match(trained, *a, **k):
            balance_cores_(trained)  # after building, before the first step
            return original_match(trained, *a, **k)

        compress_module.match_teacher = balanced_match
    if "pkg" in spec:
        data = with_package_prose(data, spec["pkg"], tokenizer_box[0])
    calibration, plan = copy.deepcopy(start)
    load_before = common.loadavg()
    try:
        summary = compress_(
            student,
            teacher,
            sampler(data, spec.get("data", "base"), args.seed, float(spec.get("ref", 0.0)), int(spec.get("bs", 0))),
            byte_budget=args.budget,
            budget_seconds=args.budget_seconds,
            steps=args.steps,
            config=config,
            tensorize_config=ENCODER_ONLY,
            calibration=calibration,
            plan=plan,
        )
    finally:
        match_module.lr_factor = original
        compress_module.match_teacher = original_match
        torch.optim.AdamW = original_adamw
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        comera_fx.save_tensorized(student, Path(args.save) / f"{args.budget}_{name.replace('=', '-')}.st")
    return {
        "variant": name,
        "budget": args.budget,
        "steps": summary.steps,
        "distill_seconds": round(summary.seconds["distill"], 1),
        "setup_seconds": {k: round(v, 1) for k, v in summary.seconds.items() if k != "distill"},
        "stored_over_dense": round(summary.stored_bytes / summary.dense_bytes, 4),
        "loss_last10": round(sum(summary.losses[-10:]) / len(summary.losses[-10:]), 4),
        "validation": [(step, round(loss, 5)) for step, loss in summary.validation],
        "notes": summary.notes,
        **cosines(student.eval(), data, reference_box[0]),
        "counts": summary.plan.counts(),
        "load_before": load_before,
        "load_after": common.loadavg(),
    }


def baselines(teacher, data) -> list[dict]:
    """Dense grids of the teacher's encoder linears, rounded, no training: int8 per output channel (the 4x
    goal's bar), int4 per output channel and int4 in groups of 64, each with max|w| scales (torchao's and torch's
    weight-only grids are max-scaled) and with the scales searched on the recipe's calibration (what
    ``apply_formats_`` builds)."""
    calibration, _ = recipe_calibration(teacher, data)
    rows = []
    for (bits, group), searched in itertools.product(((8, None), (4, None), (4, 64)), (False, True)):
        student = copy.deepcopy(teacher)
        linears = {n: m for n, m in student.named_modules() if n.startswith("bert.encoder.") and hasattr(m, "weight")}
        dense = sum(m.weight.numel() * 4 for m in linears.values() if m.weight.dim() == 2)
        stored = 0
        with torch.no_grad():
            for name, m in linears.items():
                if m.weight.dim() != 2:
                    continue
                size = m.weight.shape[1] if group is None else group  # per output channel: one group per row
                importance = input_importance(calibration[f"{name}.weight"]) if searched else None
                m.weight.copy_(comera_fx.quantize.fake_quant(m.weight, bits, size, importance))
                stored += comera_fx.quantize.quantized_bytes(m.weight.numel(), bits, size)
        label = f"int{bits} per output channel" if group is None else f"int{bits} g{group}"
        rows.append(
            {
                "variant": label + (", searched scales" if searched else ""),
                "stored_over_dense": round(stored / dense, 4),
                **cosines(student, data, reference_box[0]),
            }
        )
    return rows


reference_box: list = []
tokenizer_box: list = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=0.125)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget-seconds", type=float, default=None)
    parser.add_argument("--variants", nargs="+", default=["base"])
    parser.add_argument("--cache", default=os.environ.get("I46Q_CACHE", "/tmp/i46q_cache"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="a folder: save_tensorized each variant's student there")
    parser.add_argument(
        "--start",
        default=None,
        help="a file of (calibration, plan) made on this teacher (torch.save) to train from, not the cached start",
    )
    parser.add_argument("--num-modes", default=None, help="choose_formats' num_modes (e.g. 1: low-rank TT)")
    parser.add_argument("--ranks", default=None, help="choose_formats' ranks, comma-separated")
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help="choose_formats' candidate formats, comma-separated"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps is None and args.budget_seconds is None:
        parser.error("give --steps and/or --budget-seconds")
    begin = time.perf_counter()
    # the reference topics are tokenized only where a variant draws from them
    uses_reference = any("ref" in parse_variant(name) for name in args.variants)
    ns = argparse.Namespace(**{**RECIPE, "reference_fraction": 1.0 if uses_reference else 0.0})
    teacher, _, _, data, reference = cp.prepare(ns)
    reference_box.append(reference)
    if any("pkg" in parse_variant(name) for name in args.variants):
        tokenizer_box.append(cp.load_teacher(cp.minilm_dir() is None)[1])
    print(json.dumps({"prepared_seconds": round(time.perf_counter() - begin, 1), "load": common.loadavg()}), flush=True)
    starts = {}  # one per grid rounding (``clip``): the format choice measures the grids it would build
    for name in args.variants:
        if name == "baselines":
            for row in baselines(teacher, data):
                print(json.dumps({**row, "load": common.loadavg()}), flush=True)
            continue
        clip = parse_variant(name).get("clip", "1")
        with rounding(clip):
            if clip not in starts:
                t0 = time.perf_counter()
                options = {"formats": tuple(args.formats.split(","))}
                if args.num_modes is not None:
                    options["num_modes"] = int(args.num_modes)
                if args.ranks is not None:
                    options["ranks"] = tuple(int(r) for r in args.ranks.split(","))
                cache = Path(args.cache) if args.cache else None
                if args.start:
                    starts[clip] = torch.load(args.start, weights_only=False)
                else:
                    starts[clip] = start_of(teacher, data, args.budget, cache, options)
                print(json.dumps({"start_seconds": round(time.perf_counter() - t0, 1), "clip": clip}), flush=True)
            print(json.dumps(run_variant(name, teacher, data, starts[clip], args)), flush=True)


if __name__ == "__main__":
    main()
