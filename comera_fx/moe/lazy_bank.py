"""``LazyBank``: what a weight-space module's own eager forward reads for a 3D expert weight P (E × a × b).

A forward that loops over the experts a batch routes to reads ``P[e]`` once per routed expert (gpt-oss's eager
loop, DeepSeek-V4 / Inkling2 / Ergo and the others' ``experts_implementation="eager"``, JetMoE's loop). Handing it
the whole rebuilt bank costs every expert's rebuild and keeps E × a × b alive for the backward. ``LazyBank``
serves ``P[e]`` from the cores of expert e alone and ``P[ids]`` (``batched_mm``) from the distinct experts in
``ids``, so rebuild FLOPs, memory and gradients follow the routed experts. Any other read (``torch.bmm(x, P)``,
``grouped_mm``, ``P.transpose(...)``, arithmetic) gets the whole bank, rebuilt once per forward: the result is the
same, the saving is not there (Llama 4's bmm over every expert, the ``grouped_mm`` default).

Plain eager only: compiled, exported and traced code keeps reading the whole rebuilt bank (``weight_space.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ..tt.dense_view import dense_view


class LazyBank:
    """Stands for P during one eager forward; ``bank`` is a ``TTExpertBank`` or ``SharedTTExpertBank``."""

    def __init__(self, bank):
        self.bank = bank
        self._whole = None
        #: The experts this forward read one by one (``P[e]``, ``P[ids]``); all of them once the whole bank is read.
        self.reached: set[int] = set()

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.bank.weight_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 3

    ndim = property(dim)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.bank.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.bank.parameters()).device

    def whole(self) -> Tensor:
        """The whole bank (E × a × b), rebuilt at the first read that needs it and shared by the later ones."""
        if self._whole is None:
            self._whole = self.bank.dense()
            self.reached = set(range(len(self)))
        return self._whole

    def __getitem__(self, index):
        experts = len(self)
        if _is_scalar_index(index):
            expert = int(index)
            if not -experts <= expert < experts:
                raise IndexError(f"index {expert} is out of bounds for the {experts} experts of this bank")
            self.reached.add(expert % experts)
            slice_ = self.bank.dense_expert(expert % experts)
            return dense_view(slice_, self.bank, transposed=self.bank.slice_use == "linear")
        if isinstance(index, Tensor) and index.dim() == 1 and index.numel() and _is_integer(index):
            low, high = (int(v) for v in torch.aminmax(index))
            if low < -experts or high >= experts:
                raise IndexError(
                    f"index {low if low < -experts else high} is out of bounds for the {experts} experts of this bank"
                )
            distinct, inverse = torch.unique(index % experts, return_inverse=True)
            self.reached.update(int(e) for e in distinct)
            rebuilt = torch.stack([self.bank.dense_expert(int(e)) for e in distinct])
            return rebuilt[inverse]
        return self.whole()[index]

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("bank", "_whole", "reached"):
            raise AttributeError(name)
        return getattr(self.whole(), name)  # P.transpose(...), P.T, P.to(...): the whole bank

    def __iter__(self):
        return iter(self.whole())

    def __repr__(self) -> str:
        return f"LazyBank(shape={tuple(self.shape)}, rebuilt from {type(self.bank).__name__})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*tree_map(_whole, args), **tree_map(_whole, kwargs or {}))


def _whole(value):
    return value.whole() if isinstance(value, LazyBank) else value


def _operator(name: str):
    def apply(self, *others):
        return getattr(self.whole(), name)(*tree_map(_whole, others))

    apply.__name__ = name
    return apply


for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__matmul__",
    "__rmatmul__",
    "__neg__",
    "__pow__",
):
    setattr(LazyBank, _name, _operator(_name))


def _is_integer(index: Tensor) -> bool:
    return not index.is_floating_point() and not index.is_complex() and index.dtype != torch.bool


def _is_scalar_index(index) -> bool:
    """An index that picks one expert and drops the expert dimension: a Python int or a 0-dim integer tensor."""
    if isinstance(index, bool):
        return False
    if isinstance(index, int):
        return True
    return isinstance(index, Tensor) and index.dim() == 0 and _is_integer(index)


def plain_eager() -> bool:
    """True where a ``LazyBank`` may be handed out: no compile, export, dispatch-mode or functorch tracing."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.maybe_current_level() is None
    )
