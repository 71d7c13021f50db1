"""Modules whose backward is randomized: the user's own module objects, with their class swapped.

``randomize_backward_`` changes ``module.__class__`` to ``Randomized<Base>`` (a subclass made once per base
class) and sets ``module.rmm``; parameters, buffers, hooks and state_dict keys stay exactly as they were, so the
optimizer and checkpoints need nothing. ``restore_backward_`` puts the base class back. The classes pickle and
deep-copy by naming their base class (``swap.py``), so ``torch.save(model)`` works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from ..tt.inventory import is_hf_conv1d
from ..tt.layers import TTLinear
from .functions import rmm_linear, rmm_tt_product
from .sketch import check_sketch, rho_ratio
from .swap import SwappedClass, mixed_class


@dataclass(frozen=True)
class RMMConfig:
    """What a randomized backward keeps: ``rho`` (0, 1] of the tokens of each linear input, sketched by
    ``sketch`` ("gaussian", "rademacher" or "srht"); layers below ``min_numel`` weight entries stay exact."""

    rho: float = 0.25
    sketch: str = "gaussian"
    min_numel: int = 65536
    #: ρ as (numerator, denominator): what the ops take (0.1 is exactly 1/10)
    ratio: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", rho_ratio(self.rho))
        check_sketch(self.sketch)
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")

    def describe(self) -> str:
        return f"rho={self.rho:g}, {self.sketch}"


def supported_kind(module: nn.Module) -> str | None:
    """'linear', 'conv1d' or 'tt_linear' for the module types whose forward can be randomized, else None."""
    base = module._rmm_base if isinstance(module, RandomizedBackward) else type(module)
    return supported_kind_of_class(base)


def supported_kind_of_class(cls: type) -> str | None:
    """As ``supported_kind``, for a class: subclasses qualify only while they keep the base class's forward."""
    if issubclass(cls, TTLinear) and cls.forward is TTLinear.forward:
        return "tt_linear"
    if issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward:
        return "linear"
    if is_hf_conv1d(cls):
        return "conv1d"
    return None


class RandomizedBackward(SwappedClass):
    """Mixin placed before the module's own class: a forward with an exact output and a sketched weight gradient.

    Training mode with grad enabled only; in eval mode or under ``torch.no_grad()`` the forward is the base
    class's own, drawing nothing.
    """

    rmm: RMMConfig
    _rmm_base: type
    prefix, base_attr = "Randomized", "_rmm_base"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return self._rmm_base.forward(self, x)
        config = self.rmm
        kind = supported_kind_of_class(self._rmm_base)
        if kind == "linear":
            return rmm_linear(x, self.weight, self.bias, rho=config.ratio, sketch=config.sketch, share_key=self)
        if kind == "conv1d":  # transformers' Conv1D: y = x·W + b with W stored (in × out)
            return rmm_linear(x, self.weight.t(), self.bias, rho=config.ratio, sketch=config.sketch, share_key=self)
        y = rmm_tt_product(
            x, self.tt, transposed=self.transposed, rho=config.ratio, sketch=config.sketch, share_key=self
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        base = self._rmm_base.extra_repr(self)
        return f"{base}, rmm=({self.rmm.describe()})" if base else f"rmm=({self.rmm.describe()})"


def randomized_class(base: type) -> type:
    """``Randomized<Base>``: the mixin over ``base``, made once per base class."""
    return mixed_class(RandomizedBackward, base)


def randomize_module(module: nn.Module, config: RMMConfig) -> None:
    """Swap ``module``'s class for its randomized subclass (or update its config if it already is one)."""
    if not isinstance(module, RandomizedBackward):
        module.__class__ = randomized_class(type(module))
    module.rmm = config


def restore_module(module: nn.Module) -> bool:
    """Undo ``randomize_module``; False if the module was not randomized."""
    if not isinstance(module, RandomizedBackward):
        return False
    module.__class__ = module._rmm_base
    del module.rmm
    return True
