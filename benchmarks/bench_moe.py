"""Mixture-of-experts in TT form: parameters, training step time and loss of a small MoE language model.

Three variants of one random-init ``MixtralForCausalLM`` (transformers; same init, same data, same steps):

* ``dense``: the model as built (experts through transformers' eager loop, the same loop ``TTExperts`` runs);
* ``per-expert TT``: ``tensorize_`` on the experts only (``max_rank``), each expert its own TT matrix;
* ``shared TT``: ``SharedTTExpertBank`` (one TT chain per projection over all experts, one per-expert core) at the
  largest rank cap whose expert parameters do not exceed the per-expert form's — equal parameters.

Attention, router, embeddings and head stay dense in all three, so the comparison is about the experts. The data
is a fixed random bigram language (each token has a few likely successors), so the loss can fall. The loss
reported is on held-out sequences after the last step. Step times are medians over the steps after the first
(warm-up). Run under ``flock /tmp/timing.lock`` on a shared machine.

    python benchmarks/bench_moe.py [--steps 60] [--max-rank 8] [--experts 4] [--hidden 64] [--ffn 128]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def build(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(args.seed)
    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
    )
    model = MixtralForCausalLM(config)
    model.config._experts_implementation = "eager"
    return model


def bigram_batches(args, count: int, seed: int):
    """Sequences from one fixed random bigram table (``args.seed``): each token has 4 likely successors."""
    table_gen = torch.Generator().manual_seed(args.seed)
    logits = torch.randn(args.vocab, args.vocab, generator=table_gen) * 0.5
    top = torch.randint(0, args.vocab, (args.vocab, 4), generator=table_gen)
    logits.scatter_(1, top, 4.0)
    probs = logits.softmax(-1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = [torch.randint(0, args.vocab, (args.batch,), generator=gen)]
        for _ in range(args.seq - 1):
            seq.append(torch.multinomial(probs[seq[-1]], 1, generator=gen)[:, 0])
        out.append(torch.stack(seq, 1))
    return out


def expert_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def experts_only(max_rank: int):
    import comera_fx

    return comera_fx.TensorizeConfig(
        max_rank=max_rank, min_numel=0, min_dim=1, skip=(r"embed", r"lm_head", r"self_attn", r"mlp\.gate\.")
    )


def to_shared(model, max_rank: int):
    from comera_fx.moe import TTExperts
    from comera_fx.moe.shared import SharedTTExpertBank

    for layer in model.model.layers:
        experts = layer.mlp.experts
        up = SharedTTExpertBank.from_dense(experts.gate_up_proj, "linear", max_rank=max_rank)
        down = SharedTTExpertBank.from_dense(experts.down_proj, "linear", max_rank=max_rank)
        layer.mlp.experts = TTExperts.from_hf(experts, up, down)
    return model


def shared_at_equal_params(dense, budget: int):
    """The shared form at the largest rank cap whose expert parameters stay <= ``budget``."""
    best = None
    for rank in range(1, 129):
        candidate = to_shared(copy.deepcopy(dense), rank)
        if expert_params(candidate) > budget:
            break
        best = (rank, candidate)
    return best


def train(model, batches, held_out, args):
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    times = []
    for ids in batches:
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    model.eval()
    with torch.no_grad():
        held = statistics.mean(model(ids, labels=ids).loss.item() for ids in held_out)
    return statistics.median(times[1:]), held


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-rank", type=int, default=8, help="rank cap of the per-expert TT form")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import comera_fx

    dense = build(args)
    per_expert = copy.deepcopy(dense)
    comera_fx.tensorize_(per_expert, experts_only(args.max_rank))
    budget = expert_params(per_expert)
    shared_rank, shared = shared_at_equal_params(dense, budget)
    batches = bigram_batches(args, args.steps, seed=1)
    held_out = bigram_batches(args, 4, seed=2)

    rows = []
    for name, model, note in (
        ("dense", dense, "-"),
        ("per-expert TT", per_expert, f"max_rank {args.max_rank}"),
        ("shared TT", shared, f"max_rank {shared_rank}"),
    ):
        total = sum(p.numel() for p in model.parameters())
        step, loss = train(model, batches, held_out, args)
        rows.append((name, note, expert_params(model), total, step, loss))
    dense_step = rows[0][4]
    print(
        f"bench_moe: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts top-2, "
        f"vocab {args.vocab}, {args.steps} Adam steps (lr {args.lr}) of {args.batch}x{args.seq} tokens, "
        f"{args.threads} thread(s)"
    )
    print("| variant | ranks | expert params | model params | step ms (median) | step / dense | held-out loss |")
    print("|---|---|---|---|---|---|---|")
    for name, note, experts, total, step, loss in rows:
        print(
            f"| {name} | {note} | {experts:,} | {total:,} | {step * 1e3:.1f} | {step / dense_step:.2f} | {loss:.4f} |"
        )


if __name__ == "__main__":
    main()
