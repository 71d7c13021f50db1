"""Class swaps that keep the user's module objects: ``Mixin<Base>`` subclasses made once per (mixin, base).

Changing ``module.__class__`` instead of replacing the module keeps its parameters, buffers, hooks and state_dict
keys, so optimizers and checkpoints need nothing. The subclasses are made at run time, so they pickle (and
deep-copy) by naming the chain of classes they were made from; a swap over a swap (a checkpointed randomized
layer) works the same way.
"""

from __future__ import annotations

_CLASSES: dict[tuple[type, type], type] = {}


class SwappedClass:
    """Base of the mixins: ``prefix`` names the made classes, ``base_attr`` is where each keeps its base class."""

    prefix: str = ""
    base_attr: str = ""

    def __reduce_ex__(self, protocol):
        return (rebuild, (class_chain(type(self)),), self.__dict__)


def mixed_class(mixin: type, base: type) -> type:
    """``<mixin.prefix><Base>``: the mixin over ``base``, made once per pair."""
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        cls = type(
            f"{mixin.prefix}{base.__name__}",
            (mixin, base),
            {mixin.base_attr: base, "_mixed_from": (mixin, base), "__module__": mixin.__module__},
        )
        _CLASSES[key] = cls
    return cls


def class_chain(cls: type) -> tuple[type, ...]:
    """(importable base, mixin, mixin, ...) that ``cls`` was made from."""
    made_from = cls.__dict__.get("_mixed_from")
    if made_from is None:
        return (cls,)
    mixin, base = made_from
    return class_chain(base) + (mixin,)


def rebuild(chain: tuple[type, ...]):
    """An empty instance of the class ``chain`` describes (pickle then restores its ``__dict__``)."""
    cls = chain[0]
    for mixin in chain[1:]:
        cls = mixed_class(mixin, cls)
    return cls.__new__(cls)
