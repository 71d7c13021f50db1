"""Model surgery for ``tensorize_``: reconstructing properties on arbitrary holders, hooks, and rollback.

* ``attach_tt_property`` gives a module whose forward comera_fx does not know a property that rebuilds a converted
  parameter. The module's class becomes a subclass made at run time (``holder_class``); such a class cannot be
  found by name, so instances pickle (``torch.save(model)``) and deep-copy through ``__reduce_ex__``, which
  rebuilds the subclass from the base class and the property table.
* ``move_hooks`` carries forward / backward hooks from a swapped module to its TT twin.
* ``Journal`` records the module dictionaries and classes the mutate phase touches, so that a failure half-way
  restores the model exactly (same module objects, same parameters, same ``state_dict`` order).
"""

from __future__ import annotations

import copyreg
import weakref
from collections.abc import Mapping

from torch import Tensor, nn

from ..tt.dense_view import dense_view, source_of
from ..tt.layers import TTMatrix

# TT matrices read through a reconstructing property; ``passes.contract_reconstructed_tt`` (the backend) finds the
# graphs that rebuild them. Weak, so a model that is deleted is not kept alive.
PROPERTY_MATRICES: "weakref.WeakSet[TTMatrix]" = weakref.WeakSet()


def attach_tt_property(module: nn.Module, attr: str, tt: TTMatrix, *, transposed: bool) -> None:
    """Replace parameter ``module.<attr>`` by a TT matrix read through a property (like torch parametrize).

    The module's class is swapped for a subclass whose ``<attr>`` property rebuilds the dense weight
    (M, or Mᵀ when ``transposed``); the TT matrix is registered as submodule ``<attr>_tt`` so optimizers,
    ``state_dict`` and ``.to()`` see its cores and gates.
    """
    del module._parameters[attr]
    module.add_module(f"{attr}_tt", tt)
    PROPERTY_MATRICES.add(tt)
    cls = type(module)
    base = cls._comera_fx_base if getattr(cls, "_comera_fx_tt_class", False) else cls
    properties = dict(getattr(cls, "_comera_fx_properties", {}), **{attr: transposed})
    module.__class__ = holder_class(base, properties)


def holder_class(base: type, properties: Mapping[str, bool]) -> type:
    """A subclass of ``base`` whose attributes ``properties`` ({name: transposed}) rebuild dense weights from the
    ``<name>_tt`` submodules. A new class per call: one holder's properties never leak into another's."""
    namespace = {
        "_comera_fx_tt_class": True,
        "_comera_fx_base": base,
        "_comera_fx_properties": dict(properties),
        "__module__": base.__module__,
        "__reduce_ex__": _reduce_holder,
        "__setstate__": _setstate_holder,
        "__setattr__": _setattr_holder,
    }
    for attr, transposed in properties.items():
        namespace[attr] = property(_make_dense_getter(attr, transposed))
    return type(f"TT{base.__name__}", (base,), namespace)


def _make_dense_getter(attr: str, transposed: bool):
    def dense_weight(self) -> Tensor:
        tt = self._modules[f"{attr}_tt"]
        m = tt.dense()
        return dense_view(m.t() if transposed else m, tt, transposed=transposed)

    dense_weight.__doc__ = f"Dense `{attr}` rebuilt from its TT cores (comera_fx)."
    return dense_weight


def _rebuild_holder(base: type, properties: dict) -> nn.Module:
    cls = holder_class(base, properties)
    return cls.__new__(cls)


def _reduce_holder(self, protocol):
    cls = type(self)
    reduced = super(cls, self).__reduce_ex__(protocol)
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__ and reduced[1][0] is cls:
        return (_rebuild_holder, (cls._comera_fx_base, dict(cls._comera_fx_properties))) + tuple(reduced[2:])
    return reduced


def _setstate_holder(self, state) -> None:
    super(type(self), self).__setstate__(state)
    for attr in type(self)._comera_fx_properties:
        PROPERTY_MATRICES.add(self._modules[f"{attr}_tt"])


def _setattr_holder(self, name: str, value) -> None:
    cls = type(self)
    if name not in cls._comera_fx_properties:
        super(cls, self).__setattr__(name, value)
        return
    # ``module.w = other.weight``: share the other TT module's matrix (transformers' tie_weights assigns so).
    tt, value_transposed = source_of(value, f"{cls._comera_fx_base.__name__}.{name}")
    current = getattr(self, name)
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(f"cannot assign a {tuple(value.shape)} weight to {name} of shape {tuple(current.shape)}")
    self._modules[f"{name}_tt"] = tt
    PROPERTY_MATRICES.add(tt)
    self.__class__ = holder_class(cls._comera_fx_base, dict(cls._comera_fx_properties, **{name: value_transposed}))


# ------------------------------------------------------------------------------------------------------- hooks

# Hooks that see the module's inputs and outputs, which a TT twin computes the same: they move with the swap.
_MOVABLE_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
# Hooks that see the parameter names, which the swap changes (weight -> tt.cores.*): refused.
_NAME_HOOKS = {
    "_state_dict_hooks": "state_dict",
    "_state_dict_pre_hooks": "state_dict pre-",
    "_load_state_dict_pre_hooks": "load_state_dict pre-",
    "_load_state_dict_post_hooks": "load_state_dict post-",
}


def hook_problem(module: nn.Module) -> str | None:
    """Why swapping ``module`` for a TT module would break one of its hooks, or None."""
    if "forward" in module.__dict__:
        return (
            "its forward is replaced on the instance (e.g. by accelerate's hooks), which a TT module would "
            "drop; remove that wrapper or skip this layer"
        )
    kinds = [kind for name, kind in _NAME_HOOKS.items() if getattr(module, name, None)]
    if kinds:
        return (
            f"the module has {', '.join(kinds)} hooks, which would see the TT parameters (tt.cores.*, "
            f"tt.gates.*) instead of its weight; remove them or skip this layer"
        )
    return None


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the forward / backward hooks of ``old`` (the same dictionaries: handles keep working)."""
    for name in _MOVABLE_HOOKS:
        if hasattr(old, name):
            object.__setattr__(new, name, getattr(old, name))
    if getattr(old, "_is_full_backward_hook", None) is not None:
        object.__setattr__(new, "_is_full_backward_hook", old._is_full_backward_hook)


# ---------------------------------------------------------------------------------------------------- rollback


class Journal:
    """What the mutate phase changed, to undo it: each touched module's class and its parameter, buffer and
    submodule dictionaries (contents and order), saved before its first change."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple] = {}
        self._property_matrices: list[TTMatrix] = []

    def touch(self, module: nn.Module) -> None:
        """Call before changing ``module``."""
        if id(module) not in self._saved:
            self._saved[id(module)] = (
                module,
                module.__class__,
                dict(module._parameters),
                dict(module._buffers),
                set(module._non_persistent_buffers_set),
                dict(module._modules),
            )

    def added_property(self, tt: TTMatrix) -> None:
        self._property_matrices.append(tt)

    def undo(self) -> None:
        for module, cls, params, buffers, non_persistent, modules in reversed(list(self._saved.values())):
            module.__class__ = cls
            for live, saved in ((module._parameters, params), (module._buffers, buffers), (module._modules, modules)):
                live.clear()
                live.update(saved)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
        for tt in self._property_matrices:
            PROPERTY_MATRICES.discard(tt)
