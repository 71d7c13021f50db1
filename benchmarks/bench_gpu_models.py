"""Issue 44 item 6: a model-level training step on a GPU at the seed's scale, dense against TT, in one table.

Two models at 16 384 tokens per step, bf16 autocast, AdamW: CoMERA's six-encoder classifier (d 768, ff 3072,
30522-word vocabulary, 128 sequences of 128 tokens; every encoder linear, fc1 and the word embedding in TT form at
``--rank``) and a GPT-2-small-like causal LM (12 pre-LN blocks, d 768, ff 3072, byte vocabulary, 64 sequences of
256 tokens; every block linear in TT form). Each is trained compiled four ways: dense under stock ``torch.compile``
(default mode and ``reduce-overhead``: its best is the baseline), TT under ``comera_fx.backend`` (default, and with
Inductor's CUDA graphs, the backend's ``reduce-overhead``). Then one TT linear at 4096² rank 32 against
``nn.Linear`` at 16 384 tokens, forward + backward, both compiled. Per row: ms per step, steps/s, peak memory and
the ratio to the dense baseline; a configuration that fails records its error and the table goes on. Prepared so
one call on an H200 fits in about six minutes (``--budget-seconds`` skips what would not fit).

    python benchmarks/bench_gpu_models.py                                   # on a GPU: the table, JSON with --out
    python benchmarks/bench_gpu_models.py --device cpu --smoke --no-inductor   # a CPU smoke run (tiny shapes)
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
from pathlib import Path

import common  # benchmarks/common.py: this checkout first on sys.path

common.use_this_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import comera_fx  # noqa: E402
from bench_backend import ComeraClassifier  # noqa: E402
from bench_recompile import VOCAB, CausalLM  # noqa: E402
from comera_fx.backend import make_backend  # noqa: E402


def comera_case(smoke: bool, device):
    """(dense model, inputs, loss of (model, *inputs), filter of the weights to tensorize)."""
    d, ff, vocab, layers, batch, seq = (32, 64, 1000, 2, 2, 16) if smoke else (768, 3072, 30522, 6, 128, 128)
    torch.manual_seed(0)
    model = ComeraClassifier(vocab, d, 4 if smoke else 12, ff, layers).to(device)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    seg = (torch.arange(seq, device=device) >= seq // 2).long().expand(batch, -1).contiguous()
    labels = torch.randint(0, 3, (batch,), device=device)

    def loss(m, ids, seg, labels):
        return F.cross_entropy(m(ids, seg).float(), labels)

    def all_tt(module, fqn):  # the encoders' linears, fc1 and the word embedding, as CoMERA's all-TT model
        return (isinstance(module, nn.Linear) and fqn != "fc2") or fqn == "word_emb"

    return model, (ids, seg, labels), loss, all_tt


def lm_case(smoke: bool, device):
    d, ff, layers, heads, batch, seq = (32, 64, 2, 4, 2, 16) if smoke else (768, 3072, 12, 12, 64, 256)
    torch.manual_seed(0)
    model = CausalLM(layers, d, heads, ff, seq).to(device)
    data = torch.randint(0, VOCAB, (batch, seq + 1), device=device)

    def loss(m, x, y):
        return F.cross_entropy(m(x).float().reshape(-1, VOCAB), y.reshape(-1))

    return model, (data[:, :-1], data[:, 1:]), loss, (lambda module, fqn: isinstance(module, nn.Linear))


def train_step(model, loss, inputs, graphs: bool, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)  # None: CUDA graphs own the gradients' memory between replays
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = loss(model, *inputs)
        out.backward()
        optimizer.step()

    return step


def compiled(model, tt: bool, graphs: bool, inductor: bool):
    if not tt:
        return torch.compile(
            model,
            backend="inductor" if inductor else "aot_eager",
            mode="reduce-overhead" if graphs and inductor else None,
        )
    options = {"triton.cudagraphs": True} if graphs else {}
    return torch.compile(model, backend=make_backend(inductor=inductor, inductor_options=options))


def peak_mib(step, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


def model_rows(name, case, args, device, deadline) -> list[dict]:
    dense, inputs, loss, filter_fn = case(args.smoke, device)
    tt_model = copy.deepcopy(dense)
    small = {"min_numel": 1024, "min_dim": 16} if args.smoke else {}  # the smoke run's layers are tiny
    summary = comera_fx.tensorize_(
        tt_model, comera_fx.TensorizeConfig(max_rank=args.rank, init="random", seed=0, **small), filter_fn=filter_fn
    )
    if not summary.converted:
        raise SystemExit(f"{name}: nothing was tensorized; the TT rows would time the dense model")
    print(f"{name}: {len(summary.converted)} weights in TT form", flush=True)
    rows = []
    for tt, graphs in ((False, False), (False, True), (True, False), (True, True)):
        if graphs and device.type != "cuda":
            continue
        label = f"{name}: {'TT' if tt else 'dense'} compiled{' + CUDA graphs' if graphs else ''}"
        row = {"row": label}
        rows.append(row)
        if time.perf_counter() > deadline:
            row["error"] = "skipped: --budget-seconds spent"
            continue
        torch._dynamo.reset()
        model = copy.deepcopy(tt_model if tt else dense)
        try:
            start = time.perf_counter()
            step = train_step(compiled(model, tt, graphs, not args.no_inductor), loss, inputs, graphs, device)
            step()
            step()
            common.synced(lambda: None, device)()
            row["compile s"] = round(time.perf_counter() - start, 1)
            seconds = common.time_rotated({"step": common.synced(step, device)}, repeats=args.rounds, inner=args.inner)[
                "step"
            ]
            row.update(
                {
                    "ms/step": round(1e3 * seconds, 2),
                    "steps/s": round(1 / seconds, 2),
                    "peak MiB": peak_mib(step, device),
                }
            )
        except Exception as exc:  # record and go on: which configurations run at all is part of the answer
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        print(row, flush=True)
    dense_ms = [r["ms/step"] for r in rows if "ms/step" in r and ": dense" in r["row"]]
    for row in rows:
        if dense_ms and "ms/step" in row:
            row["× dense best"] = round(min(dense_ms) / row["ms/step"], 2)
    return rows


def layer_rows(args, device) -> list[dict]:
    size, tokens = (64, 256) if args.smoke else (4096, 16384)
    torch.manual_seed(0)
    dense = nn.Linear(size, size, bias=False).to(device, torch.bfloat16)
    tt = comera_fx.TTLinear.from_dense(nn.Linear(size, size, bias=False), max_rank=32, init="random").to(
        device, torch.bfloat16
    )
    x = torch.randn(tokens, size, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, size, device=device, dtype=torch.bfloat16)
    backend = "inductor" if not args.no_inductor else "aot_eager"
    rows = []
    for tag, layer in (("dense", dense), ("TT r 32", tt)):
        fn = torch.compile(layer, backend=backend)
        columns = {"fwd+bwd": lambda fn=fn: fn(x).backward(grad)}
        seconds = common.time_rotated(
            {k: common.synced(v, device) for k, v in columns.items()}, repeats=args.rounds, inner=args.inner
        )["fwd+bwd"]
        rows.append({"row": f"layer {size}² at {tokens} tokens: {tag} compiled", "ms/step": round(1e3 * seconds, 3)})
    rows[1]["× dense best"] = round(rows[0]["ms/step"] / rows[1]["ms/step"], 2)
    return rows


def table(rows) -> str:
    cols = ["row", "compile s", "ms/step", "steps/s", "peak MiB", "× dense best", "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rank", type=int, default=32, help="TT max rank of the models (CoMERA's paper: 30)")
    ap.add_argument("--models", nargs="+", default=["comera", "lm"], choices=["comera", "lm"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--budget-seconds", type=float, default=330, help="configurations past this are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check that the script runs)")
    ap.add_argument("--no-inductor", action="store_true", help="aot_eager instead of Inductor (fast smoke)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    deadline = time.perf_counter() + args.budget_seconds
    rows = layer_rows(args, device)
    cases = {"comera": comera_case, "lm": lm_case}
    for name in args.models:
        rows += model_rows(name, cases[name], args, device, deadline)
    print(common.run_header())
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": common.run_header(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
