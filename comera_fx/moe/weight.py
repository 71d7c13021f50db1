"""``ExpertWeight``: what a module whose forward comera_fx does not know reads in place of a 3D expert parameter.

A hand-written MoE module reads its experts' parameter P (E × a × b) in its own forward. It cannot be swapped
for a module we wrote, so the parameter is replaced by an object that behaves like P where it matters and runs
the TT products instead of rebuilding P (torch's ``__torch_function__`` protocol for tensor-likes):

* ``torch.bmm(x, P)`` / ``torch.matmul(x, P)`` / ``x @ P`` with x (E × n × a): expert e's rows times its TT
  matrix, stacked — the expert dimension is the batch dimension.
* ``P[e]`` (an int or a one-element integer tensor) gives an ``ExpertSlice``; ``F.linear(x, P[e], b)`` and
  ``x @ P[e]`` run expert e's planned product.
* anything else (and ``.shape``, ``.dtype``...) sees the dense P, rebuilt from the cores: correct, but it is
  the slow path the summary warns about through ``find_experts``' list of unsupported ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .bank import TTExpertBank

_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.mm, Tensor.matmul, Tensor.mm, Tensor.__matmul__}
_BMM = {torch.bmm, torch.matmul, Tensor.bmm, Tensor.matmul, Tensor.__matmul__}


class ExpertWeight:
    """Stands for the 3D parameter a ``TTExpertBank`` replaced (see the module docstring)."""

    def __init__(self, bank: TTExpertBank):
        self.bank = bank

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.bank.weight_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 3

    ndim = property(dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.bank[0].cores[0].dtype

    @property
    def device(self) -> torch.device:
        return self.bank[0].cores[0].device

    def __len__(self) -> int:
        return len(self.bank)

    def __getitem__(self, index):
        expert = single_index(index)
        if expert is None:
            return self.dense()[index]
        return ExpertSlice(self.bank, expert % len(self.bank))

    def dense(self) -> Tensor:
        return self.bank.dense()

    def bmm(self, x: Tensor) -> Tensor:
        """``torch.bmm(x, P)``: x (E × n × a) -> (E × n × b), one planned product per expert."""
        if x.dim() != 3 or x.shape[0] != len(self.bank):
            raise ValueError(
                f"bmm with {len(self.bank)} experts needs x of shape ({len(self.bank)}, n, "
                f"{self.shape[1]}), got {tuple(x.shape)}"
            )
        return torch.stack([self.bank.mm(e, x[e]) for e in range(len(self.bank))])

    def __repr__(self) -> str:
        return f"ExpertWeight(shape={tuple(self.shape)}, {len(self.bank)} TT experts)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in _BMM
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], ExpertWeight)
            and isinstance(args[0], Tensor)
            and args[0].dim() == 3
        ):
            return args[1].bmm(args[0])
        return func(*tree_map(_dense, args), **tree_map(_dense, kwargs))


class ExpertSlice:
    """``P[e]`` of an ``ExpertWeight``: ``F.linear`` / ``matmul`` with it run expert e's TT product."""

    def __init__(self, bank: TTExpertBank, expert: int):
        self.bank, self.expert = bank, expert

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.bank.weight_shape[1:])

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    ndim = property(dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.bank[self.expert].cores[0].dtype

    @property
    def device(self) -> torch.device:
        return self.bank[self.expert].cores[0].device

    def dense(self) -> Tensor:
        return self.bank.dense_expert(self.expert)

    def __repr__(self) -> str:
        return f"ExpertSlice(expert={self.expert}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, ExpertSlice) and isinstance(x, Tensor) and not isinstance(bias, ExpertSlice):
                return weight.bank.linear(weight.expert, x, bias)
        if (
            func in _MATMUL
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], ExpertSlice)
            and isinstance(args[0], Tensor)
        ):
            return args[1].bank.mm(args[1].expert, args[0])
        return func(*tree_map(_dense, args), **tree_map(_dense, kwargs))


def _dense(value):
    return value.dense() if isinstance(value, (ExpertWeight, ExpertSlice)) else value


def single_index(index) -> int | None:
    """The expert an index picks, when it picks one (an int or a one-element integer tensor), else None."""
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if (
        isinstance(index, Tensor)
        and index.numel() == 1
        and not index.is_floating_point()
        and index.dtype != torch.bool
        and index.dim() <= 1
    ):
        return int(index)
    return None


def attach_expert_weight(holder: nn.Module, attr: str, bank: TTExpertBank) -> None:
    """Replace parameter ``holder.<attr>`` by ``bank`` (registered as ``<attr>_tt``), read through an
    ``ExpertWeight`` in the instance's attribute ``<attr>``."""
    holder._parameters.pop(attr, None)
    holder.add_module(f"{attr}_tt", bank)
    holder.__dict__[attr] = ExpertWeight(bank)
