"""The weight-space form: the module's own forward reads its 3D expert weights, rebuilt from TT cores.

``TTExperts`` re-implements a transformers experts module's forward, and ``ExpertWeight`` serves only the reads
it knows (``bmm``, ``P[e]`` products). A module whose forward does something else with its experts (gpt-oss's own
``_apply_gate`` with interleaved gate/up columns and biases, a norm after each expert, an ``einsum``, an index by
many experts) would then stay dense. Here the module keeps its forward and its class's code: each converted 3D
parameter becomes a ``TTExpertBank`` (or a shared bank) registered as ``<attr>_tt``, and ``<attr>`` becomes a
property of a run-time subclass that returns the bank rebuilt from the cores (E × a × b, a plain tensor, so
whichever implementation the module picks, eager loop, ``batched_mm`` or ``grouped_mm``, runs unchanged and the
gradient reaches the cores). Nothing is re-implemented, so full rank is exact to rounding. In an eager forward
the module reads a ``LazyBank`` (lazy_bank.py): ``P[e]`` rebuilds expert e alone, so a loop over the routed
experts costs only theirs; a read of the whole bank (``bmm``, ``grouped_mm``) rebuilds it once per forward.
Compiled, the reads of one graph are one expression over the whole bank that Inductor computes once.

The banks are the same ``TTMatrix`` objects as elsewhere, so ``RankAdaptive``, ``report``, ``state_dict`` and
``save_tensorized`` see them unchanged; instances pickle and deep-copy through ``__reduce_ex__`` (the subclass,
made at run time, cannot be found by name).
"""

from __future__ import annotations

import copyreg
from collections.abc import Mapping

from torch import Tensor, nn

from ..tt.dense_view import dense_view
from .lazy_bank import LazyBank, plain_eager
from .unreached import expert_parameters, tie_unreached

#: The attribute of an instance holding, during one eager forward, the banks rebuilt for it ({attr: tensor}).
_CACHE = "_comera_fx_rebuilt"


def attach_bank_properties(module: nn.Module, banks: Mapping[str, nn.Module]) -> None:
    """Replace the 3D parameters ``module.<attr>`` by banks (``{attr: TTExpertBank or SharedTTExpertBank}``),
    registered as ``<attr>_tt`` and read through properties that rebuild them."""
    for attr, bank in banks.items():
        module._parameters.pop(attr, None)
        module.add_module(f"{attr}_tt", bank)
    cls = type(module)
    base = cls._comera_fx_bank_base if is_bank_holder(module) else cls
    attrs = tuple(dict.fromkeys(getattr(cls, "_comera_fx_bank_attrs", ()) + tuple(banks)))
    module.__class__ = bank_holder_class(base, attrs)


def is_bank_holder(module: nn.Module) -> bool:
    """True for a module whose expert weights are read through rebuilding properties (this module's form)."""
    return getattr(type(module), "_comera_fx_bank_class", False)


def bank_attrs(module: nn.Module) -> tuple[str, ...]:
    """The attributes of a bank holder that are rebuilt from banks (``<attr>_tt``)."""
    return type(module)._comera_fx_bank_attrs if is_bank_holder(module) else ()


def bank_holder_class(base: type, attrs: tuple[str, ...]) -> type:
    """A subclass of ``base`` whose ``attrs`` rebuild 3D weights from the ``<attr>_tt`` banks, and whose forward
    rebuilds each bank once per eager call. A new class per call: one holder's properties never leak into
    another's."""
    namespace = {
        "_comera_fx_bank_class": True,
        "_comera_fx_bank_base": base,
        "_comera_fx_bank_attrs": attrs,
        "__module__": base.__module__,
        "__reduce_ex__": _reduce_holder,
        "forward": _forward,
        "__setattr__": _setattr_holder,
    }
    for attr in attrs:
        namespace[attr] = property(_make_getter(attr))
    return type(f"TT{base.__name__}", (base,), namespace)


def _make_getter(attr: str):
    def rebuilt(self) -> Tensor:
        cache = self.__dict__.get(_CACHE)
        if cache is not None and attr in cache:
            return cache[attr]
        bank = self._modules[f"{attr}_tt"]
        return dense_view(bank.dense(), bank, transposed=False)  # outside a forward: in-place writes raise

    rebuilt.__doc__ = f"`{attr}` (experts × a × b) rebuilt from its TT bank `{attr}_tt` (comera_fx)."
    return rebuilt


def _forward(self, *args, **kwargs):
    cls = type(self)
    base_forward = super(cls, self).forward
    if cls._comera_fx_bank_attrs and _can_cache(self):
        banks = {attr: self._modules[f"{attr}_tt"] for attr in cls._comera_fx_bank_attrs}
        lazy = plain_eager()
        if lazy:  # P[e] rebuilds expert e alone; a read of the whole bank rebuilds it once (lazy_bank.py)
            self.__dict__[_CACHE] = {attr: LazyBank(bank) for attr, bank in banks.items()}
        else:
            self.__dict__[_CACHE] = {attr: bank.dense() for attr, bank in banks.items()}
        try:
            out = base_forward(*args, **kwargs)
            if lazy:  # the experts no read reached get zero gradients, as the dense weight's rows do (unreached.py)
                missed = [
                    p
                    for read in self.__dict__[_CACHE].values()
                    for p in expert_parameters(read.bank, set(range(len(read))) - read.reached)
                ]
                out = tie_unreached(out, missed)
            return out
        finally:
            self.__dict__.pop(_CACHE, None)
    return base_forward(*args, **kwargs)


def _can_cache(module: nn.Module) -> bool:
    """Eager only: compiled code reads the properties (Dynamo would trace the cache as a side effect), and a
    nested call (the module calling itself) keeps the outer cache."""
    import torch

    return not torch.compiler.is_compiling() and _CACHE not in module.__dict__


def _setattr_holder(self, name: str, value) -> None:
    cls = type(self)
    if name in cls._comera_fx_bank_attrs:
        raise AttributeError(
            f"cannot assign {cls._comera_fx_bank_base.__name__}.{name}: it is rebuilt from "
            f"the TT bank {name}_tt (change that bank's cores, or convert the dense model again)"
        )
    super(cls, self).__setattr__(name, value)


def _rebuild_holder(base: type, attrs: tuple[str, ...]) -> nn.Module:
    cls = bank_holder_class(base, attrs)
    return cls.__new__(cls)


def _reduce_holder(self, protocol):
    cls = type(self)
    reduced = super(cls, self).__reduce_ex__(protocol)
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__ and reduced[1][0] is cls:
        return (_rebuild_holder, (cls._comera_fx_bank_base, cls._comera_fx_bank_attrs)) + tuple(reduced[2:])
    return reduced
