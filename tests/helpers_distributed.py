"""Spawning a small torch.distributed group for a test and collecting what each rank saved."""

from __future__ import annotations

import datetime
import importlib
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 240  # the whole group; a collective gives up after COLLECTIVE_TIMEOUT
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def run_spawned(
    worker: Callable, args: tuple, out: Path, names: Sequence[str], world: int, timeout_s: float
) -> dict[str, list]:
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
    return {
        name: [torch.load(out / f"{name}.{rank}.pt", weights_only=False) for rank in range(world)] for name in names
    }


def _scenario_worker(rank: int, world: int, module: str, names: tuple[str, ...], store_path: str, out_dir: str) -> None:
    """One rank: join the gloo group through a FileStore, run ``module.SCENARIOS[name](rank, world)`` for each name
    (an exception is saved as the result, so the other ranks are not left waiting), save each result."""
    torch.set_num_threads(1)
    scenarios = importlib.import_module(module).SCENARIOS
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        for name in names:
            try:
                result = scenarios[name](rank, world)
            except Exception:
                result = {"error": traceback.format_exc()}
            torch.save(result, Path(out_dir) / f"{name}.{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_scenarios(module: str, names: Sequence[str], tmp: Path, world: int) -> dict[str, list]:
    """Run the named scenarios of test module ``module`` (its ``SCENARIOS`` dict) on ``world`` spawned processes;
    {scenario: [rank 0's result, rank 1's, ...]}."""
    out = tmp / "results"
    out.mkdir()
    return run_spawned(
        _scenario_worker,
        (world, module, tuple(names), str(tmp / "store"), str(out)),
        out,
        names,
        world,
        SPAWN_TIMEOUT_S,
    )


def scenario_results(group: dict[str, list], name: str) -> list:
    """The per-rank results of one scenario; a rank that raised fails the test with its traceback."""
    for r, res in enumerate(group[name]):
        if "error" in res:
            pytest.fail(f"scenario {name!r} failed on rank {r}:\n{res['error']}")
    return group[name]
