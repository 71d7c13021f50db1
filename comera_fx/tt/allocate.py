"""Rank allocation under a global parameter budget: which bond of which layer gets how much rank.

Pure functions: ints and 1-D energy tensors in, rank tuples out (``bond_energies`` is the one helper that reads a
tensor). A layer is described by its chain dims (TT: row modes + column modes; TTM: row·col per core); its
parameter count for bond ranks r is ``shapes.chain_params`` (cores + one gate entry per internal bond slot, as
``TTLayout.num_params``).

* ``uniform_ranks``: one max_rank for every layer, the largest whose total fits the budget.
* ``allocate_ranks``: ranks per layer *and per bond*, greedy on the energy gained per parameter. The TT-SVD error
  obeys ||A - TT||² <= sum over bonds of the squared singular values cut at that bond, so raising bond k of a layer
  from r to r + 1 buys (at most) energy σ_{k, r+1}² for the parameters it adds. The greedy takes the best buy that
  still fits, until none does. Energies are what the caller passes: the squared singular values of each bond's
  unfolding, divided by the layer's total energy (relative errors: every layer counts alike) and, for layers with
  calibration, of the whitened matrix C^{1/2}·M (``tt.whiten``), so energy means output error on real inputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .shapes import capped_ranks, chain_params, feasible_ranks


class BudgetTooSmall(ValueError):
    """Even rank 1 at every bond needs more parameters than the budget."""


def bond_energies(chain: Tensor) -> list[Tensor]:
    """Squared singular values (non-increasing, float64) of each internal bond's unfolding of a chain tensor.

    Bond k (1 <= k < ndim) splits the dims into dims[:k] × dims[k:].
    """
    work = chain.detach().to(torch.float64)
    dims = tuple(work.shape)
    out = []
    for k in range(1, len(dims)):
        unfolding = work.reshape(math.prod(dims[:k]), -1)
        out.append(torch.linalg.svdvals(unfolding) ** 2)
    return out


def uniform_ranks(layer_dims: Sequence[Sequence[int]], budget: int) -> tuple[int, list[tuple[int, ...]]]:
    """(max_rank, ranks per layer): the largest single max_rank whose total parameters fit ``budget``.

    Raises ``BudgetTooSmall`` when max_rank 1 already exceeds it. The total grows with max_rank, so the next
    max_rank would overshoot: the budget is met within one rank step.
    """
    dims_list = [tuple(d) for d in layer_dims]

    def total(r: int) -> int:
        return sum(chain_params(d, capped_ranks(d, r)) for d in dims_list)

    if total(1) > budget:
        raise BudgetTooSmall(
            f"a size target of {budget:,} parameters is below the smallest TT of these layers "
            f"(rank 1 everywhere: {total(1):,} parameters)"
        )
    top = max((max(feasible_ranks(d)) for d in dims_list), default=1)
    low, high = 1, top  # total(low) <= budget; find the largest such r by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if total(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low, [capped_ranks(d, low) for d in dims_list]


def allocate_ranks(
    layer_dims: Sequence[Sequence[int]],
    energies: Sequence[Sequence[Tensor | Sequence[float]]],
    budget: int,
) -> list[tuple[int, ...]]:
    """Bond ranks per layer maximising the kept energy under ``budget`` total parameters (greedy).

    ``energies[l][k - 1]`` are layer l's energies at bond k, non-increasing (the i-th entry is what raising the
    bond from rank i to i + 1 keeps). Every bond starts at rank 1; a bond can rise while it has energy left, stays
    within the chain's feasible rank and stays consistent with its neighbours (r_k <= r_{k-1}·n_{k-1} and
    r_k <= n_k·r_{k+1}: a larger rank would have no singular value to keep). Each step takes the raise with the
    largest energy per added parameter that fits what is left of the budget; the parameters a raise adds grow
    when a neighbour rises, so the heap is re-checked lazily. Stops when no raise fits: the total is then within
    one raise of the budget. Raises ``BudgetTooSmall`` if rank 1 everywhere does not fit.
    """
    dims_list = [tuple(d) for d in layer_dims]
    if len(energies) != len(dims_list):
        raise ValueError(f"got energies for {len(energies)} layers and dims for {len(dims_list)}")
    gains: list[list[list[float]]] = []
    for dims, layer in zip(dims_list, energies):
        if len(layer) != len(dims) - 1:
            raise ValueError(
                f"a chain over {len(dims)} dims has {len(dims) - 1} internal bonds, got energies for {len(layer)}"
            )
        gains.append([[float(x) for x in bond] for bond in layer])
    ranks = [[1] * (len(d) + 1) for d in dims_list]
    left = budget - sum(chain_params(d, r) for d, r in zip(dims_list, ranks))
    if left < 0:
        raise BudgetTooSmall(
            f"a size target of {budget:,} parameters is below the smallest TT of these layers "
            f"(rank 1 everywhere: {budget - left:,} parameters)"
        )
    caps = [feasible_ranks(d) for d in dims_list]

    def raise_cost(l: int, k: int) -> int:
        d, r = dims_list[l], ranks[l]
        return r[k - 1] * d[k - 1] + d[k] * r[k + 1] + 1

    def can_raise(l: int, k: int) -> bool:
        d, r = dims_list[l], ranks[l]
        new = r[k] + 1
        return (
            new <= caps[l][k] and r[k] < len(gains[l][k - 1]) and new <= r[k - 1] * d[k - 1] and new <= d[k] * r[k + 1]
        )

    heap: list[tuple[float, int, int, int, int]] = []

    def push(l: int, k: int) -> None:
        if 1 <= k < len(dims_list[l]) and can_raise(l, k):
            cost = raise_cost(l, k)
            heapq.heappush(heap, (-gains[l][k - 1][ranks[l][k]] / cost, l, k, ranks[l][k], cost))

    for l, d in enumerate(dims_list):
        for k in range(1, len(d)):
            push(l, k)
    while heap:
        _, l, k, at, cost = heapq.heappop(heap)
        if ranks[l][k] != at or not can_raise(l, k):
            continue  # stale: this bond rose since, or can no longer
        now = raise_cost(l, k)
        if now != cost:
            push(l, k)  # a neighbour rose: re-rank with the new price
            continue
        if cost > left:
            continue  # costs only grow and the budget only shrinks: it never fits again
        ranks[l][k] += 1
        left -= cost
        for j in (k - 1, k, k + 1):
            push(l, j)
    return [tuple(r) for r in ranks]
