"""Compile a training run when its budget repays the compile, with the compile time on the run's own clock.

A compile is paid once (plus once per recompile) and repaid a little per step, so whether it pays depends on the
budget, the eager step, the compiled step and the recompiles to come, and the last three are only known by trying.
``CompileProbe`` therefore runs a few eager steps, and if the remaining budget could repay a compile at all,
compiles the model's blocks in place (``comera_fx.compile_regions`` with comera_fx's backend when the model holds
TT layers, stock ``torch.compile`` per block otherwise), times a few compiled steps, and keeps the compiled path only
when the budget left after the expected recompiles gives more steps compiled than eager; otherwise the blocks go
back to eager. Every step, the compile ones included, is timed by the caller's training clock, so a compile that
does not pay costs the run its seconds. ``summary()`` says which path ran and why.

Used by ``train_code_lm.py`` (``--compile auto|yes|no``) and so by ``benchmarks/bench_equal_time.py``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# The most a compiled CPU step has been measured to gain over eager here is 1.4-1.6x (CoMERA's widths, with dropout;
# benchmarks/RESULTS.md, issue 14): a compile is tried only if it could pay at twice the eager speed.
BEST_SPEEDUP = 2.0
# Below this many seconds no compile of these models has been seen (warm caches included): a budget that could
# not repay even this is not probed.
MIN_COMPILE_SECONDS = 5.0
# expected_recompiles for a schedule that shrinks at every prune point (CoMERA's): never repaid.
UNBOUNDED = 10**6


def could_pay(remaining_s: float, recompiles: int = 0, min_compile_s: float = MIN_COMPILE_SECONDS,
              best_speedup: float = BEST_SPEEDUP) -> bool:
    """Whether ``remaining_s`` of training could repay a compile and ``recompiles`` recompiles of ``min_compile_s``
    each at the best speed-up."""
    return remaining_s * (1 - 1 / best_speedup) > (1 + recompiles) * min_compile_s


def steps_gained(remaining_s: float, eager_step_s: float, compiled_step_s: float, recompile_s: float) -> float:
    """Steps the compiled path runs in ``remaining_s`` beyond the eager path, after ``recompile_s`` of recompiles
    (negative: the compile does not pay)."""
    return max(remaining_s - recompile_s, 0.0) / compiled_step_s - remaining_s / eager_step_s


@dataclass
class CompileProbe:
    """Drives the choice over a run: call ``before_step(model)`` before each step and ``after_step(seconds, model)``
    after it. ``mode``: "auto" (probe, keep what pays), "yes" (compile after the eager steps, keep it), "no".
    ``expected_recompiles``: physical rank shrinks to come (each recompiles the blocks; its cost is estimated at
    the first compile's). ``on_eager``: called once when the run settles on eager (declined or reverted), e.g.
    ``RankAdaptive.shrink_eagerly`` to drop the settings that only save recompiles."""

    mode: str = "auto"
    budget_s: float = 0.0
    expected_recompiles: int = 0
    eager_steps: int = 8             # medians of 7 steps each: single CPU steps vary by 10-20 % on a shared machine
    probe_steps: int = 8
    eager_times: list = field(default_factory=list)
    compiled_times: list = field(default_factory=list)
    state: str = "eager"            # eager -> compiled -> (kept | reverted); or "declined"
    reason: str = ""
    compile_s: float = 0.0
    graphs_at_first_step: int = 0
    on_eager: object = None
    _spent: float = 0.0
    _stats: object = None

    def __post_init__(self):
        if self.mode not in ("auto", "yes", "no"):
            raise ValueError(f"compile mode must be 'auto', 'yes' or 'no'; got {self.mode!r}")
        if self.mode == "no":
            self.state, self.reason = "declined", "--compile no"

    # -- the run calls these ------------------------------------------------------------------------------------

    def before_step(self, model) -> None:
        if self.state == "eager" and len(self.eager_times) >= self.eager_steps:
            remaining = self.budget_s - self._spent
            if self.mode == "auto" and not could_pay(remaining, self.expected_recompiles):
                self._settle_eager()
                self.state = "declined"
                compiles = ("a compile per prune" if self.expected_recompiles >= UNBOUNDED else
                            f"{1 + self.expected_recompiles} compile(s)")
                self.reason = (f"{remaining:.0f} s of budget left could not repay even {compiles} of "
                               f"{MIN_COMPILE_SECONDS:g} s at {BEST_SPEEDUP:g}x the eager speed")
                return
            self._stats = compile_blocks(model)
            self.state = "compiled"

    def after_step(self, seconds: float, model) -> None:
        self._spent += seconds
        if self.state == "eager":
            self.eager_times.append(seconds)
            return
        if self.state not in ("compiled", "kept"):
            return
        self.compiled_times.append(seconds)
        if len(self.compiled_times) == 1:
            self.compile_s = max(seconds - self.eager_step, 0.0)
            self.graphs_at_first_step = self._stats.graphs()
        if self.state == "compiled" and len(self.compiled_times) == 1 + self.probe_steps:
            self._decide(model)

    def _settle_eager(self) -> None:
        if self.on_eager is not None:
            self.on_eager()

    # -- figures --------------------------------------------------------------------------------------------------

    @property
    def eager_step(self) -> float:
        times = self.eager_times[1:] or self.eager_times
        return statistics.median(times) if times else float("nan")

    @property
    def compiled_step(self) -> float:
        times = self.compiled_times[1:]
        return statistics.median(times) if times else float("nan")

    def graphs(self) -> int:
        return self._stats.graphs() if self._stats is not None else 0

    def recompiles(self) -> int:
        return max(self.graphs() - self.graphs_at_first_step, 0) if self.compiled_times else 0

    def _decide(self, model) -> None:
        remaining = self.budget_s - self._spent
        recompile_s = self.expected_recompiles * self.compile_s
        gained = steps_gained(remaining, self.eager_step, self.compiled_step, recompile_s)
        figures = (f"compile {self.compile_s:.1f} s, compiled step {self.compiled_step:.3f} s vs eager "
                   f"{self.eager_step:.3f} s ({self.eager_step / self.compiled_step:.2f}x), {remaining:.0f} s left, "
                   f"{self.expected_recompiles} recompile(s) expected (~{recompile_s:.0f} s): "
                   f"{gained:+.0f} steps compiled")
        if self.mode == "yes" or gained > 0:
            self.state, self.reason = "kept", figures + (" (--compile yes)" if self.mode == "yes" else "")
        else:
            uncompile_blocks(model)
            self._settle_eager()
            self.state, self.reason = "reverted", figures + ": back to eager"

    def summary(self) -> dict:
        """JSON-ready: the path that ran, why, and the compile figures."""
        path = {"kept": "compiled", "compiled": "compiled", "reverted": "compiled, then eager"}.get(self.state,
                                                                                                     "eager")
        out = {"path": path, "reason": self.reason or "the run ended before the probe chose", "mode": self.mode}
        if self.eager_times:
            out["eager_step_s"] = self.eager_step
        if self.compiled_times:
            compiled_seconds = sum(self.compiled_times)
            out.update(compile_s=self.compile_s, compiled_step_s=self.compiled_step, graphs=self.graphs(),
                       recompiles=self.recompiles(), compiled_steps=len(self.compiled_times),
                       steps_gained=len(self.compiled_times) - compiled_seconds / self.eager_step)
        return out

# -- compiling the blocks -----------------------------------------------------------------------------------------


class _GraphCount:
    """Graphs compiled so far: comera_fx's backend counts its own; stock Inductor through Dynamo's counter."""

    def __init__(self, backend=None):
        self.backend = backend
        if backend is None:
            import torch._dynamo.utils

            self._counters = torch._dynamo.utils.counters
            self._start = self._counters["stats"]["unique_graphs"]

    def graphs(self) -> int:
        if self.backend is not None:
            return self.backend.stats.graphs
        return self._counters["stats"]["unique_graphs"] - self._start


def compile_blocks(model) -> _GraphCount:
    """Compile ``model.blocks`` in place: comera_fx's backend (one graph shared by same-shaped blocks) when the model
    holds TT layers, stock ``torch.compile`` per block otherwise. Embeddings, head and loss stay eager."""
    import comera_fx
    from comera_fx.backend import make_backend
    from comera_fx.tt.inventory import tt_matrices

    if tt_matrices(model):
        backend = make_backend()
        comera_fx.compile_regions(model, backend=backend)
        return _GraphCount(backend)
    for block in model.blocks:
        block.compile()
    return _GraphCount()


def uncompile_blocks(model) -> None:
    """Undo ``compile_blocks``: ``nn.Module.compile`` keeps the compiled call in ``_compiled_call_impl``."""
    for block in model.blocks:
        block._compiled_call_impl = None
