"""The shared form: one TT chain for all the experts of a projection, with a small core per expert.

The E matrices M_e (in × out) side by side form one matrix [M_0 | M_1 | … ] (in × E·out) whose column modes start
with the expert mode E. Its TT chain is G_1 … G_k · X · G_{k+1} … G_d, with X (r_k × E × r_{k+1}) the only core that
depends on the expert: expert e's matrix is the chain with X[:, e, :], an r_k × r_{k+1} matrix, in X's place. The
experts of one layer are trained on similar data, and this is where sharing structure pays: every other core is
stored once. At full ranks TT-SVD makes it exact, like the per-expert form.

It is one ordinary ``TTMatrix`` (gates on every bond, the expert bonds included), so ``RankAdaptive`` adapts its
ranks, and each expert's product is a planned product of the chain with X[:, e, :] folded into the next core.
``state_dict`` and ``save_tensorized`` / ``load_tensorized`` carry it. ``tensorize_`` builds it for transformers
experts modules with ``TensorizeConfig(expert_form="shared")``; by hand: ``SharedTTExpertBank.from_dense`` and
``TTExperts.from_hf`` (benchmarks/bench_moe.py does).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..rmm.functions import rmm_tt_product
from ..tt import plan as planner
from ..tt.layers import CUSTOM_AUTOGRAD, TTMatrix, choose_layout_modes
from ..tt.plan_cache import choose_plan, planned_envelope
from ..tt.layout import TTFormat, TTLayout
from .bank import SLICE_USES, stored_matrix


def stacked_experts(weight: Tensor, slice_use: str) -> Tensor:
    """[M_0 | M_1 | … ] (in × E·out): the matrix whose TT chain is the shared form of ``weight`` (E × a × b)."""
    return torch.cat([stored_matrix(p, slice_use) for p in weight.detach()], dim=1)


def shared_modes(rows: int, cols: int, experts: int, max_pad_fraction: float = 0.25):
    """(row modes, column modes) of the shared chain of ``experts`` matrices of rows × cols: the expert mode first
    among the column modes. The per-expert output size must factor without padding (ValueError otherwise)."""
    row_modes, col_modes = choose_layout_modes(rows, cols, TTFormat.TT, max_pad_fraction=max_pad_fraction)
    if torch.Size(col_modes).numel() != cols:
        raise ValueError(f"the shared form needs an output size that factors without padding; {cols} -> {col_modes}")
    return tuple(row_modes), (experts, *col_modes)


class SharedTTExpertBank(nn.Module):
    """E experts of one projection as one TT matrix with an expert mode (see the module docstring)."""

    def __init__(self, tt: TTMatrix, num_experts: int, slice_use: str):
        super().__init__()
        if slice_use not in SLICE_USES:
            raise ValueError(f"slice_use must be one of {SLICE_USES}, got {slice_use!r}")
        if tt.format is not TTFormat.TT or tt.col_modes[0] != num_experts or tt.cols % num_experts:
            raise ValueError(
                f"a shared bank needs a TT-format matrix whose first column mode is the expert mode "
                f"({num_experts}); got {tt.layout.describe_modes()}"
            )
        self.tt = tt
        self.num_experts = num_experts
        self.slice_use = slice_use
        self.rmm = None

    @classmethod
    def from_dense(
        cls,
        weight: Tensor,
        slice_use: str,
        *,
        max_rank: int | None = None,
        rank_ratio: float | None = None,
        rel_tol: float | None = None,
        max_pad_fraction: float = 0.25,
    ) -> "SharedTTExpertBank":
        """TT-SVD of the experts of ``weight`` (E × a × b) side by side, the expert mode first among the column
        modes (the middle of the chain). The per-expert output size must factor without padding."""
        experts = weight.shape[0]
        stacked = stacked_experts(weight, slice_use)
        row_modes, col_modes = shared_modes(stacked.shape[0], stacked.shape[1] // experts, experts, max_pad_fraction)
        tt = TTMatrix.from_matrix(
            stacked,
            format=TTFormat.TT,
            row_modes=row_modes,
            col_modes=col_modes,
            max_rank=max_rank,
            rank_ratio=rank_ratio,
            rel_tol=rel_tol,
        )
        return cls(tt, experts, slice_use)

    def __len__(self) -> int:
        return self.num_experts

    @property
    def in_features(self) -> int:
        return self.tt.rows

    @property
    def out_features(self) -> int:
        return self.tt.cols // self.num_experts

    def expert_layout(self) -> TTLayout:
        """The layout of one expert's chain (the expert core folded into the next one)."""
        layout, k = self.tt.layout, len(self.tt.row_modes)
        ranks = layout.ranks[: k + 1] + layout.ranks[k + 2 :]
        return TTLayout(TTFormat.TT, layout.rows, self.out_features, layout.row_modes, layout.col_modes[1:], ranks)

    def expert_cores(self, expert: int) -> list[Tensor]:
        """Expert ``expert``'s gated cores: X[:, e, :] folded into the core after it."""
        cores, k = self.tt.gated_cores(), len(self.tt.row_modes)
        merged = torch.einsum("ab,bnc->anc", cores[k][:, expert, :], cores[k + 1])
        return cores[:k] + [merged] + cores[k + 2 :]

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """The shape of the 3D parameter this bank replaced."""
        rows, cols = self.in_features, self.out_features
        return (self.num_experts, cols, rows) if self.slice_use == "linear" else (self.num_experts, rows, cols)

    def expert_chain(self, expert: int) -> "ExpertChain":
        """Expert ``expert``'s chain as the TT matrix ``rmm_tt_product`` multiplies (the RMM backward)."""
        return ExpertChain(self, expert)

    def _product(self, expert: int, x: Tensor, *, transposed: bool, bias: Tensor | None = None) -> Tensor:
        if self.rmm is not None and self.training and x.shape[0] > 0 and torch.is_grad_enabled():
            y = rmm_tt_product(
                x, self.expert_chain(expert), transposed=transposed, rho=self.rmm.ratio, sketch=self.rmm.sketch
            )
            return y if bias is None else y + bias
        return self._planned(expert, x, transposed=transposed, bias=bias)

    def _planned(self, expert: int, x: Tensor, *, transposed: bool, bias: Tensor | None = None) -> Tensor:
        layout, op = self.expert_layout(), "matmul_t" if transposed else "matmul"
        envelope = planned_envelope(layout, op, device=x.device)
        batch = x.numel() // (layout.cols if transposed else layout.rows)
        chosen = choose_plan(envelope, batch)
        run = planner.execute_function if CUSTOM_AUTOGRAD else planner.execute
        return run(chosen, x, self.expert_cores(expert), layout, bias)

    def linear(self, expert: int, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, P[e], bias)``."""
        return self._product(expert, x, transposed=self.slice_use == "matmul", bias=bias)

    def project(self, expert: int, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """Expert e's projection of its tokens, x M_e (+ bias), whichever way the model stores P[e]: what an
        experts module computes (``F.linear(x, P[e])``, or ``x @ P[e]`` when it stores P[e] transposed)."""
        return self._product(expert, x, transposed=False, bias=bias)

    def mm(self, expert: int, x: Tensor) -> Tensor:
        """``x @ P[e]``."""
        return self._product(expert, x, transposed=self.slice_use == "linear")

    def dense_expert(self, expert: int) -> Tensor:
        m = self.tt.dense()[:, expert * self.out_features : (expert + 1) * self.out_features]
        return m.t() if self.slice_use == "linear" else m

    def dense(self) -> Tensor:
        return torch.stack([self.dense_expert(e) for e in range(self.num_experts)])

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, shared chain with expert mode, slice_use={self.slice_use!r}"


class ExpertChain:
    """One expert's chain of a shared bank, with what ``rmm_tt_product`` reads of a ``TTMatrix``: its layout,
    gated cores (the expert core folded in, so gradients reach the shared cores), parameters and products."""

    def __init__(self, bank: SharedTTExpertBank, expert: int):
        self.bank, self.expert = bank, expert

    @property
    def layout(self) -> TTLayout:
        return self.bank.expert_layout()

    @property
    def stored_empty(self) -> bool:
        return self.bank.tt.stored_empty

    @property
    def device(self):
        return self.bank.tt.device

    def parameters(self):
        return self.bank.tt.parameters()

    def gated_cores(self) -> list[Tensor]:
        return self.bank.expert_cores(self.expert)

    def matmul(self, x: Tensor) -> Tensor:
        return self.bank._planned(self.expert, x, transposed=False)

    def matmul_t(self, x: Tensor) -> Tensor:
        return self.bank._planned(self.expert, x, transposed=True)
