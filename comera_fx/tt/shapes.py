"""Factorise feature sizes into tensor modes.

Pure integer helpers: no tensors, no torch. A TT layer reshapes a feature axis of size ``n`` into ``d`` modes whose
product is ``n`` (or a slightly larger padded size); how balanced those modes are decides how much a given rank
compresses, so sizes that factor badly (primes, 50257, 30522) are padded to a nearby smooth size. Padding never
changes results: the layers slice padded rows/columns away.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

# A factorisation is "good" when its largest mode is at most this factor above the perfectly balanced mode
# n ** (1/d). 2.0 accepts powers of two (1024 = 16·8·8) and CoMERA's modes (768 = 12·8·8) and rejects
# sizes with a large prime factor (30522 = 2·3·5087, 50257 = 29·1733).
BALANCE_TOLERANCE = 2.0
# Modes this small are always acceptable: a TT core with a mode of 8 is cheap whatever the balance.
SMALL_MODE = 8
MAX_AUTO_MODES = 6


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return tuple(sorted(set(small + [n // k for k in small])))


@functools.lru_cache(maxsize=65536)
def balanced_factors(n: int, d: int) -> tuple[int, ...]:
    """Split ``n`` into ``d`` factors (1s allowed) whose largest factor is as small as possible.

    Returns the factors in non-increasing order; ``math.prod(result) == n`` always holds. Brute force over
    divisors, which is instant for feature sizes (< 10^7) and the few modes TT layers use.
    """
    if n < 1 or d < 1:
        raise ValueError(f"balanced_factors needs n >= 1 and d >= 1, got n={n}, d={d}")
    if d == 1:
        return (n,)
    best: tuple[int, ...] | None = None
    # The largest factor is at least the d-th root; try candidates upwards and stop at the first feasible one.
    lower = max(1, math.ceil(round(n ** (1.0 / d), 9)))
    for first in _divisors(n):
        if first < lower:
            continue
        rest = _factors_at_most(n // first, d - 1, first)
        if rest is not None:
            best = (first, *rest)
            break
    assert best is not None  # first = n, rest = (1, ..., 1) always works
    return best


@functools.lru_cache(maxsize=65536)
def _factors_at_most(n: int, d: int, cap: int) -> tuple[int, ...] | None:
    """Balanced factorisation of n into d factors, each <= cap, or None."""
    if d == 1:
        return (n,) if n <= cap else None
    lower = max(1, math.ceil(round(n ** (1.0 / d), 9)))
    for first in _divisors(n):
        if first < lower:
            continue
        if first > cap:
            return None
        rest = _factors_at_most(n // first, d - 1, first)
        if rest is not None:
            return (first, *rest)
    return None


def is_well_factored(modes: tuple[int, ...]) -> bool:
    """True when the largest mode is small or within BALANCE_TOLERANCE of the balanced mode."""
    n = math.prod(modes)
    biggest = max(modes)
    return biggest <= SMALL_MODE or biggest <= BALANCE_TOLERANCE * n ** (1.0 / len(modes))


def auto_num_modes(n: int) -> int:
    """Number of modes for a feature size: about one mode per factor of 10 (768 -> 3, 4096 -> 4, 50257 -> 5)."""
    return min(MAX_AUTO_MODES, max(2, round(math.log10(max(n, 1)))))


class NoBalancedModes(ValueError):
    """No size within the allowed padding splits into balanced modes (``choose_modes``)."""


def choose_modes(n: int, d: int, *, max_pad_fraction: float = 0.25) -> tuple[int, ...]:
    """Modes for a feature axis of size ``n``: ``d`` balanced factors of the smallest well-factored ``n' >= n``.

    ``math.prod(result) >= n``; the difference is padding that the layers slice away. Raises ValueError when no
    size within ``n * (1 + max_pad_fraction)`` factors well (``NoBalancedModes``, a ValueError); pass explicit
    modes or fewer modes then.
    """
    if n < 1:
        raise ValueError(f"feature size must be >= 1, got {n}")
    if d < 1:
        raise ValueError(f"number of modes must be >= 1, got {d}")
    limit = math.floor(n * (1.0 + max_pad_fraction))
    for candidate in range(n, max(limit, n) + 1):
        modes = balanced_factors(candidate, d)
        if is_well_factored(modes):
            return modes
    raise NoBalancedModes(
        f"no size in [{n}, {limit}] splits into {d} balanced modes; pass explicit modes or a different num_modes"
    )


def order_for_chain(modes: tuple[int, ...], *, largest_first: bool) -> tuple[int, ...]:
    """Order modes so the largest sit at the ends of a TT chain.

    The bond next to an end core is bounded by that core's mode (r_1 <= n_1), so large outer modes allow larger
    ranks for the same parameters. CoMERA uses 12,8,8 | 8,8,12 for the same reason.
    """
    return tuple(sorted(modes, reverse=largest_first))


def feasible_ranks(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Full (exact) TT ranks of a chain over ``dims``: r_k = min(prod(dims[:k]), prod(dims[k:])), r_0 = r_d = 1."""
    ranks = [1]
    for k in range(1, len(dims)):
        ranks.append(min(math.prod(dims[:k]), math.prod(dims[k:])))
    ranks.append(1)
    return tuple(ranks)


def capped_ranks(dims: tuple[int, ...], max_rank: int | None, rank_ratio: float | None = None) -> tuple[int, ...]:
    """Bond ranks for a chain: the feasible ranks, scaled by ``rank_ratio`` and capped by ``max_rank``.

    A cap above what the chain can use is clamped to the feasible rank, so a huge ``max_rank`` means "exact".
    """
    ranks = list(feasible_ranks(dims))
    for k in range(1, len(ranks) - 1):
        r = ranks[k]
        if rank_ratio is not None:
            # Clamped like max_rank: a ratio above 1 must not ask for more than the chain can use.
            r = min(r, max(1, math.ceil(rank_ratio * r)))
        if max_rank is not None:
            r = min(r, max_rank)
        ranks[k] = r
    return tuple(ranks)


def chain_params(dims: Sequence[int], ranks: Sequence[int]) -> int:
    """Parameters of a TT/TTM chain with these dims (``layout.chain_dims``) and bond ranks: the cores,
    sum r_k·n_k·r_{k+1}, plus one gate entry per internal bond slot."""
    cores = sum(ranks[k] * dims[k] * ranks[k + 1] for k in range(len(dims)))
    return cores + sum(ranks[1:-1])
