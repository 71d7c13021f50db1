"""Issue 44: how many kernels does one TT layer's training step (forward + backward) launch against the dense layer,
with the plan chosen for the CPU (launch cost 0) and for CUDA (``DEVICE_LAUNCH["cuda"]``)?

CPU codegen is the proxy for a GPU step: from Inductor's output code (``torch._inductor.utils.run_and_get_code``) it
counts the GEMM calls (``extern_kernels.mm`` / ``bmm`` / ``addmm`` / ``baddbmm``) and the generated kernels (C++ loops
here, each a Triton kernel on a GPU). The TT layer is compiled with ``comera_fx.make_backend()``, the dense
``nn.Linear`` with stock Inductor; both take an input that needs its gradient. Next to the counts, the planner's own
count for its plan (GEMMs + permute copies, forward + backward: ``Plan.terms.launches``), which leaves out the
gates' merge into the cores and the bias. The CUDA plan is made on this CPU by giving the CPU CUDA's launch cost for
the duration of one row (a fresh plan cache, restored after). Counts only, no timing: no GPU is needed (nor used).

    flock /tmp/timing.lock env OMP_NUM_THREADS=2 PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_kernel_count.py
    ... benchmarks/bench_kernel_count.py --shapes 768x768:16 --tokens 16 64          # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.use_this_checkout()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

import comera_fx  # noqa: E402
from comera_fx.tt import layers, plan_cache  # noqa: E402
from comera_fx.tt.plan.cost import DEVICE_LAUNCH  # noqa: E402

GEMM = re.compile(r"extern_kernels\.(mm|bmm|addmm|baddbmm)\(")
KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\(", re.M)
PLAN_DEVICES = ("cpu", "cuda")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'768x768:16' -> (in, out, max rank)."""
    dims, rank = text.split(":")
    n_in, n_out = (int(d) for d in dims.split("x"))
    return n_in, n_out, int(rank)


@contextlib.contextmanager
def cpu_plans_as(device_type: str):
    """While active, plans made for the CPU use ``device_type``'s launch cost, in a fresh plan cache (both restored
    after): the plan a layer on that device would run, made and compiled here."""
    saved = DEVICE_LAUNCH["cpu"], plan_cache._ENVELOPES, plan_cache._INFERENCE_ENVELOPES
    DEVICE_LAUNCH["cpu"] = DEVICE_LAUNCH[device_type]
    plan_cache._ENVELOPES, plan_cache._INFERENCE_ENVELOPES = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        DEVICE_LAUNCH["cpu"], plan_cache._ENVELOPES, plan_cache._INFERENCE_ENVELOPES = saved


def inductor_counts(module: nn.Module, x: torch.Tensor, backend) -> tuple[dict[str, int], int]:
    """(GEMM calls by op, generated kernels) over the forward and backward graphs of one step."""
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)

    def step():
        compiled(x).sum().backward()

    _, sources = run_and_get_code(step)
    gemms: dict[str, int] = {}
    for code in sources:
        for op in GEMM.findall(code):
            gemms[op] = gemms.get(op, 0) + 1
    return gemms, sum(len(KERNEL.findall(code)) for code in sources)


def row(name: str, plan: str, modelled: int | None, gemms: dict[str, int], kernels: int) -> dict:
    n_gemm = sum(gemms.values())
    return dict(
        layer=name,
        plan=plan,
        modelled=modelled,
        gemms=n_gemm,
        by_op=gemms,
        generated=kernels,
        total=n_gemm + kernels,
    )


def measure(n_in: int, n_out: int, rank: int, tokens: int) -> list[dict]:
    torch.manual_seed(0)
    dense = nn.Linear(n_in, n_out)
    x = torch.randn(tokens, n_in, requires_grad=True)
    rows = []
    for device_type in PLAN_DEVICES:
        with cpu_plans_as(device_type):
            tt = comera_fx.TTLinear.from_dense(dense, init="random", max_rank=rank)
            tt.tt.prepare_plans()
            chosen = layers.choose_plan(layers.planned_envelope(tt.tt.layout, "matmul", device="cpu"), tokens)
            c0, c1 = chosen.terms.launches
            gemms, kernels = inductor_counts(tt, x, comera_fx.make_backend(warn_dense=False))
            rows.append(row(f"TT, {device_type} plan", str(chosen), c0 + c1 * tokens, gemms, kernels))
    gemms, kernels = inductor_counts(dense, x, "inductor")
    rows.append(row("dense, stock Inductor", "x·Wᵀ", None, gemms, kernels))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["768x768:16", "4096x4096:32"], help="IN x OUT : max rank")
    ap.add_argument("--tokens", nargs="+", type=int, default=[16])
    opts = ap.parse_args(argv)
    print(
        f"torch {torch.__version__}, CPU codegen as the GPU proxy; launch cost per kernel: cpu "
        f"{DEVICE_LAUNCH['cpu']}, cuda {DEVICE_LAUNCH['cuda']:,} FLOP-equivalents"
    )
    print("| layer | tokens | plan | planner's count (GEMMs + copies) | GEMM calls | generated kernels | total |")
    print("|---|---|---|---|---|---|---|")
    for shape in opts.shapes:
        n_in, n_out, rank = parse_shape(shape)
        for tokens in opts.tokens:
            for r in measure(n_in, n_out, rank, tokens):
                modelled = "—" if r["modelled"] is None else r["modelled"]
                ops = ", ".join(f"{op} {n}" for op, n in sorted(r["by_op"].items()))
                print(
                    f"| {n_in}×{n_out} r{rank}: {r['layer']} | {tokens} | {r['plan']} | {modelled} | "
                    f"{r['gemms']} ({ops}) | {r['generated']} | {r['total']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
