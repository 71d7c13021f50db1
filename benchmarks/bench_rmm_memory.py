"""Peak training memory of the CoMERA 6-encoder classifier: dense, TT, TT + RMM, and PyTorch's recomputation options.

Model: Hugging Face ``BertForSequenceClassification`` built from a config, as a new user would (6 encoder layers,
d 768, ff 3072, 12 heads, vocabulary 30522, 512 positions, 2 labels, dropout 0.1, train mode; no download), on
random token ids of length 128 (``--seq``), AdamW (lr 1e-4), 3 steps (``--steps``). Each configuration runs in its
own subprocess; its figure is the peak RSS of the training steps (VmHWM, reset through /proc/self/clear_refs just
before them) above the RSS just before them, so the optimizer state created at the first step counts, model
construction and ``tensorize_`` do not.

Configurations (``--configs``, comma-separated; default all):

* ``dense``             — the model as built;
* ``tt_enc``            — ``tensorize_(max_rank=30)`` of the encoder linears (``init="random"``, module scan), dense
                          embeddings;
* ``tt_all``            — encoder linears and the word embedding in TT;
* ``tt_all_rmm0.5`` (and any ρ: ``tt_all_rmm0.25``, ``tt_all_rmm0.1``) — ``tt_all`` + ``randomize_backward_(ρ)``
                          (module scan: every TTLinear and the pooler; the 768×2 classifier is under min_numel);
* ``tt_all_ckpt``       — ``tt_all`` + ``torch.utils.checkpoint`` per encoder layer (non-reentrant, through
                          ``model.gradient_checkpointing_enable``);
* ``tt_all_rmm0.25_ckpt`` — both;
* ``tt_all_compiled``, ``tt_all_rmm0.25_compiled``, ``..._budget0.5`` — under
  ``torch.compile(backend=comera_fx.make_backend())`` (Inductor, min-cut partitioner), with
  ``torch._functorch.config.activation_memory_budget`` patched to the given value during the compile;
* ``..._mincut``, ``..._mincut_budget0.1`` — the same partitioner without Inductor: ``torch.compile(backend=
  "aot_eager_decomp_partition")`` (compiles in seconds, not minutes; ``comera_fx.make_backend(inductor=False)``
  uses AOTAutograd's default partitioner, where the budget does nothing). A compiled
  configuration first runs one forward + backward (no optimizer step; gradients dropped) to compile, then resets the
  peak: its "RSS before" therefore also holds what the compile and that step left allocated.

After the timed steps each child also runs one forward under ``saved_tensors_hooks`` and reports the bytes saved for
backward (unique storages, parameters apart), grouped by the autograd node that saved them.

Usage::

    python benchmarks/bench_rmm_memory.py --batches 1,8 --json out.json
    python benchmarks/bench_rmm_memory.py --configs dense,tt_all,tt_all_rmm0.25 --batches 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402  (benchmarks/ is this script's sys.path[0])

common.use_this_checkout()  # this checkout's comera_fx, not an installed copy
from common import (
    comera_randomize_backward_,
    loadavg,
    proc_status,
    reset_peak_rss,
    rmm_missing,  # noqa: E402
    saved_bytes_by_op,
    write_record,
)

# The Inductor-compiled variants (``..._compiled``) are opt-in: their compile took > 15 min on the loaded 2-core
# machine (RESULTS.md, RMM section).
DEFAULT_CONFIGS = (
    "dense",
    "tt_enc",
    "tt_all",
    "tt_all_rmm0.5",
    "tt_all_rmm0.25",
    "tt_all_rmm0.1",
    "tt_all_ckpt",
    "tt_all_rmm0.25_ckpt",
    "tt_all_rmm0.1_ckpt",
    "tt_all_rmm0.25_mincut",
    "tt_all_rmm0.25_mincut_budget0.5",
    "tt_all_rmm0.25_mincut_budget0.1",
)
CONFIG_RE = re.compile(r"^(dense|tt_enc|tt_all)(?:_rmm([0-9.]+))?(_ckpt)?(_compiled|_mincut)?(?:_budget([0-9.]+))?$")


def parse_config(name: str) -> dict:
    m = CONFIG_RE.match(name)
    if not m:
        raise SystemExit(
            f"unknown configuration {name!r}: base dense|tt_enc|tt_all, then optional _rmm<rho>, "
            "_ckpt, _compiled or _mincut, _budget<fraction> (budget needs one of those)"
        )
    base, rho, ckpt, compiled, budget = m.groups()
    if budget and not compiled:
        raise SystemExit(f"{name}: _budget needs _compiled or _mincut (the budget acts in AOTAutograd's partitioner)")
    return {
        "base": base,
        "rho": float(rho) if rho else None,
        "ckpt": bool(ckpt),
        "compiled": compiled,
        "budget": float(budget) if budget else None,
    }


def build_model(seq: int, layers: int = 6):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        num_labels=2,
    )
    # Set what the model's first call would: Hugging Face writes problem_type into the config then, and under
    # torch.compile that write fails a guard and recompiles inside the measured steps.
    config.problem_type = "single_label_classification"
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def tensorize(model, base: str, ids) -> object:
    import comera_fx

    if base == "tt_enc":
        keep = lambda m, fqn: isinstance(m, nn.Linear) and ".encoder." in f".{fqn}."  # noqa: E731
    else:
        keep = lambda m, fqn: (  # noqa: E731
            (isinstance(m, nn.Linear) and ".encoder." in f".{fqn}.") or fqn.endswith("word_embeddings")
        )
    # A module scan (no example inputs): this model has no functional weight use, and a Dynamo capture of it
    # costs a minute per configuration on a loaded 2-core machine.
    return comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=30, init="random", seed=0), filter_fn=keep)


def child(opts) -> dict:
    import resource

    limit = int(opts.max_gib * 2**30)  # a runaway configuration fails alone instead of starting the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(opts.threads)
    cfg = parse_config(opts.child)
    model = build_model(opts.seq, opts.layers)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30522, (opts.batch, opts.seq), generator=gen)
    labels = torch.randint(0, 2, (opts.batch,), generator=gen)
    info: dict = {}
    t0 = time.perf_counter()
    if cfg["base"] != "dense":
        summary = tensorize(model, cfg["base"], ids)
        info["converted"] = [d.fqn for d in summary.converted]
    if cfg["rho"] is not None:
        why = rmm_missing()
        if why:
            return {"name": opts.child, "skipped": why}
        summary = comera_randomize_backward_(model, rho=cfg["rho"], sketch=opts.sketch)  # module scan, as above
        info["rmm_summary"] = str(summary)[:2000]
    if cfg["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    info["setup_seconds"] = time.perf_counter() - t0
    torch._dynamo.reset()  # tensorize_ / randomize_backward_ captured the model with Dynamo under no_grad
    step_model = model
    if cfg["budget"] is not None:  # read when AOTAutograd partitions (first call, and any recompile): set for good
        torch._functorch.config.activation_memory_budget = cfg["budget"]
    if cfg["compiled"] == "_compiled":
        import comera_fx

        torch._inductor.config.force_disable_caches = True
        step_model = torch.compile(model, backend=comera_fx.make_backend())
    elif cfg["compiled"] == "_mincut":  # AOTAutograd's min-cut partitioner, graphs run eagerly (no Inductor)
        step_model = torch.compile(model, backend="aot_eager_decomp_partition")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_of(m):
        return m(input_ids=ids, labels=labels).loss

    if cfg["compiled"]:  # compile fw + bw outside the measured steps
        t0 = time.perf_counter()
        loss_of(step_model).backward()
        model.zero_grad(set_to_none=True)
        info["compile_seconds"] = time.perf_counter() - t0
    rss_before = proc_status("VmRSS")
    reset_ok = reset_peak_rss()
    load_start = loadavg()
    t0 = time.perf_counter()
    losses, per_step = [], []
    for _ in range(opts.steps):
        loss = loss_of(step_model)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        per_step.append((proc_status("VmHWM") - rss_before, proc_status("VmRSS") - rss_before))
    step_seconds = (time.perf_counter() - t0) / opts.steps
    peak = proc_status("VmHWM")
    load_end = loadavg()
    params = list(model.parameters())
    state = sum(p.numel() * p.element_size() * 2 for p in params)  # parameters + gradients
    state += sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    optimizer.zero_grad(set_to_none=True)
    saved = saved_bytes_by_op(lambda: loss_of(step_model), params, attribute=not cfg["compiled"])
    return {
        "name": opts.child,
        "batch": opts.batch,
        "rss_before": rss_before,
        "peak": peak if reset_ok else None,
        "peak_above_before": (peak - rss_before) if reset_ok else None,
        "state_bytes": state,
        "params": sum(p.numel() for p in params),
        "losses": losses,
        "per_step_hwm_rss": per_step,
        "step_seconds": step_seconds,
        "load_start": load_start,
        "load_end": load_end,
        "saved": saved,
        **info,
    }


def spawn(name: str, batch: int, opts) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--child-out",
            str(out),
            "--batch",
            str(batch),
            "--seq",
            str(opts.seq),
            "--steps",
            str(opts.steps),
            "--layers",
            str(opts.layers),
            "--threads",
            str(opts.threads),
            "--sketch",
            opts.sketch,
            "--max-gib",
            str(opts.max_gib),
        ]
        started = time.perf_counter()
        try:
            env = {**os.environ, **dict(kv.split("=", 1) for kv in opts.child_env)}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.child_timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"name": name, "batch": batch, "skipped": f"took over {opts.child_timeout:.0f} s (killed)"}
        if proc.returncode != 0 or not out.exists():
            return {
                "name": name,
                "batch": batch,
                "skipped": f"exit code {proc.returncode}: {proc.stderr[-1500:].strip()}",
            }
        result = json.loads(out.read_text())
        result["process_seconds"] = time.perf_counter() - started
        return result


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def report(results: list[dict]) -> str:
    lines = [
        "| configuration | batch | peak above RSS before (MiB) | saved for backward (MiB) | params+grads+AdamW "
        "(MiB) | s/step | load start → end |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['name']} | {r['batch']} | skipped: {r['skipped'][:300]} | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['batch']} | {mib(r['peak_above_before'])} | {mib(r['saved']['total'])} | "
            f"{mib(r['state_bytes'])} | {r['step_seconds']:.2f} | {r['load_start']} → {r['load_end']} |"
        )
    for r in results:
        if "skipped" in r:
            continue
        lines.append(
            f"\nSaved for backward, {r['name']}, batch {r['batch']} (MiB; parameters saved: "
            f"{mib(r['saved']['params'])}):\n"
        )
        for name, nbytes in sorted(r["saved"]["by_op"].items(), key=lambda kv: -kv[1]):
            if nbytes >= 2**19:
                lines.append(f"- {name}: {nbytes / 2**20:.1f}")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6, help="encoder layers (6: the CoMERA configuration)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sketch", default="gaussian")
    ap.add_argument("--max-gib", type=float, default=8.0, help="address-space limit of each configuration's process")
    ap.add_argument(
        "--child-timeout",
        type=float,
        default=900.0,
        help="seconds before a configuration's process is killed (compiled ones compile first)",
    )
    ap.add_argument(
        "--child-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the configurations' processes, e.g. MALLOC_TRIM_THRESHOLD_=0 (glibc "
        "returns freed heap memory at once; repeatable)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts.child:
        Path(opts.child_out).write_text(json.dumps(child(opts)))
        return
    names = [n.strip() for n in opts.configs.split(",") if n.strip()]
    for n in names:
        parse_config(n)
    batches = [int(b) for b in opts.batches.split(",")]
    import comera_fx

    print(
        f"{datetime.now():%Y-%m-%d %H:%M:%S} load {loadavg()} torch {torch.__version__} comera_fx "
        f"{Path(comera_fx.__file__).parent} child env {opts.child_env} configs {names} "
        f"batches {batches}",
        flush=True,
    )
    results = []
    for batch in batches:
        for name in names:
            r = spawn(name, batch, opts)
            results.append(r)
            msg = r.get("skipped") or (
                f"peak {mib(r['peak_above_before'])} MiB, saved {mib(r['saved']['total'])} "
                f"MiB, {r['step_seconds']:.2f} s/step, load {r['load_end']}"
            )
            print(f"{datetime.now():%H:%M:%S} {name} batch {batch}: {msg[:400]}", flush=True)
            if opts.json:
                write_record(opts.json, results=results)
    print(report(results))


if __name__ == "__main__":
    main()
