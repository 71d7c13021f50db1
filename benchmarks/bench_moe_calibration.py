"""Expert calibration against plain TT-SVD at equal parameters, per MoE family.

For each family (tiny random-init config, ``comera_fx.testing.moe_families``, hidden ``--hidden``, expert ffn
``--ffn``): ``--batches`` calibration batches of random tokens; the experts modules' inputs on them are recorded
on the dense model; the experts are converted twice at ``--max-rank`` (everything else dense), once by plain
TT-SVD and once with ``calibrate_experts`` statistics (activation-aware TT-SVD, the same ranks). Reported: the
experts' relative output error on the calibration set's own routed tokens, both ways, and their ratio
(calibrated / plain; below 1 is better). Random-init weights are close to full rank, so errors are large at
low rank; what matters is the ratio. No timing: no lock needed.

    python benchmarks/bench_moe_calibration.py [--max-rank 8] [--families mixtral gpt_oss]
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch


def main() -> None:
    import comera_fx
    from comera_fx.pretrained.expert_stats import calibrate_experts
    from comera_fx.testing.moe_families import build, families

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument(
        "--families", nargs="*", default=["mixtral", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss", "llama4"]
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    names = dict(families())

    def holds_experts(module, path):
        return any(p.dim() == 3 for p in module.parameters(recurse=False))

    print(f"max_rank {args.max_rank}, hidden {args.hidden}, ffn {args.ffn}, {args.batches} batches of 4x32 tokens")
    print("| family | expert TT params | plain rel err | calibrated rel err | calibrated / plain |")
    print("|---|---:|---:|---:|---:|")
    for family in args.families:
        dense = build(
            family, names[family], hidden_size=args.hidden, intermediate_size=args.ffn, moe_intermediate_size=args.ffn
        )
        generator = torch.Generator().manual_seed(0)
        data = [torch.randint(0, 64, (4, 32), generator=generator) for _ in range(args.batches)]
        paths = [n for n, m in dense.named_modules() if holds_experts(m, n)]
        calls = {p: [] for p in paths}
        handles = [
            dense.get_submodule(p).register_forward_hook(
                lambda m, a, k, o, p=p: calls[p].append((a, k)), with_kwargs=True
            )
            for p in paths
        ]
        with torch.no_grad():
            for batch in data:
                dense(batch)
        for handle in handles:
            handle.remove()
        calibration = calibrate_experts(dense, data)
        config = comera_fx.TensorizeConfig(max_rank=args.max_rank, min_numel=0, min_dim=1)
        errors, params = {}, {}
        for name, stats in (("plain", None), ("calibrated", calibration)):
            model = copy.deepcopy(dense)
            summary = comera_fx.tensorize_(model, config, filter_fn=holds_experts, calibration=stats)
            params[name] = sum(d.params for d in summary.converted)
            num = den = 0.0
            with torch.no_grad():
                for path, recorded in calls.items():
                    for a, k in recorded:
                        y, r = model.get_submodule(path)(*a, **k), dense.get_submodule(path)(*a, **k)
                        num, den = num + float((y - r).pow(2).sum()), den + float(r.pow(2).sum())
            errors[name] = (num / den) ** 0.5
        assert params["plain"] == params["calibrated"]
        print(
            f"| {family} | {params['plain']:,} | {errors['plain']:.4f} | {errors['calibrated']:.4f} | "
            f"{errors['calibrated'] / errors['plain']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
