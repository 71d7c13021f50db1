"""Does going back to eager after a compile slow the eager step? The demo's TT model (preset "small"), 12 eager
training steps, its blocks compiled (``comera_fx.compile_policy.compile_blocks``) for 8 steps, put back
(``uncompile_blocks``, what ``--compile auto`` does when the compile does not pay), 12 eager steps again, then
after ``torch._dynamo.reset()``. Medians of each set after its first two steps, milliseconds.

Written because a 600 s ``--compile auto`` run that went back to eager ran its eager steps ~20 % slower than a
``--compile no`` run (benchmarks/RESULTS.md, "Issue 30 item 4").

Usage::

    python benchmarks/investigations/bench_uncompile.py     # ~1 minute (one block compile)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.use_this_checkout()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_uncompile_")

import torch  # noqa: E402

from comera_fx import compile_policy as policy  # noqa: E402

demo = common.load_example("train_code_lm")


def main() -> None:
    torch.set_num_threads(2)
    p = demo.PRESETS["small"]
    args, _ = demo.parse_args([])
    train_data, _, _ = demo.load_stdlib(2_000_000)
    torch.manual_seed(0)
    model = demo.GPT(p)
    cpu = torch.device("cpu")
    demo.tensorize(model, p, args, demo.get_batch(train_data, 1, p.seq_len, torch.Generator().manual_seed(0), cpu)[0])
    optimizer = demo.make_tt_optimizer(model, args, 1e-3)
    gen = torch.Generator().manual_seed(5)
    batches = [demo.get_batch(train_data, p.batch, p.seq_len, gen, cpu) for _ in range(4)]

    def median_ms(steps: int) -> float:
        times = []
        for i in range(steps):
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            loss = demo.lm_loss(model, x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            float(loss)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times[2:])

    print(f"eager before the compile        {median_ms(12):7.1f} ms", flush=True)
    policy.compile_blocks(model)
    print(f"compiled blocks                 {median_ms(8):7.1f} ms", flush=True)
    policy.uncompile_blocks(model)
    print(f"eager after uncompile_blocks    {median_ms(12):7.1f} ms", flush=True)
    torch._dynamo.reset()
    print(f"eager after torch._dynamo.reset {median_ms(12):7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
