"""Static description of a TT-parameterised matrix: format, modes, ranks, logical size.

Everything the contraction code needs besides the tensors themselves, as plain integers, so the same functions run
eagerly on tensors and symbolically on FX proxies (which cannot answer ``.shape`` with integers).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from . import decompose
from .shapes import chain_params


class TTFormat(str, enum.Enum):
    """How a matrix is split into cores.

    TT: 3-way cores over row modes then column modes (CoMERA's layout for linear layers; the middle bond is the
    matrix rank). TTM: 4-way cores with one row and one column mode each (CoMERA's layout for embedding tables).
    """

    TT = "tt"
    TTM = "ttm"


def chain_dims(format: TTFormat, row_modes: tuple[int, ...], col_modes: tuple[int, ...]) -> tuple[int, ...]:
    """The chain's dims, one per core: TT, row modes then column modes; TTM, row·column mode per core."""
    if format is TTFormat.TT:
        return tuple(row_modes) + tuple(col_modes)
    return tuple(a * b for a, b in zip(row_modes, col_modes))


@dataclass(frozen=True)
class TTLayout:
    """Shape metadata of a TT matrix ``M`` (rows × cols), padded to (prod row_modes × prod col_modes)."""

    format: TTFormat
    rows: int
    cols: int
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.padded_rows < self.rows or self.padded_cols < self.cols:
            raise ValueError(
                f"modes {self.row_modes} x {self.col_modes} cannot hold a {self.rows} x {self.cols} matrix"
            )
        n_cores = len(self.row_modes) + len(self.col_modes) if self.format is TTFormat.TT else len(self.row_modes)
        if self.format is TTFormat.TTM and len(self.row_modes) != len(self.col_modes):
            raise ValueError(f"TTM needs as many row as column modes, got {self.row_modes} and {self.col_modes}")
        if len(self.ranks) != n_cores + 1 or self.ranks[0] != 1 or self.ranks[-1] != 1:
            raise ValueError(
                f"{self.format.value} layout with {n_cores} cores needs ranks (1, ..., 1) of length "
                f"{n_cores + 1}, got {self.ranks}"
            )

    @property
    def padded_rows(self) -> int:
        return math.prod(self.row_modes)

    @property
    def padded_cols(self) -> int:
        return math.prod(self.col_modes)

    @property
    def n_cores(self) -> int:
        return len(self.ranks) - 1

    @property
    def core_ndim(self) -> int:
        return 3 if self.format is TTFormat.TT else 4

    @property
    def core_shapes(self) -> list[tuple[int, ...]]:
        if self.format is TTFormat.TT:
            return decompose.tt_core_shapes(self.row_modes, self.col_modes, self.ranks)
        return decompose.ttm_core_shapes(self.row_modes, self.col_modes, self.ranks)

    @property
    def internal_ranks(self) -> tuple[int, ...]:
        return self.ranks[1:-1]

    @property
    def chain_dims(self) -> tuple[int, ...]:
        return chain_dims(self.format, self.row_modes, self.col_modes)

    @property
    def num_params(self) -> int:
        """Cores + gates (one gate entry per internal bond slot)."""
        return chain_params(self.chain_dims, self.ranks)

    @property
    def dense_params(self) -> int:
        return self.rows * self.cols

    @property
    def compression(self) -> float:
        """Dense / TT parameters; infinite once rank adaptation removed the whole matrix."""
        return self.dense_params / self.num_params if self.num_params else math.inf

    def with_ranks(self, ranks: tuple[int, ...]) -> "TTLayout":
        return TTLayout(self.format, self.rows, self.cols, self.row_modes, self.col_modes, tuple(ranks))

    def to_json(self) -> dict:
        """The layout as the JSON fields a checkpoint manifest stores (``from_json`` inverts it)."""
        return {
            "format": self.format.value,
            "rows": self.rows,
            "cols": self.cols,
            "row_modes": list(self.row_modes),
            "col_modes": list(self.col_modes),
            "ranks": list(self.ranks),
        }

    @classmethod
    def from_json(cls, entry: dict) -> "TTLayout":
        """The layout of a manifest entry written with ``to_json`` (other keys of the entry are ignored)."""
        return cls(
            TTFormat(entry["format"]),
            entry["rows"],
            entry["cols"],
            tuple(entry["row_modes"]),
            tuple(entry["col_modes"]),
            tuple(entry["ranks"]),
        )

    def describe_modes(self) -> str:
        """E.g. '768=12·8·8 | 50257→50336=13·11·11·8·4' — padding shown with an arrow."""

        def side(n: int, modes: tuple[int, ...]) -> str:
            padded = math.prod(modes)
            size = f"{n}→{padded}" if padded != n else f"{n}"
            return f"{size}={'·'.join(map(str, modes))}"

        return f"{side(self.rows, self.row_modes)} | {side(self.cols, self.col_modes)}"
