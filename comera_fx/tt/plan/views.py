"""How ``execute`` sees each stored operand of a step: as is, transposed, or through a permute (a copy).

Pure index bookkeeping, no tensors: the rule ``execution`` follows when it runs a plan is the rule the cost model
(``Plan.from_tree``) and the search (``subset_dp``) count copies by, so it lives below all three.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .network import _B, TTNetwork


def _operand_view(order: tuple[int, ...], first: tuple[int, ...], second: tuple[int, ...], batched: bool):
    """How to see a stored tensor (indices ``order``) as the matrix (first × second) without copying if possible.

    Returns ("view",) when order is first + second, ("t",) when it is second + first (a transposed view; never
    for a batched tensor, whose batch must stay leading), else ("permute", perm).
    """
    body = order[1:] if batched else order
    if body == first + second:
        return ("view",)
    if not batched and body == second + first:
        return ("t",)
    wanted = ((_B,) if batched else ()) + first + second
    return ("permute", tuple(order.index(i) for i in wanted))


def _step_views(net: TTNetwork, order_a: tuple[int, ...], order_b: tuple[int, ...], batched: bool):
    """How ``execute`` runs one step on operands stored with index orders ``order_a`` (left) and ``order_b``.

    Returns (view_a, view_b, result order, copy_a, copy_b): the views of ``_operand_view``, the stored order of
    the GEMM's result, (b?, left's free indices, right's free indices), and whether each operand goes through a
    permute copy (a permute that torch can still view, ``_permute_copies``, is no copy). Of the two orders of the
    contracted indices (as stored in A, or in B) the one copying fewer
    elements wins, batch-dependent elements first; a tie keeps A's order. The cost model counts exactly these
    copies (``Plan.from_tree`` and the search call this same rule, ``_step_copies``).
    """
    order, copy_a, copy_b, shared = _step_copies(net.sizes, order_a, order_b, batched)
    free_a = tuple(i for i in order_a if i not in shared and i != _B)
    free_b = tuple(i for i in order_b if i not in shared)
    view_a = _operand_view(order_a, free_a, shared, batched)
    view_b = _operand_view(order_b, shared, free_b, False)
    return view_a, view_b, order, copy_a, copy_b


def _permute_copies(
    sizes: Sequence[int], order: tuple[int, ...], first: tuple[int, ...], second: tuple[int, ...], batched: bool
) -> bool:
    """Does ``reshape(permute(t))`` copy, for t stored contiguously with indices ``order``, read as the matrix
    (b? + first) × second? torch.reshape views whenever, within each of the two groups, consecutive dimensions of
    size > 1 are still adjacent in memory (size-1 dimensions never matter); else it copies. b counts as > 1."""
    dims = [i for i in order]
    stride, strides = 1, {}
    for i in reversed(dims):
        strides[i] = stride
        stride *= 1 if i == _B else sizes[i]
    for group in (((_B,) if batched else ()) + first, second):
        kept = [i for i in group if i == _B or sizes[i] != 1]
        for i, j in zip(kept, kept[1:]):
            if strides[i] != strides[j] * sizes[j] and not (j == _B):
                return True
    return False


def _final_copies(sizes: Sequence[int], final: tuple[int, ...], output: tuple[int, ...]) -> bool:
    """Does the reorder of the last result (stored as ``final``) into ``output`` = (b, output modes) copy?"""
    return final != output and _permute_copies(sizes, final, (), output[1:], True)


def _step_copies(sizes: Sequence[int], order_a: tuple[int, ...], order_b: tuple[int, ...], batched: bool):
    """The rule of ``_step_views`` without building views: (result order, copy_a, copy_b, shared indices in the
    order used). A view needs the operand stored as (free, shared) / (shared, free), or the reverse for a
    transposed view (never for the batched operand)."""
    set_a, set_b = set(order_a), set(order_b)
    shared_a = tuple(i for i in order_a if i in set_b)
    shared_b = tuple(i for i in order_b if i in set_a)
    free_a = tuple(i for i in order_a if i not in set_b and i != _B)
    free_b = tuple(i for i in order_b if i not in set_a)
    body_a = order_a[1:] if batched else order_a
    result = ((_B,) if batched else ()) + free_a + free_b

    def copies(shared):
        copy_a = (
            body_a != free_a + shared
            and (batched or body_a != shared + free_a)
            and _permute_copies(sizes, order_a, free_a, shared, batched)
        )
        copy_b = (
            order_b != shared + free_b
            and order_b != free_b + shared
            and _permute_copies(sizes, order_b, shared, free_b, False)
        )
        return copy_a, copy_b

    first = copies(shared_a)
    if shared_b == shared_a or not (first[0] or first[1]):
        return result, first[0], first[1], shared_a
    second = copies(shared_b)
    size_a = math.prod(sizes[i] for i in body_a)
    size_b = math.prod(sizes[i] for i in order_b)

    def key(c):
        return (c[0] * size_a, c[1] * size_b) if batched else (0, c[0] * size_a + c[1] * size_b)

    if key(second) < key(first):
        return result, second[0], second[1], shared_b
    return result, first[0], first[1], shared_a
