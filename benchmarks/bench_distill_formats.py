"""Issue 46: choose_formats' time and choice on all-MiniLM-L6-v2, old (every candidate scored at the output) against
new (``fast=True``: estimates from one factorisation per layer, output scoring of a short-list only), at the same
byte budget; and the packed student's resident memory and encode latency against the fp32 teacher.

    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py choose --scoring all --layers 2
    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py choose --scoring fast
    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py serve --student s8.st --variants eager,compiled
    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py compress --budget-seconds 600
    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py kernels
    flock /tmp/timing.lock python benchmarks/bench_distill_formats.py breakdown --student s8.st --rows 1 --threads 1

Calibration: 32 batches of 32 stdlib docstrings cut to 64 tokens (as benchmarks/bench_distill.py); the output
scoring uses the first 2 of them. ``--layers n`` restricts the choice to the first n encoder layers (the old scoring
on all six takes about 9 minutes on 2 cores). Each run prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
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
from comera_fx.packed import cpu_kernel, packed_modules, set_compute_dtype_, workspace_bytes  # noqa: E402


def data(args):
    teacher, tokenizer, builder, name = cp.load_teacher(False)
    texts = cp.mine_stdlib(max_files=args.max_files)["train"]
    encoded = cp.tokenize_all(tokenizer, texts, max_length=64)
    draw = cp.batch_sampler(encoded, 32, seed=0, by_length=True)
    return teacher, builder, [draw() for _ in range(args.calibration_batches)], encoded


def encoder_config(layers: int | None, only: str | None = None) -> comera_fx.TensorizeConfig:
    """The encoder's linears, or those of its first ``layers`` layers, or those matching ``only`` (a regex)."""
    if only is None:
        only = (
            r"bert\.encoder\."
            if layers is None
            else rf"bert\.encoder\.layer\.(?:{'|'.join(map(str, range(layers)))})\."
        )
    return comera_fx.TensorizeConfig(skip=[rf"^(?!{only})"])


def choose(args) -> dict:
    teacher, _, batches, _ = data(args)
    config = encoder_config(args.layers, args.only)
    calibration = comera_fx.calibrate(teacher, batches, token_mask=cp.real_tokens, config=config)
    start = time.perf_counter()
    plan = comera_fx.choose_formats(
        teacher,
        calibration,
        args.budget,
        config=config,
        batches=batches[:2],
        score_all=args.scoring == "all",
        fast=args.scoring == "fast",
    )
    seconds = time.perf_counter() - start
    student = copy.deepcopy(teacher)
    comera_fx.apply_formats_(student, plan, calibration)
    built_error = exact_output_error(teacher, student, plan, batches[:2])
    with torch.no_grad():
        ref = torch.cat([teacher(**b) for b in batches[-4:]])
        out = torch.cat([student(**b) for b in batches[-4:]])
    cosine = float(torch.nn.functional.cosine_similarity(out, ref, dim=-1).mean())
    return {
        "scoring": args.scoring,
        "layers": args.only or args.layers or 6,
        "seconds": round(seconds, 1),
        "output_passes": plan.output_passes,
        "planned_error": plan.total_error,
        "built_output_error": built_error,
        "bytes": plan.total_bytes,
        "dense": plan.dense_bytes,
        "counts": plan.counts(),
        "formats": {k: c.label() for k, c in plan.choices.items()},
        "cosine_no_training_last4": round(cosine, 4),
        "loadavg": common.loadavg(),
    }


@torch.no_grad()
def exact_output_error(teacher, student, plan, batches) -> float:
    """The plan's error measured the old way on what apply_formats_ built: per layer, the relative squared change
    of the output with that layer alone replaced by its built weight, summed (what ``score_all`` sums)."""
    from comera_fx.pretrained.format_output import OutputError

    scorer = OutputError(teacher, batches, None)
    total = 0.0
    for fqn in plan.choices:
        path = plan.module_paths[fqn]
        built = student.get_submodule(path)
        weight = built.tt.dense().t() if hasattr(built, "tt") else built.weight
        total += scorer(teacher.get_submodule(path), weight.detach())
    return total


def rss() -> int:
    return common.proc_status("VmRSS")


def serve(args) -> dict:
    """Resident memory of the loaded models and encode latency at batch 1 and 64 (median of rotated repeats).
    ``--student PATH``: the 8x student's file, built (calibration + fast format choice, no training: the formats and
    bytes are what count here) and saved there on the first run, reused after."""
    teacher, builder, batches, encoded = data(args)
    path = Path(args.student) if args.student else None
    if path is None or not path.exists():
        config = encoder_config(None)
        calibration = comera_fx.calibrate(teacher, batches, token_mask=cp.real_tokens, config=config)
        plan = comera_fx.choose_formats(
            teacher, calibration, args.budget, config=config, batches=batches[:2], fast=True
        )
        student = copy.deepcopy(teacher)
        comera_fx.apply_formats_(student, plan, calibration)
    else:
        student = None
    return measure_serving(
        teacher, student, builder, batches[0], encoded, args.repeats, path=path, variants=args.variants, ao=args.torchao
    )


def torchao_int8(teacher, site: str):
    """A copy of ``teacher`` with torchao's int8 weight-only quantization on its encoder linears (torchao from
    ``site``, a --target install outside the project's environment)."""
    sys.path.insert(0, site)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(teacher)
    quantize_(
        model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "encoder" in fqn
    )
    return model


def autocast_bf16(model):
    """``model`` called under CPU autocast to bf16 (its GEMMs and attention in bf16): the teacher at the student's
    ``bf16`` precision, so that the bf16 student is compared with a bf16 teacher too."""

    def run(**inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**inputs).float()

    return run


def without_kernel(path, builder):
    """The student of ``path`` loaded and called with ``comera_fx.packed.cpu_kernel`` off: codes held row by row,
    weights rebuilt each call (the path before the kernel, and the one on CPUs without AVX2), for a comparison
    in the same run."""
    with kernel_off():
        model = comera_fx.load_tensorized(path, builder, pack=True).eval()

    def run(**inputs):
        with kernel_off():
            return model(**inputs)

    return run


@contextlib.contextmanager
def kernel_off():
    """``comera_fx.packed.cpu_kernel`` off inside: layers built here hold their codes row by row, calls rebuild."""
    cpu_kernel.USE_KERNEL = False
    try:
        yield
    finally:
        cpu_kernel.USE_KERNEL = True


def measure_serving(
    teacher, student, builder, batch, encoded, repeats: int, *, path=None, variants=("eager",), ao=None
) -> dict:
    """Save ``student`` (unless ``student`` is None and ``path`` holds it), load it packed
    (``load_tensorized(pack=True)``), and compare with the fp32 ``teacher``: bytes of the encoder linears stored /
    held, the process RSS the load added, latency at batch 1 and 64. ``variants``: "eager", "compiled"
    (``torch.compile`` of each whole model, timed after a warm-up call per shape), "layers" (the student with each
    packed layer compiled on its own, the rest eager), "rebuild" (the student without ``cpu_kernel``) and "bf16"
    (the student's packed layers multiplying in bf16, ``set_compute_dtype_``; the teacher under bf16 autocast);
    ``ao``: a torchao install to add its int8 weight-only teacher (eager, and compiled with "compiled")."""
    path = path or Path(os.environ.get("TMPDIR", "/tmp")) / "i46_student.safetensors"
    if student is not None:
        comera_fx.save_tensorized(student, path)
    del student
    gc.collect()
    before = rss()
    loaded = comera_fx.load_tensorized(path, builder, pack=True).eval()
    gc.collect()
    after_student = rss()
    stored = comera_fx.quantize.stored_bytes(  # the file's figure: the unpacked load counts codes as stored
        comera_fx.load_tensorized(path, builder), "bert.encoder."
    )
    gc.collect()
    fp32 = teacher.eval()
    teacher_bytes = sum(
        p.numel() * 4 for n, p in fp32.named_parameters() if n.startswith("bert.encoder.") and p.dim() >= 2
    )
    resident = sum(
        p.numel() * p.element_size()
        for n, p in loaded.named_parameters()
        if n.startswith("bert.encoder.") and p.dim() >= 2
    )
    resident += sum(m.nbytes() for p, m in packed_modules(loaded).items() if p.startswith("bert.encoder."))
    one = {k: v[:1] for k, v in batch.items()}
    big = {k: v[:64] for k, v in cp.batch_sampler(encoded, 64, seed=1, by_length=True)().items()}
    models = {"teacher": fp32, "student": loaded}
    if ao:
        models["torchao int8wo"] = torchao_int8(fp32, ao)
    columns, compile_seconds = {}, {}
    eager_workspace = None  # the shared buffer after the student's eager calls (when "eager" is a variant)
    with torch.inference_mode():
        ref = {b: fp32(**inputs) for b, inputs in (("b1", one), ("b64", big))}
        cosine = {}
        for name, model in list(models.items()):
            runs = {"eager": model}
            if "compiled" in variants:
                runs["compiled"] = torch.compile(model, dynamic=False)
            if "bf16" in variants:  # the student's packed GEMMs in bf16; the teacher's linears under autocast
                runs["bf16"] = copy.deepcopy(model) if name == "student" else autocast_bf16(model)
                if name == "student":
                    set_compute_dtype_(runs["bf16"], torch.bfloat16)
            if "rebuild" in variants and name == "student":  # without cpu_kernel: the weights rebuilt each call
                runs["rebuild"] = without_kernel(path, builder)
            if "layers" in variants and name == "student":
                runs["layers"] = copy.deepcopy(model)
                for module in packed_modules(runs["layers"]).values():
                    module.compile(dynamic=False)
            for kind, run in runs.items():
                if kind not in variants:
                    continue
                for b, inputs in (("b1", one), ("b64", big)):
                    start = time.perf_counter()
                    out = run(**inputs)
                    if kind != "eager":
                        compile_seconds[f"{name} {b}"] = round(time.perf_counter() - start, 1)
                    key = f"{name} {kind} {b}"
                    cosine[key] = round(float(torch.nn.functional.cosine_similarity(out, ref[b], dim=-1).min()), 4)
                    columns[key] = lambda run=run, inputs=inputs: run(**inputs)
                if name == "student" and kind == "eager":  # before the other paths grow the shared buffer
                    eager_workspace = workspace_bytes()
        times = common.time_rotated(columns, repeats=repeats, inner=1)
    ms = {k: round(v * 1e3, 2) for k, v in times.items()}
    return {
        "stored_encoder_bytes": stored,
        "resident_encoder_bytes": resident,
        "teacher_encoder_bytes": teacher_bytes,
        "resident_over_stored": round(resident / stored, 3),
        "rss_delta_load_student": after_student - before,
        # the shared fp32 buffer per thread (workspace.py) after the loaded student's eager calls, and after every
        # path of the run (the rebuild path without the kernel, bf16: they rebuild whole weights into it)
        "workspace_bytes": eager_workspace,
        "resident_with_workspace_over_stored": None
        if eager_workspace is None
        else round((resident + eager_workspace) / stored, 3),
        "workspace_bytes_after_all_paths": workspace_bytes(),
        "packed_layers": len(packed_modules(loaded)),
        "packed_tt_layers": sum(hasattr(m, "layout") for m in packed_modules(loaded).values()),
        "latency_ms": ms,
        "over_teacher_eager": {k: round(v / ms[f"teacher eager {k.rsplit(' ', 1)[1]}"], 3) for k, v in ms.items()},
        "min_cosine_to_teacher": cosine,
        "compile_seconds": compile_seconds,
        "b64_shape": list(big["input_ids"].shape),
        "b1_shape": list(one["input_ids"].shape),
        "threads": torch.get_num_threads(),
        "loadavg": common.loadavg(),
    }


def one_call(args) -> dict:
    """compress_ on the README recipe's data (examples/compress_pretrained.py defaults), scored as there."""
    from comera_fx.pretrained import DistillConfig, compress_

    ns = argparse.Namespace(**common.COMPRESS_RECIPE)
    teacher, builder, _, prepared, reference = cp.prepare(ns)
    student = copy.deepcopy(teacher)
    cp.freeze_word_embedding(student, ns)
    config = DistillConfig(loss_fn=cp.distill_loss, progress=False)
    summary = compress_(
        student,
        teacher,
        cp.training_sampler(prepared, ns, seed=0),
        byte_budget=args.budget,
        budget_seconds=args.budget_seconds,
        config=config,
        tensorize_config=comera_fx.TensorizeConfig(skip=[r"^(?!bert\.encoder\.)"]),
    )
    print(summary, flush=True)
    scores = cp.evaluate(student.eval(), prepared, reference)
    result = {
        "budget_seconds": args.budget_seconds,
        "byte_budget": args.budget,
        "steps": summary.steps,
        "stored_over_dense": summary.stored_bytes / summary.dense_bytes,
        "resident_over_stored": summary.resident_bytes / summary.stored_bytes,
        "seconds": {k: round(v, 1) for k, v in summary.seconds.items()},
        "counts": summary.plan.counts(),
        **{k: round(v, 4) for k, v in scores.items()},
        "loadavg": common.loadavg(),
    }
    print(json.dumps(result), flush=True)  # before the serving figures, which may fail on their own
    try:
        result["serving"] = measure_serving(
            teacher, student, builder, cp.training_sampler(prepared, ns, seed=1)(), prepared["train_enc"], args.repeats
        )
    except Exception as exc:  # noqa: BLE001  (a benchmark: report and keep the quality figures)
        result["serving_error"] = repr(exc)
    return result


@torch.no_grad()
def kernels(args) -> dict:
    """One 384 -> 1536 linear (MiniLM's FFN-in): fp32 GEMM against torch's CPU int kernels (fp32 activations) and
    against PackedLinear, with ``cpu_kernel`` where this CPU runs it (codes read inside the product) and without
    it ("rebuild": codes unpacked per call, then the fp32 GEMM), at --rows token counts, in inference mode;
    median ms."""
    from comera_fx.packed import PackedLinear
    from comera_fx.quantize import QuantSpec, quantize_groups

    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536)
    result = {}
    for rows in args.rows:
        x = torch.randn(rows, 384)
        columns = {"fp32": lambda: linear(x)}
        codes, _ = quantize_groups(linear.weight.detach(), QuantSpec(8, None))
        row_scale = linear.weight.detach().abs().amax(1) / 127
        columns["aten int8 per channel"] = lambda: torch.ops.aten._weight_int8pack_mm(
            x, codes.reshape(1536, 384), row_scale
        )
        nibbles = torch.randint(0, 16, (1536, 384), dtype=torch.int32)
        tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        scale_zeros = torch.stack([torch.rand(3, 1536), torch.zeros(3, 1536)], -1)
        columns["aten int4 g128"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiled, 128, scale_zeros)
        for bits, group in ((8, None), (4, 128)):
            packed = PackedLinear.from_linear(linear, QuantSpec(bits, group))
            with kernel_off():
                rebuilt = PackedLinear.from_linear(linear, QuantSpec(bits, group))  # held row by row, no kernel
            columns[f"PackedLinear int{bits} g{group}"] = lambda packed=packed: packed(x)
            columns[f"PackedLinear int{bits} g{group} rebuild"] = lambda rebuilt=rebuilt: rebuilt_call(rebuilt, x)
        with torch.inference_mode():
            times = common.time_rotated(columns, repeats=args.repeats, inner=1)
        result[rows] = {k: round(v * 1e3, 3) for k, v in times.items()}
    return {
        "ms": result,
        "kernel": cpu_kernel.library() is not None,
        "threads": torch.get_num_threads(),
        "loadavg": common.loadavg(),
    }


def rebuilt_call(module, x):
    with kernel_off():
        return module(x)


def layer_kind(module) -> str | None:
    """A packed encoder linear's kind ("TT 384x384", "int4 g128 384x1536"), None for other modules."""
    from comera_fx.packed import PackedLinear, PackedTTLinear

    if isinstance(module, PackedTTLinear):
        return f"TT {module.in_features}x{module.out_features}"
    if isinstance(module, PackedLinear):
        return f"int{module.spec.bits} g{module.spec.group_size} {module.in_features}x{module.out_features}"
    return None


def time_by_kind(model, kinds: dict[str, str], inputs, calls: int) -> tuple[float, dict[str, float]]:
    """(median ms of a whole call without hooks, {kind: ms a call spent in the modules at ``kinds``' paths, timed
    by forward pre/post hooks})."""
    for _ in range(3):
        model(**inputs)
    whole = []
    for _ in range(calls):
        start = time.perf_counter()
        model(**inputs)
        whole.append(time.perf_counter() - start)
    spent, hooks = dict.fromkeys(kinds.values(), 0.0), []
    for path, kind in kinds.items():
        module = model.get_submodule(path)

        def pre(m, args):
            m._bench_start = time.perf_counter()

        def post(m, args, out, kind=kind):
            spent[kind] += time.perf_counter() - m._bench_start

        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for _ in range(calls):
        model(**inputs)
    for hook in hooks:
        hook.remove()
    return sorted(whole)[calls // 2] * 1e3, {k: round(v / calls * 1e3, 3) for k, v in spent.items()}


@torch.inference_mode()
def breakdown(args) -> dict:
    """Where the packed student's time goes against the teacher's, one batch size (--rows 1 or 64), warm (no other
    model runs between calls): ms a call in each kind of packed layer and in the teacher's linears at the same
    paths, and the median whole call of each (without hooks)."""
    teacher, builder, batches, encoded = data(args)
    student = comera_fx.load_tensorized(args.student, builder, pack=True).eval()
    teacher.eval()
    rows = args.rows[0]
    if rows == 1:
        inputs = {k: v[:1] for k, v in batches[0].items()}
    else:
        inputs = {k: v[:rows] for k, v in cp.batch_sampler(encoded, rows, seed=1, by_length=True)().items()}
    kinds = {p: layer_kind(m) for p, m in packed_modules(student).items() if p.startswith("bert.encoder.")}
    calls = 30 if rows == 1 else 6
    teacher_ms, teacher_kinds = time_by_kind(teacher, kinds, inputs, calls)
    student_ms, student_kinds = time_by_kind(student, kinds, inputs, calls)
    return {
        "shape": list(inputs["input_ids"].shape),
        "whole_ms": {"teacher": round(teacher_ms, 2), "student": round(student_ms, 2)},
        "layers": {
            k: {"count": list(kinds.values()).count(k), "teacher": teacher_kinds[k], "student": v}
            for k, v in sorted(student_kinds.items())
        },
        "threads": torch.get_num_threads(),
        "loadavg": common.loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["choose", "serve", "compress", "kernels", "breakdown"])
    parser.add_argument("--budget-seconds", type=float, default=600.0)
    parser.add_argument("--scoring", choices=["all", "shortlist", "fast"], default="fast")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--only", default=None, help="a regex: only these linears (a slice the old scoring can time)")
    parser.add_argument("--budget", type=float, default=0.125)
    parser.add_argument("--calibration-batches", type=int, default=32)
    parser.add_argument("--max-files", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[8, 2048], help="kernels: token counts; breakdown: the batch size"
    )
    parser.add_argument(
        "--student",
        default=None,
        help="serve: the student's file (built and saved if absent); breakdown: the saved student",
    )
    parser.add_argument(
        "--variants", default="eager", help="serve: eager, compiled, layers, rebuild, bf16 (comma-separated)"
    )
    parser.add_argument("--torchao", default=None, help="serve: a torchao --target install to compare with")
    args = parser.parse_args()
    args.variants = tuple(args.variants.split(","))
    torch.set_num_threads(args.threads)
    result = {"choose": choose, "serve": serve, "compress": one_call, "kernels": kernels, "breakdown": breakdown}[
        args.what
    ](args)
    print(json.dumps({"argv": sys.argv[1:], **result}))


if __name__ == "__main__":
    main()
