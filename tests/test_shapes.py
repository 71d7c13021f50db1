"""Properties of the integer helpers in comera_fx.tt.shapes, checked against brute force where that is cheap."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_fx.tt import shapes
from comera_fx.tt.shapes import (
    auto_num_modes,
    balanced_factors,
    capped_ranks,
    choose_modes,
    feasible_ranks,
    is_well_factored,
)

# The documented acceptance rule is restated below (doc_well_factored) so that choose_modes is checked against the
# docs, not against itself; only its two tunable constants are read from the module.
DOC_BALANCE_TOLERANCE = shapes.BALANCE_TOLERANCE
DOC_SMALL_MODE = shapes.SMALL_MODE


@functools.lru_cache(maxsize=None)
def brute_min_max_factor(n: int, d: int) -> int:
    """Smallest possible largest factor over all ways to write n as an ordered product of d factors (1s allowed)."""
    if d == 1:
        return n
    return min(max(f, brute_min_max_factor(n // f, d - 1)) for f in range(1, n + 1) if n % f == 0)


def doc_well_factored(n: int, d: int) -> bool:
    """Can n be split into d factors that the documented rule accepts? (Depends only on the best largest factor.)"""
    biggest = brute_min_max_factor(n, d)
    return biggest <= DOC_SMALL_MODE or biggest <= DOC_BALANCE_TOLERANCE * n ** (1.0 / d)


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, math.isqrt(n) + 1))


# ----------------------------------------------------------------------------------------------- balanced_factors


@given(n=st.integers(1, 10**6), d=st.integers(1, 6))
def test_balanced_factors_basic_properties(n, d):
    factors = balanced_factors(n, d)
    assert len(factors) == d
    assert math.prod(factors) == n
    assert all(isinstance(f, int) and f >= 1 for f in factors)
    assert list(factors) == sorted(factors, reverse=True)
    # The largest factor can never be below the d-th root.
    assert factors[0] ** d >= n


@given(n=st.integers(1, 600), d=st.integers(1, 4))
def test_balanced_factors_minimises_largest_factor(n, d):
    assert balanced_factors(n, d)[0] == brute_min_max_factor(n, d)


@pytest.mark.parametrize("n,d", [(64, 3), (4096, 4), (1000, 3), (10**6, 6), (2**20, 5), (3**12, 4), (7**6, 3)])
def test_balanced_factors_perfect_powers_and_round_numbers(n, d):
    # Sizes whose d-th root is (nearly) an integer exercise the floating-point lower bound of the search.
    factors = balanced_factors(n, d)
    assert math.prod(factors) == n
    root = round(n ** (1.0 / d))
    if root**d == n:
        assert factors == (root,) * d


@pytest.mark.parametrize("n,d", [(0, 2), (-3, 2), (5, 0), (5, -1)])
def test_balanced_factors_rejects_bad_arguments(n, d):
    with pytest.raises(ValueError):
        balanced_factors(n, d)


# --------------------------------------------------------------------------------------------------- choose_modes


@given(n=st.integers(1, 400), d=st.integers(1, 4), pad=st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5]))
def test_choose_modes_picks_the_smallest_acceptable_size(n, d, pad):
    """choose_modes returns d balanced factors of the first size >= n that the documented rule accepts."""
    limit = math.floor(n * (1.0 + pad))
    acceptable = [m for m in range(n, limit + 1) if doc_well_factored(m, d)]
    if not acceptable:
        with pytest.raises(ValueError):
            choose_modes(n, d, max_pad_fraction=pad)
        return
    modes = choose_modes(n, d, max_pad_fraction=pad)
    assert len(modes) == d
    assert math.prod(modes) == acceptable[0]
    assert max(modes) == brute_min_max_factor(acceptable[0], d)


@given(n=st.integers(1, 200_000), d=st.integers(1, 6), pad=st.sampled_from([0.1, 0.25, 0.5]))
def test_choose_modes_properties(n, d, pad):
    try:
        modes = choose_modes(n, d, max_pad_fraction=pad)
    except ValueError:
        # Only allowed when really nothing in the budget is acceptable; with the default budget and the automatic
        # number of modes this never happens (see test_choose_modes_auto_never_fails).
        assert d >= 2
        return
    padded = math.prod(modes)
    assert len(modes) == d
    assert n <= padded <= math.floor(n * (1 + pad))
    assert is_well_factored(modes)
    biggest = max(modes)
    assert biggest <= DOC_SMALL_MODE or biggest <= DOC_BALANCE_TOLERANCE * padded ** (1.0 / d)
    assert list(modes) == sorted(modes, reverse=True)


@given(n=st.integers(1, 200_000))
def test_choose_modes_auto_never_fails(n):
    d = auto_num_modes(n)
    assert 2 <= d <= 6
    modes = choose_modes(n, d)
    assert n <= math.prod(modes) <= math.floor(n * 1.25)


PRIMES = [p for p in range(9, 20_000) if is_prime(p)]


@given(p=st.sampled_from(PRIMES), d=st.integers(2, 5))
def test_choose_modes_pads_primes(p, d):
    # A prime p > SMALL_MODE only splits as (p, 1, ...), which is never balanced: it must be padded.
    try:
        modes = choose_modes(p, d)
    except ValueError:
        return
    assert math.prod(modes) > p


@pytest.mark.parametrize("n", [50257, 30522])
@pytest.mark.parametrize("d", [None, 2, 3, 4, 5])
def test_choose_modes_pads_badly_factored_vocab_sizes(n, d):
    d = d or auto_num_modes(n)
    assert not is_well_factored(balanced_factors(n, d))
    modes = choose_modes(n, d)
    assert math.prod(modes) > n
    assert math.prod(modes) <= n * 1.25
    assert is_well_factored(modes)


def test_choose_modes_known_sizes():
    assert choose_modes(768, 3) == (12, 8, 8)
    assert math.prod(choose_modes(3072, 3)) == 3072
    assert choose_modes(4096, 4) == (8, 8, 8, 8)
    assert auto_num_modes(768) == 3 and auto_num_modes(4096) == 4 and auto_num_modes(50257) == 5


@pytest.mark.parametrize("n,d", [(0, 2), (5, 0)])
def test_choose_modes_rejects_bad_arguments(n, d):
    with pytest.raises(ValueError):
        choose_modes(n, d)


# ------------------------------------------------------------------------------------- feasible / capped ranks

dims_strategy = st.lists(st.integers(1, 9), min_size=1, max_size=6).map(tuple)


@given(dims=dims_strategy)
def test_feasible_ranks_are_unfolding_ranks(dims):
    ranks = feasible_ranks(dims)
    assert len(ranks) == len(dims) + 1
    assert ranks[0] == 1 and ranks[-1] == 1
    for k in range(1, len(dims)):
        assert ranks[k] == min(math.prod(dims[:k]), math.prod(dims[k:]))
        # Consistency of a TT chain: a bond never exceeds what its neighbours can feed.
        assert ranks[k] <= ranks[k - 1] * dims[k - 1]
        assert ranks[k] <= ranks[k + 1] * dims[k]


@given(dims=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple), seed=st.integers(0, 2**31 - 1))
def test_feasible_ranks_equal_generic_tensor_unfolding_ranks(dims, seed):
    # A Gaussian tensor has full-rank unfoldings with probability 1: its TT ranks are exactly the feasible ones.
    g = torch.Generator().manual_seed(seed)
    tensor = torch.randn(dims, generator=g, dtype=torch.float64)
    ranks = feasible_ranks(dims)
    for k in range(1, len(dims)):
        unfolding = tensor.reshape(math.prod(dims[:k]), -1)
        assert torch.linalg.matrix_rank(unfolding).item() == ranks[k]


@given(dims=dims_strategy)
def test_capped_ranks_without_caps_or_with_huge_cap_is_feasible(dims):
    feasible = feasible_ranks(dims)
    assert capped_ranks(dims, None) == feasible
    assert capped_ranks(dims, 10**9) == feasible
    assert capped_ranks(dims, max(feasible)) == feasible
    assert capped_ranks(dims, 10**9, 1.0) == feasible


@given(
    dims=dims_strategy,
    max_rank=st.one_of(st.none(), st.integers(1, 100)),
    rank_ratio=st.one_of(st.none(), st.floats(0.01, 3.0)),
)
def test_capped_ranks_clamping(dims, max_rank, rank_ratio):
    feasible = feasible_ranks(dims)
    ranks = capped_ranks(dims, max_rank, rank_ratio)
    assert len(ranks) == len(feasible)
    assert ranks[0] == 1 and ranks[-1] == 1
    for k in range(1, len(dims)):
        expected = feasible[k]
        if rank_ratio is not None:
            expected = min(expected, max(1, math.ceil(rank_ratio * feasible[k])))
        if max_rank is not None:
            expected = min(expected, max_rank)
        assert ranks[k] == expected
        assert 1 <= ranks[k] <= feasible[k]  # never above what the chain can use, even for rank_ratio > 1
        if max_rank is not None:
            assert ranks[k] <= max_rank


@given(dims=dims_strategy, a=st.integers(1, 50), b=st.integers(1, 50))
def test_capped_ranks_monotone_in_cap(dims, a, b):
    low, high = sorted((a, b))
    assert all(x <= y for x, y in zip(capped_ranks(dims, low), capped_ranks(dims, high)))


def test_capped_ranks_examples():
    dims = (12, 8, 8, 8, 8, 12)  # CoMERA's 768 x 768 layout
    assert feasible_ranks(dims) == (1, 12, 96, 768, 96, 12, 1)
    assert capped_ranks(dims, 64) == (1, 12, 64, 64, 64, 12, 1)
    assert capped_ranks(dims, None, 0.5) == (1, 6, 48, 384, 48, 6, 1)
    assert capped_ranks(dims, 100, 0.5) == (1, 6, 48, 100, 48, 6, 1)
    assert capped_ranks((2, 3, 4), None, 1.5) == feasible_ranks((2, 3, 4))
