"""How this process's OpenMP threads wait between parallel regions: chosen from the machine's load, before torch loads.

Must be imported, and ``choose_wait_policy()`` called, before ``import torch``: libgomp reads its environment once,
when it is loaded. No torch import here.

Why it matters for a TT model: its step is many short parallel regions (small GEMMs, core merges, fused pointwise
kernels). With ``OMP_WAIT_POLICY=PASSIVE`` every region wakes its sleeping threads through the kernel, ~0.1 ms each
on these machines (a 12 × 12 × 240 matmul: 110-165 µs against 4-9 µs with libgomp's default), so on an idle machine
the demo's TT step took 240 ms instead of 162 ms. On a machine that other jobs keep busy, spinning threads wait for
descheduled partners instead: there PASSIVE was ~2x faster than libgomp's default (benchmarks/RESULTS.md,
"The OpenMP wait policy").
"""

from __future__ import annotations

import os
import time

# Fewer busy CPUs than this share of them counts as an idle machine.
IDLE_LOAD_SHARE = 0.5
# How long the CPUs' busy time is sampled. The 1-minute load average is the fallback only: it still counts a job
# that ended seconds ago (a timing run just before read 1.35 on 2 idle CPUs and got PASSIVE; RESULTS.md, issue 30).
SAMPLE_SECONDS = 1.0
# libgomp's own spin count when OMP_WAIT_POLICY is unset; set explicitly so that child processes inherit the choice.
LIBGOMP_DEFAULT_SPINCOUNT = "300000"

_chosen: str | None = None  # what choose_wait_policy() decided in this process, and why


def choose_wait_policy() -> str:
    """Set the OpenMP wait policy unless the environment already chose one; return a description for reports.

    An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins. Otherwise: an idle machine gets libgomp's default
    spin-then-sleep (written as ``GOMP_SPINCOUNT``, so subprocesses make the same choice), a busy one ``PASSIVE``.
    Busy is read from the CPUs' busy time over ``SAMPLE_SECONDS`` (Linux ``/proc/stat``), else the load average."""
    global _chosen
    _chosen = _describe(_choose())
    return _chosen


def wait_policy_note() -> str:
    """The policy in effect, with the reason if ``choose_wait_policy()`` ran in this process."""
    return _chosen or _describe("set by the environment")


def cpu_times(stat_text: str) -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs together from ``/proc/stat``'s text; None if it has no "cpu" line.
    Idle and iowait count as idle; guest time is inside user time already, so it is not added again."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle = sum(ticks[3:5])
            return sum(ticks) - idle, sum(ticks)
    return None


def busy_cpus(before: tuple[int, int], after: tuple[int, int], cpus: int) -> float:
    """CPUs kept busy between two ``cpu_times`` readings (0 when no tick passed)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return cpus * busy / total if total > 0 else 0.0


def _sample_busy_cpus(cpus: int) -> float | None:
    """CPUs busy over the next ``SAMPLE_SECONDS`` (this process sleeps meanwhile); None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            before = cpu_times(f.read())
        time.sleep(SAMPLE_SECONDS)
        with open("/proc/stat") as f:
            after = cpu_times(f.read())
    except (OSError, ValueError):
        return None
    if before is None or after is None:
        return None
    return busy_cpus(before, after, cpus)


def _choose() -> str:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "set by the environment"
    cpus = os.cpu_count() or 1
    busy = _sample_busy_cpus(cpus)
    if busy is not None:
        load, how = busy, f"{busy:.2f} of {cpus} CPUs busy over {SAMPLE_SECONDS:g} s"
    else:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # neither here (Windows): keep the default
            return "no CPU load reading here"
        how = f"load average {load:.2f} on {cpus} CPUs"
    if load < IDLE_LOAD_SHARE * cpus:
        os.environ["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPINCOUNT
        return f"idle machine: {how}"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return f"busy machine: {how}"


def current_setting() -> str:
    """The OpenMP wait settings in this process's environment, for reports."""
    found = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return ", ".join(found) or "OpenMP's default wait policy"


def _describe(reason: str) -> str:
    return f"{current_setting()} ({reason})"
