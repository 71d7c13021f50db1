"""Tensorize a GPT-2-style language model and show what comera_fx did.

Runs offline in about a minute on 2 CPU cores: the model is built from a ``transformers`` config with random init
(no weights are downloaded) and the token ids come from the Python standard library's own source.

    python examples/tensorize_report.py [--layers 2] [--width 256] [--max-rank 32]

It prints the finder's decisions (GPT-2's Conv1D layers are ``addmm`` with the weight as an operand; the token
embedding is tied to the output head and stays tied), the per-layer report, a full-rank exactness check and the
eager step time of the dense and the tensorized model on the same batch.
"""

from __future__ import annotations

import argparse
import copy
import sysconfig
import time
from pathlib import Path

import torch

import comera_fx


def stdlib_token_ids(vocab_size: int, batch: int, seq: int) -> torch.Tensor:
    """Bytes of a few stdlib modules, mapped into the vocabulary: real code text, nothing downloaded."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / name).read_bytes() for name in ("functools.py", "textwrap.py", "heapq.py"))
    ids = torch.tensor(list(text[: batch * seq]), dtype=torch.long) % vocab_size
    return ids.reshape(batch, seq)


def build_model(layers: int, width: int, vocab_size: int = 50257):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=max(1, width // 64),
        n_positions=256,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def train_step_seconds(model, ids: torch.Tensor, repeats: int = 3) -> float:
    """Median time of one forward + backward of the LM loss (eager)."""
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--max-rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    print("== 1. Full rank is exact (float64): TT-SVD with max_rank=10**9 reproduces the dense logits")
    small = build_model(1, 128, vocab_size=1009).double()  # a prime vocabulary: padded, and still exact
    small_ids = stdlib_token_ids(small.config.vocab_size, 1, 64)
    exact = copy.deepcopy(small)
    comera_fx.tensorize_(exact, comera_fx.TensorizeConfig(max_rank=10**9), example_inputs={"input_ids": small_ids})
    with torch.no_grad():
        ref = small(input_ids=small_ids).logits
        err = (exact(input_ids=small_ids).logits - ref).norm() / ref.norm()
    print(
        f"   1-layer GPT-2, vocabulary 1009 (prime, padded to {exact.transformer.wte.tt.layout.padded_rows}): "
        f"relative error of the logits {err:.2e}\n"
    )

    dense = build_model(args.layers, args.width)
    ids = stdlib_token_ids(dense.config.vocab_size, args.batch, args.seq)

    print(f"== 2. Default compression (max_rank={args.max_rank}), found through a Dynamo graph")
    tt_model = copy.deepcopy(dense)
    summary = comera_fx.tensorize_(
        tt_model, comera_fx.TensorizeConfig(max_rank=args.max_rank), example_inputs={"input_ids": ids[:1]}
    )
    print(summary, "\n")
    print(comera_fx.report(tt_model), "\n")
    assert tt_model.transformer.wte.tt is tt_model.lm_head.tt, "tied embedding and head must share one TT matrix"

    print("== 3. Eager training step (forward + backward of the LM loss), same batch")
    t_dense = train_step_seconds(dense, ids)
    t_tt = train_step_seconds(tt_model, ids)
    print(
        f"   dense {t_dense * 1e3:.0f} ms, comera_fx {t_tt * 1e3:.0f} ms, speed-up {t_dense / t_tt:.2f}x "
        f"(batch {args.batch} x {args.seq} tokens; random init is not low rank, so the loss differs)"
    )


if __name__ == "__main__":
    main()
