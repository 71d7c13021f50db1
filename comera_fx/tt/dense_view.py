"""The dense weight a TT module hands out when code reads ``module.weight``, and what assigning one means.

``TTLinear.weight``, ``TTEmbedding.weight`` and the properties ``tensorize_`` gives other holders rebuild the dense
matrix from the cores on every read. Two things then go silently wrong with plain tensors:

* an in-place change (``torch.nn.init.normal_(module.weight)``, ``module.weight.copy_(w)``, ``w[0] = 0``) edits a
  temporary and is lost. In eager mode the rebuilt weight is a ``TTDenseView``, which computes like the dense
  tensor it wraps (every result is a plain tensor, gradients reach the cores) but raises on an in-place op.
  ``module.weight.data.normal_()`` goes through ``.data``, a plain tensor, and is not caught.
* ``head.weight = embedding.weight`` (how ``transformers``' ``tie_weights`` ties an output head) would have
  nothing to store. A ``TTDenseView`` remembers its ``TTMatrix``, so the assignment makes the target share it:
  the tie is one ``TTMatrix``, as ``tensorize_`` makes for weights tied before it runs. Any other value raises.

Compiled, exported, FX-traced or functorch-transformed code gets the plain tensor: the view exists for eager code.
"""

from __future__ import annotations

import torch
from torch import Tensor

_IN_PLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__set__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__imatmul__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)
_TARGET_KWARGS = ("tensor", "self", "input", "out")  # torch.nn.init.* pass the tensor as ``tensor=``


class TTDenseView(torch.Tensor):
    """A dense weight rebuilt from TT cores: reads behave as the plain tensor, in-place changes raise.

    ``tt_source`` is ``(tt, transposed)``: the view holds Mᵀ of ``tt`` when ``transposed``, else M.
    """

    tt_source: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        if writes:
            targets = tuple(args[:1]) + tuple(kwargs.get(k) for k in _TARGET_KWARGS)
            if any(isinstance(t, TTDenseView) for t in targets):
                raise RuntimeError(
                    f"{name} would change a dense weight that comera_fx rebuilds from TT cores on every read, so the "
                    "change would be lost. Change the TT cores instead (module.tt.cores / <name>_tt.cores), "
                    "initialise the dense model before tensorize_, or use TensorizeConfig(init='random')"
                )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def dense_view(dense: Tensor, tt, *, transposed: bool) -> Tensor:
    """``dense`` (M, or Mᵀ when ``transposed``) as a ``TTDenseView`` in plain eager code; unchanged elsewhere."""
    if (
        type(dense) is not torch.Tensor
        or torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._functorch.is_functorch_wrapped_tensor(dense)
    ):
        return dense
    view = dense.as_subclass(TTDenseView)
    view.tt_source = (tt, transposed)
    return view


def source_of(value, owner: str):
    """``(tt, transposed)`` of a value assigned to a TT weight; a clear error for anything else."""
    if isinstance(value, TTDenseView):
        return value.tt_source
    what = "an nn.Parameter" if isinstance(value, torch.nn.Parameter) else type(value).__name__
    raise TypeError(
        f"cannot assign {what} to {owner}: that weight is stored as TT cores. To tie it to another TT module's "
        "weight, assign that module's .weight (e.g. head.weight = embedding.weight, as transformers' tie_weights "
        "does); to tie dense weights, tie them before tensorize_, which keeps a tie as one TTMatrix"
    )


def check_same_size(owner: str, name: str, current, value) -> None:
    """Size attributes of TT modules (in_features, num_embeddings, ...) follow the cores: assigning the value they
    already have is accepted (``transformers``' ``_adjust_bias`` does), any other value raises."""
    if value != current:
        raise AttributeError(f"cannot set {owner}.{name} = {value!r}: it is {current}, fixed by the TT cores")
