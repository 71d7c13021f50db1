"""A bank of experts in TT form: one ``TTMatrix`` per expert, each with its own cores and gates.

A mixture-of-experts layer stores each projection as one 3D parameter P (experts × a × b) and uses its slices:
``F.linear(x, P[e])`` (P[e] is out × in, transformers' default) or ``x @ P[e]`` (P[e] is in × out, transformers'
``is_transposed`` layout and hand-written ``torch.bmm`` modules). ``TTExpertBank`` holds the same E matrices as E
independent TT matrices M_e, laid out as ``TTLinear`` lays out a weight (rows of M_e are the input features, so
M_e = P[e]ᵀ for a linear-read slice and P[e] for a matmul-read one), and multiplies one expert at a time with
that expert's planned product: no expert's dense weight is rebuilt on the training path.

Being an ``nn.ModuleList`` of ``TTMatrix``, every expert is found by ``RankAdaptive``, ``report`` and
``save_tensorized`` exactly as a layer's matrix is: ``bank[e]`` is expert e's matrix, named ``<bank>.<e>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..rmm.functions import rmm_tt_product
from ..tt.layers import TTMatrix, make_tt_matrix

#: How a slice P[e] is read: "linear" (y = x P[e]ᵀ, P[e] is out × in) or "matmul" (y = x P[e], P[e] is in × out).
SLICE_USES = ("linear", "matmul")


class TTExpertBank(nn.ModuleList):
    """E TT matrices standing for the slices P[e] of one 3D expert parameter P (E × a × b).

    ``slice_use`` says how the model reads a slice ("linear" or "matmul", see ``SLICE_USES``); M_e, the stored
    matrix, is P[e]ᵀ for "linear" and P[e] for "matmul", so that M_e's rows are always the input features.
    """

    def __init__(self, matrices: Sequence[TTMatrix], slice_use: str):
        if slice_use not in SLICE_USES:
            raise ValueError(f"slice_use must be one of {SLICE_USES}, got {slice_use!r}")
        if not matrices:
            raise ValueError("a TTExpertBank needs at least one expert")
        shapes = {(m.rows, m.cols) for m in matrices}
        if len(shapes) != 1:
            raise ValueError(f"the experts of one bank must have one shape; got {sorted(shapes)}")
        super().__init__(matrices)
        self.slice_use = slice_use
        self.rmm = None  # an RMMConfig once randomize_backward_ randomizes the experts' backward (moe/rmm.py)

    @classmethod
    def from_dense(
        cls, weight: Tensor, slice_use: str, *, generators: Sequence[torch.Generator | None] | None = None, **options
    ) -> "TTExpertBank":
        """TT-decompose (or randomly initialise) every slice of ``weight`` (E × a × b) with the same ``options``
        (those of ``make_tt_matrix``: format, init, max_rank, modes, ...), so all experts share one layout."""
        if weight.dim() != 3:
            raise ValueError(f"expert weights are 3D (experts × a × b), got shape {tuple(weight.shape)}")
        generators = generators or [None] * weight.shape[0]
        matrices = [
            make_tt_matrix(stored_matrix(p, slice_use), kind="linear", generator=g, **options)
            for p, g in zip(weight.detach(), generators)
        ]
        return cls(matrices, slice_use)

    # -- metadata ------------------------------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        return len(self)

    @property
    def in_features(self) -> int:
        return self[0].rows

    @property
    def out_features(self) -> int:
        return self[0].cols

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """The shape of the 3D parameter this bank replaced."""
        rows, cols = self.in_features, self.out_features
        return (len(self), cols, rows) if self.slice_use == "linear" else (len(self), rows, cols)

    def extra_repr(self) -> str:
        return (
            f"experts={len(self)}, in_features={self.in_features}, out_features={self.out_features}, "
            f"slice_use={self.slice_use!r}"
        )

    # -- math ----------------------------------------------------------------------------------------------------

    def linear(self, expert: int, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, P[e], bias)`` = x P[e]ᵀ, through expert e's planned TT product."""
        return self._product(expert, x, transposed=self.slice_use == "matmul", bias=bias)

    def project(self, expert: int, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """Expert e's projection of its tokens, x M_e (+ bias), whichever way the model stores P[e]: what an
        experts module computes (``F.linear(x, P[e])``, or ``x @ P[e]`` when it stores P[e] transposed)."""
        return self._product(expert, x, transposed=False, bias=bias)

    def mm(self, expert: int, x: Tensor) -> Tensor:
        """``x @ P[e]``."""
        return self._product(expert, x, transposed=self.slice_use == "linear")

    def _product(self, expert: int, x: Tensor, *, transposed: bool, bias: Tensor | None = None) -> Tensor:
        """x M_e or x M_eᵀ (+ bias); with ``rmm`` set and in training, the core gradients come from a sketch of
        ρ of this expert's tokens."""
        tt = self[expert]
        if self.rmm is not None and self.training and x.shape[0] > 0:
            y = rmm_tt_product(x, tt, transposed=transposed, rho=self.rmm.ratio, sketch=self.rmm.sketch)
            return y if bias is None else y + bias
        return tt.matmul_t(x, bias) if transposed else tt.matmul(x, bias)

    def dense_expert(self, expert: int) -> Tensor:
        """P[e] itself. Builds the matrix: for checks and for ops the bank has no TT product for."""
        m = self[expert].dense()
        return m.t() if self.slice_use == "linear" else m

    def dense(self) -> Tensor:
        """The whole 3D parameter P (E × a × b), rebuilt: for checks, not for the hot path."""
        return torch.stack([self.dense_expert(e) for e in range(len(self))])


def stored_matrix(slice_: Tensor, slice_use: str) -> Tensor:
    """M_e for a slice P[e]: rows are the input features."""
    return slice_.t() if slice_use == "linear" else slice_
