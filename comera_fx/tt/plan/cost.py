"""The cost model: raw counts of a plan (``CostTerms``) and their weighting (``CostModel``, ``DEFAULT_*``).

Every count is a pair (c0, c1) meaning c0 + c1·b. ``_step_terms`` / ``_copy_terms`` count one GEMM and the permute
copies; ``scaled_step`` / ``scaled_copy`` give the same counts already weighed, in integers, for the exact search's
inner loop (``ScaledWeights``); ``_subset_sizes`` gives the element count of every subset's intermediate. Pure: no
tensors, no sympy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from .network import _B, X, Linear, TTNetwork, _bits


# Calibrated by benchmarks/calibrate_plan_cost.py on 2026-11-30 (`--repeat 10 --rounds 6`, 2 threads, torch
# 2.13.0+cpu, fp32): best square GEMM 69.2 GFLOP/s, best large-copy bandwidth 11.67 GB/s, so moving one byte takes
# as long as about 5.9 FLOPs. The machine was shared (load 4-5 on 2 cores): runs gave alpha 4.7 to 8.5; CoMERA's
# plans and breakpoints barely move over that range (docs/planner.md).
DEFAULT_ALPHA = 5.9
# Not a time: bytes kept alive for backward cost memory, and their write / re-read is already in the traffic term.
# One FLOP per saved byte is a tie-breaker that prefers the plan keeping fewer activations when times are close
# (1 GiB of saved activations weighs ~1 GFLOP, i.e. ~15 ms on the machine above).
DEFAULT_BETA = 1.0
# Fixed cost of one GEMM launched, in FLOP-equivalents: benchmarks/calibrate_plan_cost.py on 2026-11-30
# (`--repeat 10 --rounds 4`, 2 threads, load 3.4-3.9 on 2 cores) timed a tiny (4 x 4) GEMM chain forward + backward
# through reshapes at best 11.05 us per GEMM launched (bare torch.mm: 1.9 us), times the best GEMM rate of that run,
# 68.2 GFLOP/s. Every tree over n tensors launches n - 1 GEMMs forward and the same number backward, so gamma
# shifts every plan's cost by the same constant: it brings absolute predictions closer at small b, never a choice.
DEFAULT_GAMMA = 754000
# Fixed cost of one kernel launched (every GEMM and every permute copy, forward and backward), in FLOP-equivalents,
# by device type: ``CostModel.for_device``. Unlike gamma it differs between plans of one network, through their copy
# kernels, so where launches dominate (a GPU running small TT layers) it prefers plans that launch fewer kernels.
# CPU: 0, gamma already holds a GEMM's overhead and a copy's is small next to its bytes there. CUDA: an estimate,
# not a measurement (no GPU in the session that added it): ~10 us per launch at an effective ~20 TFLOP/s.
DEVICE_LAUNCH = {"cpu": 0, "cuda": 200_000_000}


@dataclass(frozen=True)
class CostModel:
    """Cost of a plan = FLOPs + alpha · (bytes moved + bytes copied) + beta · bytes saved + gamma · GEMMs launched
    + launch · kernels launched.

    * FLOPs: 2·M·K·N per pairwise GEMM; with ``backward``, each operand that needs a gradient adds one GEMM of the
      same size (dA = dC·Bᵀ, dB = Aᵀ·dC), as autograd runs the pairwise tree. Cores always need one; x only when
      ``x_requires_grad``.
    * bytes moved: each GEMM reads both operands and writes its result (``itemsize`` bytes per element); alpha is
      FLOPs per byte (``DEFAULT_ALPHA``, measured by benchmarks/calibrate_plan_cost.py).
    * bytes copied: the permute copies ``execute`` makes (an operand that is neither a plain nor a transposed view
      of its stored order, and the final reorder into the output's order): read + write of the tensor forward,
      and the same again backward for its gradient when it needs one. Weighted by alpha.
    * bytes saved: the batch-dependent operands autograd keeps alive until backward (the activations); beta is a
      memory-pressure weight in FLOPs per byte (``DEFAULT_BETA``).
    * GEMMs launched: one per step forward, one per gradient backward; gamma (``DEFAULT_GAMMA``, measured) is the
      fixed overhead of one in FLOP-equivalents. Every tree over n tensors has n - 1 steps, so this term is the
      same for every plan of a network: it makes absolute predictions at small batches closer, not choices.
    * kernels launched: the GEMMs above plus the permute copies (one forward, one more backward for a copy whose
      gradient is copied back); ``launch`` (default 0; ``for_device`` takes ``DEVICE_LAUNCH``) is a launch's fixed
      cost. The copies make it differ between plans: a large ``launch`` prefers the plans with fewer kernels.
    Unmodelled: cache effects (small GEMMs run below peak), Inductor fusions.
    """

    alpha: float | Fraction = DEFAULT_ALPHA
    beta: float | Fraction = DEFAULT_BETA
    itemsize: int = 4
    backward: bool = True
    x_requires_grad: bool = True
    gamma: float | Fraction = DEFAULT_GAMMA
    launch: float | Fraction = 0

    def __post_init__(self) -> None:
        _as_fraction(self.alpha, "alpha")
        _as_fraction(self.beta, "beta")
        _as_fraction(self.gamma, "gamma")
        _as_fraction(self.launch, "launch")
        if isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int) or self.itemsize <= 0:
            raise ValueError(f"itemsize must be a positive int (bytes per element), got {self.itemsize!r}")

    @property
    def weights(self) -> tuple[Fraction, Fraction, Fraction]:
        """(alpha, beta, gamma) as exact fractions: a float is read as the decimal it prints as (5.5 -> 11/2)."""
        return (_as_fraction(self.alpha, "alpha"), _as_fraction(self.beta, "beta"), _as_fraction(self.gamma, "gamma"))

    @property
    def launch_weight(self) -> Fraction:
        """``launch`` as an exact fraction."""
        return _as_fraction(self.launch, "launch")

    @classmethod
    def for_device(cls, device, **fields) -> "CostModel":
        """The model for a device (a ``torch.device``, or its type as a string): ``launch`` from ``DEVICE_LAUNCH``
        (``device_launch``) unless given in ``fields``."""
        return cls(**{"launch": device_launch(device), **fields})

    def describe(self) -> str:
        alpha, beta, gamma = self.weights
        what = "forward + backward" if self.backward else "forward only"
        launches = f" + {_num(self.launch_weight)}·kernels" if self.launch_weight else ""
        return (
            f"cost = FLOPs + {_num(alpha)}·(bytes moved + copied) + {_num(beta)}·bytes saved + "
            f"{_num(gamma)}·GEMMs{launches} ({what}, {self.itemsize}-byte elements)"
        )


def device_type(device) -> str:
    """The type of a device given as a ``torch.device`` or a string ("cuda:0" -> "cuda"): what plans are keyed by.
    Read by duck typing, so this module imports no torch."""
    return (device if isinstance(device, str) else device.type).split(":")[0]


def device_launch(device):
    """A kernel launch's cost on ``device`` (``DEVICE_LAUNCH``; 0 for a type it does not list)."""
    return DEVICE_LAUNCH.get(device_type(device), 0)


def _as_fraction(value, name: str) -> Fraction:
    """A finite value >= 0 as an exact Fraction; floats through their shortest repr so 5.9 means 59/10."""
    try:
        frac = Fraction(value) if isinstance(value, (int, Fraction)) else Fraction(str(value))
    except (ValueError, TypeError, ZeroDivisionError):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}") from None
    if isinstance(value, bool) or frac < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return frac


@dataclass(frozen=True)
class CostTerms:
    """Raw counts of a plan, each a pair (c0, c1) meaning c0 + c1·b; weigh them with ``CostModel``."""

    flops_forward: Linear = (0, 0)
    flops_backward: Linear = (0, 0)
    bytes_forward: Linear = (0, 0)
    bytes_backward: Linear = (0, 0)
    bytes_saved: Linear = (0, 0)
    bytes_copied: Linear = (0, 0)  # permute copies, forward + backward
    gemms: Linear = (0, 0)  # GEMMs launched, forward + backward
    launches: Linear = (0, 0)  # kernels launched (GEMMs and permute copies), forward + backward

    def __add__(self, other: "CostTerms") -> "CostTerms":
        return CostTerms(*[(a[0] + b[0], a[1] + b[1]) for a, b in zip(self._pairs(), other._pairs())])

    def _pairs(self) -> tuple[Linear, ...]:
        return (
            self.flops_forward,
            self.flops_backward,
            self.bytes_forward,
            self.bytes_backward,
            self.bytes_saved,
            self.bytes_copied,
            self.gemms,
            self.launches,
        )

    @property
    def flops(self) -> Linear:
        """Forward + backward FLOPs."""
        return _add(self.flops_forward, self.flops_backward)

    def weighted(self, model: CostModel) -> tuple[Fraction, Fraction]:
        alpha, beta, gamma = model.weights
        launch = model.launch_weight
        moved = _add(_add(self.bytes_forward, self.bytes_backward), self.bytes_copied)
        return tuple(
            Fraction(f) + alpha * m + beta * s + gamma * g + launch * k
            for f, m, s, g, k in zip(self.flops, moved, self.bytes_saved, self.gemms, self.launches)
        )


def _add(a: Linear, b: Linear) -> Linear:
    return (a[0] + b[0], a[1] + b[1])


def _step_terms(left: int, right: int, sizes: Sequence[int], model: CostModel) -> CostTerms:
    """Counts of one pairwise contraction C = A·B of the subsets ``left`` (A) and ``right`` (B).

    ``sizes[mask]`` is the element count of an intermediate per batch element. Every index joins two places, so
    |A|·|B|·|C| = (M·K·N)² and the GEMM's FLOPs are 2·sqrt(|A|·|B|·|C|) — b included when A or B holds x.
    """
    sa, sb, sc = sizes[left], sizes[right], sizes[left | right]
    flops = 2 * math.isqrt(sa * sb * sc)
    batched = (left | right) & 1
    a_batched, b_batched = left & 1, right & 1

    def per(n: int, has_b: int) -> Linear:
        return (0, n) if has_b else (n, 0)

    moved = _add(_add(per(sa, a_batched), per(sb, b_batched)), per(sc, batched))
    step_flops = per(flops, batched)
    if not model.backward:
        return CostTerms(
            flops_forward=step_flops, bytes_forward=_scale(moved, model.itemsize), gemms=(1, 0), launches=(1, 0)
        )
    grad_a = left != 1 << X or model.x_requires_grad
    grad_b = right != 1 << X or model.x_requires_grad
    grads = grad_a + grad_b
    saved = (0, 0)
    if grad_b and a_batched:  # dB = Aᵀ·dC keeps A alive
        saved = _add(saved, per(sa, 1))
    if grad_a and b_batched:
        saved = _add(saved, per(sb, 1))
    return CostTerms(
        flops_forward=step_flops,
        flops_backward=_scale(step_flops, grads),
        bytes_forward=_scale(moved, model.itemsize),
        bytes_backward=_scale(moved, grads * model.itemsize),
        bytes_saved=_scale(saved, model.itemsize),
        gemms=(1 + grads, 0),
        launches=(1 + grads, 0),
    )


def _copy_terms(copied: Sequence[tuple[int, bool, bool]], model: CostModel) -> CostTerms:
    """Bytes of permute copies: (elements per batch element or in all, batched, needs a gradient) per copy.

    Forward reads and writes the tensor once; backward copies its gradient back into the stored order when it
    needs one (the inverse permute of a contiguous gradient is not a view of the stored shape). Each copy is a
    kernel launched, forward and (with a gradient) backward, whatever its size: ``launches`` is independent of b.
    """
    total, kernels = (0, 0), 0
    for n, batched, needs_grad in copied:
        times = 2 * (1 + (model.backward and needs_grad))
        total = _add(total, (0, n * times) if batched else (n * times, 0))
        kernels += times // 2
    return CostTerms(bytes_copied=_scale(total, model.itemsize), launches=(kernels, 0))


@dataclass(frozen=True)
class ScaledWeights:
    """A ``CostModel``'s weights times ``scale`` (the least common denominator of alpha, beta and gamma): integers
    per FLOP, per element moved or copied (alpha · itemsize), per element saved (beta · itemsize), per GEMM and per
    kernel launched (``launch``: a step's GEMMs here, a copy's kernels in ``scaled_copy_launches``).

    Why: the exact search weighs a step for every split of every subset (millions on a 13-tensor network), where
    building a ``CostTerms`` and weighing it in Fractions would take minutes; integer sums are exact too. So
    ``scaled_step`` / ``scaled_copy`` weigh ``_step_terms`` / ``_copy_terms``'s counts with these: ``scale`` times
    their ``CostTerms.weighted`` cost (tests/test_plan.py checks the two agree).
    """

    scale: int
    flop: int
    element: int
    saved: int
    gemm: int
    backward: bool
    launch: int = 0

    @classmethod
    def of(cls, model: CostModel) -> "ScaledWeights":
        alpha, beta, gamma = model.weights
        launch = model.launch_weight
        scale = math.lcm(alpha.denominator, beta.denominator, gamma.denominator, launch.denominator)
        return cls(
            scale,
            scale,
            int(alpha * scale) * model.itemsize,
            int(beta * scale) * model.itemsize,
            int(gamma * scale),
            model.backward,
            int(launch * scale),
        )


def scaled_step(
    sa: int, sb: int, sc: int, a_batched: bool, b_batched: bool, grad_a: bool, grad_b: bool, w: ScaledWeights
) -> Linear:
    """(c0, c1) of one pairwise GEMM C = A·B weighed by ``w``: ``_step_terms``'s counts, from the element counts of
    A, B and C (per batch element where batched) and which operands hold x or need a gradient."""
    flops = 2 * math.isqrt(sa * sb * sc)
    c0 = c1 = 0
    for n, batched in ((sa, a_batched), (sb, b_batched), (sc, a_batched or b_batched)):
        if batched:
            c1 += w.element * n
        else:
            c0 += w.element * n
    if a_batched or b_batched:
        c1 += w.flop * flops
    else:
        c0 += w.flop * flops
    times = 1 + (grad_a + grad_b if w.backward else 0)  # forward, and one GEMM per gradient backward
    c0, c1 = (c0 + w.gemm + w.launch) * times, c1 * times
    if w.backward:  # the batched operand a gradient GEMM needs stays alive until backward
        c1 += w.saved * (sa * (grad_b and a_batched) + sb * (grad_a and b_batched))
    return c0, c1


def scaled_copy(n: int, needs_grad: bool, w: ScaledWeights) -> int:
    """One permute copy of ``n`` elements weighed by ``w`` (``_copy_terms``): read + write forward, and again for
    its gradient backward. Its kernels' launch cost is apart (``scaled_copy_launches``): it does not grow with b."""
    return w.element * n * 2 * (1 + (w.backward and needs_grad))


def scaled_copy_launches(needs_grad: bool, w: ScaledWeights) -> int:
    """The b-independent part of one permute copy weighed by ``w``: its kernel forward, and backward with a
    gradient (``_copy_terms``' launches)."""
    return w.launch * (1 + (w.backward and needs_grad))


def _scale(a: Linear, k: int) -> Linear:
    return (a[0] * k, a[1] * k)


@lru_cache(maxsize=64)
def _subset_sizes(net: TTNetwork) -> tuple[int, ...]:
    """Element count per batch element of the intermediate of every subset of tensors (bitmask -> int).

    Built incrementally: adding tensor t to a subset multiplies by |t| and divides by the squared size of the
    indices they share (those become internal).
    """
    masks = [sum(1 << i for i in idx if i != _B) for idx in net.tensor_indices]
    own = [net.size(idx) for idx in net.tensor_indices]
    n = net.n_tensors
    open_masks, sizes = [0] * (1 << n), [1] * (1 << n)
    for subset in range(1, 1 << n):
        low = subset & -subset
        t, prev = low.bit_length() - 1, subset ^ low
        open_masks[subset] = open_masks[prev] ^ masks[t]
        shared = math.prod(net.sizes[i] for i in _bits(open_masks[prev] & masks[t]))
        sizes[subset] = sizes[prev] * own[t] // (shared * shared)
    return tuple(sizes)


def _num(value) -> str:
    """A number for tables: exact when small and whole, else 4 significant digits."""
    value = Fraction(value)
    if value.denominator == 1 and abs(value) < 10**6:
        return str(value.numerator)
    return f"{float(value):.4g}"
