"""Randomized backward for raw parameters that the user's own forward reads with ``F.linear`` / ``addmm`` / matmul.

A module-class swap covers ``nn.Linear``-like modules, whose forward comera_fx knows. A parameter read in the user's
code (``F.linear(x, self.w, self.b)``, ``x @ self.w``) has no such module. Its forward stays the user's: the module
whose forward runs those ops gets the class ``RandomizedUses<Base>``, whose forward calls the base forward under a
``TorchFunctionMode`` that sends exactly those ops — the registered parameter as their weight operand — to
``rmm_linear``. Any other op, and every op outside that forward, runs as before. Parameters, buffers, hooks and
state_dict keys are untouched; ``restore_uses`` puts the base class back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .functions import rmm_linear
from .swap import SwappedClass, mixed_class

# The eager functions a linear-like use reaches ``__torch_function__`` as (``x @ w`` is ``Tensor.__matmul__``).
_LINEAR = frozenset({F.linear})
_MATMUL = frozenset({torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__})
_ADDMM = frozenset({torch.addmm, torch.Tensor.addmm})


def linear_operands(func, args: tuple, kwargs: dict, weights: dict[int, Tensor]):
    """(x, weight as out × in, bias, extra) when ``func(*args, **kwargs)`` computes ``x·Wᵀ + bias (+ extra)`` for one
    of ``weights`` (by identity) as its weight operand, else None. ``extra`` is a bias ``F.linear`` cannot take (an
    addmm's 2-D input), added after."""
    if func in _LINEAR:
        x = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if id(weight) in weights and x is not weight and bias is not weight:
            return x, weights[id(weight)], bias, None
        return None
    if func in _MATMUL:
        if len(args) != 2 or kwargs or id(args[1]) not in weights or args[0] is args[1] or args[0].dim() < 2:
            return None
        if func in (torch.mm, torch.Tensor.mm) and args[0].dim() != 2:
            return None
        return args[0], weights[id(args[1])].t(), None, None
    if func in _ADDMM:
        if len(args) != 3 or any(kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(kwargs) - {"beta", "alpha"}:
            return None
        bias, x, weight = args
        if id(weight) not in weights or x is weight or bias is weight:
            return None
        if bias.dim() == 1:
            return x, weights[id(weight)].t(), bias, None
        return x, weights[id(weight)].t(), None, bias
    return None


class _RandomizedOps(TorchFunctionMode):
    """Sends the linear-like ops on ``weights`` to ``rmm_linear``; everything else passes through unchanged.
    (While a mode handles an op it is off the stack, so the ops ``rmm_linear`` runs are not seen again.)"""

    def __init__(self, weights: dict[int, Tensor], rho, sketch: str):
        super().__init__()
        self.weights, self.rho, self.sketch = weights, rho, sketch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = linear_operands(func, args, kwargs, self.weights)
        if found is None:
            return func(*args, **kwargs)
        x, weight, bias, extra = found
        # One sketch per input and parameter: the parameter is the "layer" that shares (Q, K and V read one x).
        y = rmm_linear(x, weight, bias, rho=self.rho, sketch=self.sketch, share_key=_ShareKey(weight))
        return y if extra is None else y + extra


class _ShareKey:
    """A hashable stand-in for the parameter behind ``weight`` (a view ``w.t()`` is a new tensor every call)."""

    __slots__ = ("key",)

    def __init__(self, weight: Tensor):
        self.key = id(weight._base if weight._base is not None else weight)

    def __hash__(self) -> int:
        return self.key

    def __eq__(self, other) -> bool:
        return isinstance(other, _ShareKey) and other.key == self.key


class RandomizedUses(SwappedClass):
    """Mixin placed before a module's own class: its forward runs under ``_RandomizedOps`` for the parameters named
    in ``rmm_parameters`` (paths below this module). Training mode with grad enabled only."""

    rmm: object  # an RMMConfig
    rmm_parameters: tuple[str, ...]
    _rmm_uses_base: type
    prefix, base_attr = "RandomizedUses", "_rmm_uses_base"

    def forward(self, *args, **kwargs):
        base_forward = self._rmm_uses_base.forward
        if not (self.training and torch.is_grad_enabled()):
            return base_forward(self, *args, **kwargs)
        weights = {}
        for name in self.rmm_parameters:
            weight = self.get_parameter(name)
            weights[id(weight)] = weight
        with _RandomizedOps(weights, self.rmm.ratio, self.rmm.sketch):
            return base_forward(self, *args, **kwargs)

    def extra_repr(self) -> str:
        base = self._rmm_uses_base.extra_repr(self)
        mine = f"rmm=({self.rmm.describe()}) on {', '.join(self.rmm_parameters)}"
        return f"{base}, {mine}" if base else mine


def randomize_uses(module: nn.Module, names, config) -> None:
    """Randomize the linear-like uses, in ``module``'s forward, of its parameters ``names`` (paths below it)."""
    for name in names:
        module.get_parameter(name)  # AttributeError now rather than at the first forward
    if isinstance(module, RandomizedUses):
        names = tuple(dict.fromkeys((*module.rmm_parameters, *names)))
    else:
        module.__class__ = mixed_class(RandomizedUses, type(module))
    module.rmm = config
    module.rmm_parameters = tuple(names)


def restore_uses(module: nn.Module) -> bool:
    """Undo ``randomize_uses``; False if the module's uses were not randomized."""
    if not isinstance(module, RandomizedUses):
        return False
    module.__class__ = module._rmm_uses_base
    del module.rmm, module.rmm_parameters
    return True
