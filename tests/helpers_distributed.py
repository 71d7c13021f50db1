"""Spawning a small torch.distributed group for a test and collecting what each rank saved."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def run_spawned(worker: Callable, args: tuple, out: Path, names: Sequence[str], world: int,
                timeout_s: float) -> dict[str, list]:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes and load what each rank saved as
    ``out/<name>.<rank>.pt``: {name: [rank 0's, rank 1's, ...]}. A group still running after ``timeout_s`` (a hang)
    fails the test and its processes are terminated."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"the distributed group did not finish within {timeout_s} s (a hang?)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
    return {name: [torch.load(out / f"{name}.{rank}.pt", weights_only=False) for rank in range(world)]
            for name in names}
