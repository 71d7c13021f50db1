"""Compile a training run when its budget repays the compile, with the compile time on the run's own clock.

A compile is paid once (plus once per recompile) and repaid a little per step, so whether it pays depends on the
budget, the eager step, the compiled step and the recompiles to come, and the last three are only known by trying.
``CompileProbe`` therefore runs a few eager steps, and if the remaining budget could repay a compile at all,
compiles the model's blocks in place (``comera_fx.compile_regions`` with comera_fx's backend when the model holds
TT layers, stock ``torch.compile`` per block otherwise). It then alternates compiled and eager steps in pairs until
a sign test over the pairs says whether the compiled step is fast enough to repay the expected recompiles, and
keeps the compiled path only then; otherwise the blocks go back to eager. Both kinds of probe step train the model,
so a long probe costs only the eager steps' lost speed; pairs of neighbouring steps share the machine's load, which
on a shared machine moves more between minutes than the compiled gain (benchmarks/RESULTS.md, "Issue 30 item 4").
Every step, the compile ones included, is timed by the caller's training clock, so a compile that does not pay
costs the run its seconds. ``summary()`` says which path ran and why.

Used by ``examples/train_code_lm.py`` (``--compile auto|yes|no``) and so by ``benchmarks/bench_equal_time.py``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch._dynamo.utils

from .backend import compile_regions, make_backend
from .tt.inventory import tt_matrices

# The most a compiled CPU step has been measured to gain over eager here is 1.4-1.6x (CoMERA's widths, with dropout;
# benchmarks/RESULTS.md, issue 14): a compile is tried only if it could pay at twice the eager speed.
BEST_SPEEDUP = 2.0
# Below this many seconds no compile of these models has been seen (warm caches included): a budget that could
# not repay even this is not probed.
MIN_COMPILE_SECONDS = 5.0
# expected_recompiles for a schedule that shrinks at every prune point (CoMERA's): never repaid.
UNBOUNDED = 10**6
# The paired probe stops when a one-sided sign test is this sure either way (or at its cap of pairs).
SIGN_TEST_LEVEL = 0.02
# ... and spends at most this share of the budget left after the compile on probing.
PROBE_BUDGET_SHARE = 0.1


def could_pay(
    remaining_s: float,
    recompiles: int = 0,
    min_compile_s: float = MIN_COMPILE_SECONDS,
    best_speedup: float = BEST_SPEEDUP,
) -> bool:
    """Whether ``remaining_s`` of training could repay a compile and ``recompiles`` recompiles of ``min_compile_s``
    each at the best speed-up."""
    return remaining_s * (1 - 1 / best_speedup) > (1 + recompiles) * min_compile_s


def steps_gained(remaining_s: float, eager_step_s: float, compiled_step_s: float, recompile_s: float) -> float:
    """Steps the compiled path runs in ``remaining_s`` beyond the eager path, after ``recompile_s`` of recompiles
    (negative: the compile does not pay)."""
    return max(remaining_s - recompile_s, 0.0) / compiled_step_s - remaining_s / eager_step_s


def speedup_needed(remaining_s: float, recompile_s: float) -> float:
    """The eager/compiled step ratio at which ``remaining_s`` of compiled training after ``recompile_s`` of
    recompiles runs as many steps as eager (``steps_gained`` = 0); infinite when the recompiles eat the budget."""
    return remaining_s / (remaining_s - recompile_s) if remaining_s > recompile_s else math.inf


def steps_gained_at_ratio(compiled_times: list[float], eager_step_s: float, ratio: float, window: int = 51) -> float:
    """Steps that compiled steps of ``compiled_times`` ran beyond what eager steps would have in their seconds, the
    eager step taken as ``ratio`` × the median compiled step around each one (a slow step, such as a recompile,
    counts against compiling; a machine that slows down slows both); the first, the compile, against
    ``eager_step_s`` measured just before it. ``ratio``: the probe's eager/compiled reading, so beyond the probe this
    is an estimate at the probe's speed-up."""
    if not compiled_times:
        return 0.0
    gained = 1 - compiled_times[0] / eager_step_s
    rest, half = compiled_times[1:], window // 2
    for i, seconds in enumerate(rest):
        local = statistics.median(rest[max(0, i - half) : i + half + 1])
        gained += 1 - seconds / (ratio * local)
    return gained


def sign_test_tail(successes: int, trials: int) -> float:
    """P(X >= successes) for X ~ Binomial(trials, 1/2): how often a fair coin does at least this well."""
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2**trials


def paired_verdict(
    ratios: list[float], needed: float, min_pairs: int, max_pairs: int, level: float = SIGN_TEST_LEVEL
) -> bool | None:
    """From eager/compiled time ratios of neighbouring step pairs: True when the compiled path pays (the ratios
    exceed ``needed`` more often than a fair coin would, at ``level``), False when it does not, None while the pairs
    cannot tell yet. At ``max_pairs`` the median decides."""
    n = len(ratios)
    if n < min_pairs:
        return None
    above = sum(r > needed for r in ratios)
    if sign_test_tail(above, n) < level:
        return True
    if sign_test_tail(n - above, n) < level:
        return False
    if n >= max_pairs:
        return statistics.median(ratios) > needed
    return None


@dataclass
class CompileProbe:
    """Drives the choice over a run: call ``before_step(model)`` before each step and ``after_step(seconds, model)``
    after it. ``mode``: "auto" (probe, keep what pays), "yes" (compile after the eager steps, keep it), "no".
    ``expected_recompiles``: physical rank shrinks to come (each recompiles the blocks; its cost is estimated at
    the first compile's). ``on_eager``: called once when the run settles on eager (declined or reverted), e.g.
    ``RankAdaptive.shrink_eagerly`` to drop the settings that only save recompiles.

    After the compile the probe alternates the two paths, compiled-eager then eager-compiled, so a steady change
    in the machine's speed falls on both; from ``min_pairs`` pairs on it decides as soon as ``paired_verdict`` can,
    after ``max_pairs`` pairs (or ``PROBE_BUDGET_SHARE`` of the budget) at the latest. "yes" probes too, for the
    report's figures, and keeps the compiled path whatever the verdict."""

    mode: str = "auto"
    budget_s: float = 0.0
    expected_recompiles: int = 0
    eager_steps: int = 8  # medians of 7 steps each: single CPU steps vary by 10-20 % on a shared machine
    min_pairs: int = 8
    max_pairs: int = 48
    eager_times: list = field(default_factory=list)
    compiled_times: list = field(default_factory=list)
    pair_ratios: list = field(default_factory=list)  # eager / compiled seconds of each probe pair
    state: str = "eager"  # eager -> compiled -> (kept | reverted); or "declined"
    reason: str = ""
    compile_s: float = 0.0
    graphs_at_first_step: int = 0
    on_eager: object = None
    _spent: float = 0.0
    _stats: object = None
    _compiled_calls: object = None  # the blocks' compiled calls while a probe step runs eagerly
    _pair: list = field(default_factory=list)  # (path, seconds) of the pair under way
    _probe_start: float = 0.0
    _eager_at_compile: float = 0.0

    def __post_init__(self):
        if self.mode not in ("auto", "yes", "no"):
            raise ValueError(f"compile mode must be 'auto', 'yes' or 'no'; got {self.mode!r}")
        if self.mode == "no":
            self.state, self.reason = "declined", "--compile no"
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ValueError(f"need 1 <= min_pairs <= max_pairs; got {self.min_pairs}, {self.max_pairs}")

    # -- the run calls these ------------------------------------------------------------------------------------

    def before_step(self, model) -> None:
        if self.state == "eager" and len(self.eager_times) >= self.eager_steps:
            remaining = self.budget_s - self._spent
            if self.mode == "auto" and not could_pay(remaining, self.expected_recompiles):
                self._settle_eager()
                self.state = "declined"
                compiles = (
                    "a compile per prune"
                    if self.expected_recompiles >= UNBOUNDED
                    else f"{1 + self.expected_recompiles} compile(s)"
                )
                self.reason = (
                    f"{remaining:.0f} s of budget left could not repay even {compiles} of "
                    f"{MIN_COMPILE_SECONDS:g} s at {BEST_SPEEDUP:g}x the eager speed"
                )
                return
            self._stats = compile_blocks(model)
            self.state = "compiled"
        elif self._probing():
            self._use_path(model, self._next_path())

    def after_step(self, seconds: float, model) -> None:
        self._spent += seconds
        if self.state == "eager":
            self.eager_times.append(seconds)
            return
        if self.state not in ("compiled", "kept"):
            return
        if self._probing() and self._compiled_calls is not None:  # this probe step ran eagerly
            self.eager_times.append(seconds)
            self._pair.append(("eager", seconds))
        else:
            self.compiled_times.append(seconds)
            if len(self.compiled_times) == 1:
                self._eager_at_compile = self.eager_step
                self.compile_s = max(seconds - self._eager_at_compile, 0.0)
                self.graphs_at_first_step = self._stats.graphs()
                self._probe_start = self._spent
                return
            if self._probing():
                self._pair.append(("compiled", seconds))
        if self.state != "compiled":
            return
        if len(self._pair) == 2:
            times = dict(self._pair)
            self.pair_ratios.append(times["eager"] / times["compiled"])
            self._pair = []
            self._use_path(model, "compiled")
            remaining = self.budget_s - self._spent
            probe_cap = PROBE_BUDGET_SHARE * (self.budget_s - self._probe_start)
            max_pairs = self.max_pairs if self._spent - self._probe_start < probe_cap else len(self.pair_ratios)
            verdict = paired_verdict(
                self.pair_ratios,
                speedup_needed(remaining, self._recompile_s()),
                self.min_pairs,
                max(max_pairs, self.min_pairs),
            )
            if verdict is not None:
                self._decide(model, verdict)

    def _probing(self) -> bool:
        return self.state == "compiled" and len(self.compiled_times) >= 1

    def _next_path(self) -> str:
        """Pairs alternate their order (compiled first, then eager first), so a trend within pairs cancels."""
        first, second = ("compiled", "eager") if len(self.pair_ratios) % 2 == 0 else ("eager", "compiled")
        return first if not self._pair else second

    def _use_path(self, model, path: str) -> None:
        if path == "eager" and self._compiled_calls is None:
            self._compiled_calls = pause_blocks(model)
        elif path == "compiled" and self._compiled_calls is not None:
            resume_blocks(model, self._compiled_calls)
            self._compiled_calls = None

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

    def _recompile_s(self) -> float:
        return self.expected_recompiles * self.compile_s

    def _decide(self, model, pays: bool) -> None:
        remaining = self.budget_s - self._spent
        recompile_s = self._recompile_s()
        ratio, needed = statistics.median(self.pair_ratios), speedup_needed(remaining, recompile_s)
        above = sum(r > needed for r in self.pair_ratios)
        gained = steps_gained(remaining, self.eager_step, self.eager_step / ratio, recompile_s)
        figures = (
            f"compile {self.compile_s:.1f} s, compiled step {ratio:.2f}x faster than eager (median of "
            f"{len(self.pair_ratios)} neighbouring pairs; {above} of them above the {needed:.3f}x needed), "
            f"{remaining:.0f} s left, {self.expected_recompiles} recompile(s) expected (~{recompile_s:.0f} "
            f"s): {gained:+.0f} steps compiled"
        )
        self._use_path(model, "compiled")
        if pays or self.mode == "yes":
            self.state, self.reason = "kept", figures + (" (--compile yes)" if self.mode == "yes" else "")
        else:
            uncompile_blocks(model)
            self._settle_eager()
            self.state, self.reason = "reverted", figures + ": back to eager"

    def summary(self) -> dict:
        """JSON-ready: the path that ran, why, and the compile figures."""
        path = {"kept": "compiled", "compiled": "compiled", "reverted": "compiled, then eager"}.get(self.state, "eager")
        out = {"path": path, "reason": self.reason or "the run ended before the probe chose", "mode": self.mode}
        if self.eager_times:
            out["eager_step_s"] = self.eager_step
        if self.compiled_times:
            out.update(
                compile_s=self.compile_s,
                compiled_step_s=self.compiled_step,
                graphs=self.graphs(),
                recompiles=self.recompiles(),
                compiled_steps=len(self.compiled_times),
            )
            # The compiled steps' own times against eager ones measured before the compile would carry the machine's
            # drift over the whole run (a 600 s run read -347 steps where its interleaved eager partner took 228
            # fewer): after a probe, measured at its paired ratio instead.
            if self.pair_ratios:
                ratio = statistics.median(self.pair_ratios)
                out.update(
                    probe_pairs=len(self.pair_ratios),
                    probe_speedup=ratio,
                    steps_gained=steps_gained_at_ratio(self.compiled_times, self._eager_at_compile, ratio),
                )
            else:
                out["steps_gained"] = len(self.compiled_times) - sum(self.compiled_times) / self.eager_step
        return out


# -- compiling the blocks -----------------------------------------------------------------------------------------


class _GraphCount:
    """Graphs compiled so far: comera_fx's backend counts its own; stock Inductor through Dynamo's counter."""

    def __init__(self, backend=None):
        self.backend = backend
        if backend is None:
            self._counters = torch._dynamo.utils.counters
            self._start = self._counters["stats"]["unique_graphs"]

    def graphs(self) -> int:
        if self.backend is not None:
            return self.backend.stats.graphs
        return self._counters["stats"]["unique_graphs"] - self._start


def compile_blocks(model) -> _GraphCount:
    """Compile ``model.blocks`` in place: comera_fx's backend (one graph shared by same-shaped blocks) when the model
    holds TT layers, stock ``torch.compile`` per block otherwise. Embeddings, head and loss stay eager."""
    if tt_matrices(model):
        backend = make_backend()
        compile_regions(model, backend=backend)
        return _GraphCount(backend)
    for block in model.blocks:
        block.compile()
    return _GraphCount()


def uncompile_blocks(model) -> None:
    """Undo ``compile_blocks``: ``nn.Module.compile`` keeps the compiled call in ``_compiled_call_impl``."""
    for block in model.blocks:
        block._compiled_call_impl = None


def pause_blocks(model) -> list:
    """Run the blocks eagerly for a while, keeping their compiled calls for ``resume_blocks`` (the paired probe)."""
    calls = [block._compiled_call_impl for block in model.blocks]
    uncompile_blocks(model)
    return calls


def resume_blocks(model, calls: list) -> None:
    """Put back the compiled calls ``pause_blocks`` kept: no recompile, the graphs stay in Dynamo's cache."""
    for block, call in zip(model.blocks, calls, strict=True):
        block._compiled_call_impl = call
