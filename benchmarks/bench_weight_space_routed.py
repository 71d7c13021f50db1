"""gpt-oss's experts in the weight-space form: peak memory and step time of a training step, reading only the
routed experts (``LazyBank``, the default in eager) against rebuilding every expert per forward and the dense model.

Each variant runs in a fresh child process (so one variant's freed heap cannot hide another's peak):

* dense: the random-init model, unconverted;
* whole: converted (``TensorizeConfig()`` defaults on the experts only), every read sees the whole rebuilt bank
  (the path before the lazy bank, forced by patching ``weight_space.plain_eager``);
* routed: converted, ``P[e]`` rebuilds expert e alone.

peak = the child's RSS high-water mark (``ru_maxrss``) after its first forward + backward minus its RSS just
before (model and inputs built, nothing run): what that step added. Large tensors are mmapped by glibc and
returned on free, so the figure follows live torch tensors. step = median of ``--steps`` forward + backward +
SGD steps after that first one. ``experts_implementation="eager"`` (the per-expert loop); ``grouped_mm`` reads
the whole bank and costs what "whole" costs. Run under ``flock /tmp/timing.lock`` on a shared machine:

    python benchmarks/bench_weight_space_routed.py [--experts 32] [--top-k 4] [--hidden 512] [--tokens 8 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    import torch

    import comera_fx
    from comera_fx import TensorizeConfig
    from comera_fx.testing.moe_families import build, expert_parameters, families

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = build(
        "gpt_oss",
        dict(families())["gpt_oss"],
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        vocab_size=256,
    ).train()
    model.config._experts_implementation = "eager"
    if args.variant != "dense":
        comera_fx.tensorize_(
            model, TensorizeConfig(), filter_fn=lambda m, _: any(p.dim() == 3 for p in m.parameters(recurse=False))
        )
    if args.variant == "whole":
        from comera_fx.moe import weight_space

        weight_space.plain_eager = lambda: False
    ids = torch.randint(0, 256, (1, args.tokens[0]), generator=torch.Generator().manual_seed(0))
    routed = []  # experts hit per layer in the measured step
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, i, out: routed.append(len(out[2].unique())))
        for layer in model.model.layers
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    before = rss_bytes()
    model(ids, labels=ids).loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    for hook in hooks:
        hook.remove()
    optimizer.step()
    optimizer.zero_grad()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {
        "peak_mib": peak / 2**20,
        "step_ms": 1e3 * statistics.median(times),
        "expert_params": expert_parameters(model),
        "hit": "/".join(map(str, routed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variant", choices=("dense", "whole", "routed"))
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    print(
        f"gpt-oss, {args.layers} layers, hidden = expert ffn = {args.hidden}, {args.experts} experts, "
        f"top-{args.top_k}, eager experts loop, 1 thread"
    )
    print(f"{'tokens':>6} {'variant':>7} {'experts hit':>11} {'expert params':>13} {'peak MiB':>9} {'step ms':>8}")
    for tokens in args.tokens:
        for variant in ("dense", "whole", "routed"):
            command = [sys.executable, __file__, "--variant", variant, "--tokens", str(tokens)] + [
                f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("experts", "top_k", "hidden", "layers", "steps")
            ]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(
                f"{tokens:>6} {variant:>7} {r['hit']:>11} {r['expert_params']:>13} "
                f"{r['peak_mib']:>9.1f} {r['step_ms']:>8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
