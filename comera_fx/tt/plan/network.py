"""The tensor network of ``x @ M`` for one layout (``TTNetwork``, ``build_network``) and contraction trees.

``Tree`` is a tensor id or a pair of subtrees; ``_canonical`` / ``_leaves`` normalise and read trees (used by the
plans and the search alike). Pure: integers only, no torch, no sympy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

from ..layout import TTFormat, TTLayout


OPS = ("matmul", "matmul_t")

_B = 0  # id of the batch index in every network
X = 0  # id of the activation among the network's tensors

#: A contraction tree: a tensor id (leaf) or a pair of subtrees.
Tree = Union[int, tuple["Tree", "Tree"]]
#: A cost linear in the batch: (c0, c1) means c0 + c1·b (ints, or Fractions once weighted).
Linear = tuple


@dataclass(frozen=True)
class TTNetwork:
    """The tensor network of ``x @ M`` (op "matmul") or ``x @ Mᵀ`` ("matmul_t") for one layout.

    Index 0 is the batch ``b`` (its ``sizes`` entry is a placeholder 1). Tensor 0 is x, tensor k is core k; each
    tensor lists its indices in storage order (row-major), with the boundary bonds of size 1 left out. ``output``
    lists the result's indices in storage order: b, then the output modes.
    """

    layout: TTLayout
    op: str
    index_names: tuple[str, ...]
    sizes: tuple[int, ...]
    tensor_names: tuple[str, ...]
    tensor_indices: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]

    @property
    def n_tensors(self) -> int:
        return len(self.tensor_names)

    @property
    def in_modes(self) -> tuple[int, ...]:
        return self.layout.row_modes if self.op == "matmul" else self.layout.col_modes

    @property
    def out_modes(self) -> tuple[int, ...]:
        return self.layout.col_modes if self.op == "matmul" else self.layout.row_modes

    def open_indices(self, mask: int) -> frozenset[int]:
        """Indices of the intermediate made of the tensors in ``mask``: those with exactly one end inside."""
        seen: set[int] = set()
        for t in _bits(mask):
            seen ^= set(self.tensor_indices[t])
        return frozenset(seen)

    def size(self, indices: Iterable[int]) -> int:
        """Product of the sizes of ``indices``, the batch left out (it is carried as a flag)."""
        return math.prod(self.sizes[i] for i in indices if i != _B)


def build_network(layout: TTLayout, op: str = "matmul") -> TTNetwork:
    """The network of ``x @ M`` / ``x @ Mᵀ`` on the padded layout (ops.py pads x and trims the result around it)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    names, sizes = ["b"], [1]

    def new_index(name: str, size: int) -> int:
        names.append(name)
        sizes.append(size)
        return len(names) - 1

    rows = [new_index(f"i{k + 1}", m) for k, m in enumerate(layout.row_modes)]
    cols = [new_index(f"j{k + 1}", m) for k, m in enumerate(layout.col_modes)]
    n = layout.n_cores
    bonds = [None] + [new_index(f"r{k}", layout.ranks[k]) for k in range(1, n)] + [None]
    if layout.format is TTFormat.TT:
        modes = [[i] for i in rows + cols]
    else:
        modes = [[i, j] for i, j in zip(rows, cols)]
    cores = [tuple(i for i in [bonds[k], *modes[k], bonds[k + 1]] if i is not None) for k in range(n)]
    x_side, out_side = (rows, cols) if op == "matmul" else (cols, rows)
    return TTNetwork(
        layout=layout,
        op=op,
        index_names=tuple(names),
        sizes=tuple(sizes),
        tensor_names=("x",) + tuple(f"G{k + 1}" for k in range(n)),
        tensor_indices=((_B, *x_side),) + tuple(cores),
        output=(_B, *out_side),
    )


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _canonical(node: Tree) -> Tree:
    """Order children so the one holding the lowest tensor id comes first (x, if present, is always left)."""
    if isinstance(node, int):
        return node
    left, right = _canonical(node[0]), _canonical(node[1])
    return (left, right) if _lowest(left) < _lowest(right) else (right, left)


def _lowest(node: Tree) -> int:
    return node if isinstance(node, int) else min(_lowest(node[0]), _lowest(node[1]))


def _leaves(node: Tree) -> list[int]:
    return [node] if isinstance(node, int) else _leaves(node[0]) + _leaves(node[1])
