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

# A 1-minute load average below this share of the CPUs counts as an idle machine.
IDLE_LOAD_SHARE = 0.5
# libgomp's own spin count when OMP_WAIT_POLICY is unset; set explicitly so that child processes inherit the choice.
LIBGOMP_DEFAULT_SPINCOUNT = "300000"

_chosen: str | None = None  # what choose_wait_policy() decided in this process, and why


def choose_wait_policy() -> str:
    """Set the OpenMP wait policy unless the environment already chose one; return a description for reports.

    An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins. Otherwise: an idle machine gets libgomp's default
    spin-then-sleep (written as ``GOMP_SPINCOUNT``, so subprocesses make the same choice), a busy one ``PASSIVE``."""
    global _chosen
    _chosen = _describe(_choose())
    return _chosen


def wait_policy_note() -> str:
    """The policy in effect, with the reason if ``choose_wait_policy()`` ran in this process."""
    return _chosen or _describe("set by the environment")


def _choose() -> str:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "set by the environment"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform (Windows): keep the default
        return "no load average here"
    cpus = os.cpu_count() or 1
    if load < IDLE_LOAD_SHARE * cpus:
        os.environ["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPINCOUNT
        return f"idle machine: load {load:.2f} on {cpus} CPUs"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return f"busy machine: load {load:.2f} on {cpus} CPUs"


def current_setting() -> str:
    """The OpenMP wait settings in this process's environment, for reports."""
    found = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return ", ".join(found) or "OpenMP's default wait policy"


def _describe(reason: str) -> str:
    return f"{current_setting()} ({reason})"
