"""What Inductor emits for one TT layer's training step (forward + backward), on CPU codegen: a proxy for the GPU step.

Counts, from the generated code (``torch._inductor.utils.run_and_get_code``), the GEMM calls (``extern_kernels.mm``
/ ``bmm`` / ``addmm`` / ``baddbmm``) and the generated kernels (C++ loops on CPU; each would be a Triton kernel on
GPU), for a ``TTLinear`` at ``--rank`` and the dense ``nn.Linear`` it replaces (stock Inductor), both run forward
and backward at batch ``--batch``. No timing: counts only. No GPU is needed (nor used).

    .venv/bin/python benchmarks/investigations/count_tt_kernels.py --width 512 --rank 16 --batch 256
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.use_this_checkout()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

import comera_fx  # noqa: E402

GEMM = re.compile(r"extern_kernels\.(mm|bmm|addmm|baddbmm)\(")
KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\(", re.M)


def counts(module: nn.Module, x: torch.Tensor, backend) -> tuple[int, int, dict[str, int]]:
    """(GEMM calls, generated kernels, GEMMs by op) over the forward and backward graphs of one step."""
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)

    def step():
        compiled(x).sum().backward()

    _, sources = run_and_get_code(step)
    gemms: dict[str, int] = {}
    for code in sources:
        for op in GEMM.findall(code):
            gemms[op] = gemms.get(op, 0) + 1
    kernels = sum(len(KERNEL.findall(code)) for code in sources)
    return sum(gemms.values()), kernels, gemms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    opts = ap.parse_args(argv)
    torch.manual_seed(0)
    dense = nn.Linear(opts.width, opts.width)
    x = torch.randn(opts.batch, opts.width, requires_grad=True)
    tt = comera_fx.TTLinear.from_dense(dense, max_rank=opts.rank)
    tt.tt.prepare_plans()
    print(
        f"TTLinear {opts.width}x{opts.width}, max rank {opts.rank}, batch {opts.batch}: "
        f"{str(comera_fx.plan(tt.tt, opts.batch)).splitlines()[-1]}"
    )
    for name, module, backend in (
        ("TT, comera_fx.backend", tt, comera_fx.make_backend(warn_dense=False)),
        ("dense, stock Inductor", dense, "inductor"),
    ):
        n_gemm, n_kernels, by_op = counts(module, x, backend)
        print(f"{name}: fwd+bwd GEMM calls {n_gemm} {by_op}, generated kernels {n_kernels}")


if __name__ == "__main__":
    main()
