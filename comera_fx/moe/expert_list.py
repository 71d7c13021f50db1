"""The shared form for experts kept in an ``nn.ModuleList`` (one small MLP per expert, the older layout).

Each expert's linear is its own module, called by the expert's own forward. With
``TensorizeConfig(expert_form="shared")`` the E linears of one name (``experts.<e>.w_in``) become one
``SharedTTExpertBank`` (one TT chain over the experts side by side, one small core per expert), registered once on
the list's parent as ``<list>_<name>_shared``; each linear is swapped for a ``SharedExpertLinear`` that runs its
expert's product of that chain. The experts' forwards and the routing loop are untouched.
"""

from __future__ import annotations

from torch import Tensor, nn

from .shared import SharedTTExpertBank


class SharedExpertLinear(nn.Module):
    """``nn.Linear`` of expert ``expert`` whose weight is that expert's slice of a shared chain. The bank is
    registered on the list's parent, not here (one chain, one set of parameters); the bias is this expert's own."""

    def __init__(self, bank: SharedTTExpertBank, expert: int, bias: nn.Parameter | None):
        super().__init__()
        self.__dict__["bank"] = bank  # not a submodule: registered once where the list lives
        self.expert = expert
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.bank.in_features

    @property
    def out_features(self) -> int:
        return self.bank.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.bank.linear(self.expert, x, self.bias)

    def extra_repr(self) -> str:
        return f"expert={self.expert}, in_features={self.in_features}, out_features={self.out_features}, shared chain"


def bank_name(list_path: str, linear: str) -> str:
    """The attribute of the list's parent that holds the chain of ``<list>.<e>.<linear>``."""
    leaf = list_path.rpartition(".")[2]
    return f"{leaf}_{linear.replace('.', '_')}_shared" if linear else f"{leaf}_shared"


def install_shared_linears(
    model: nn.Module,
    bank_path: str,
    bank: SharedTTExpertBank,
    linears: list[tuple[str, int]],
    touch=lambda module: None,
) -> None:
    """Register ``bank`` at ``bank_path`` and swap each ``(linear path, expert)`` for a ``SharedExpertLinear``
    keeping that linear's bias (``touch(module)`` is called before each module changes: the rollback journal)."""
    parent_path, _, name = bank_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    touch(parent)
    parent.add_module(name, bank)
    for path, expert in linears:
        owner_path, _, child = path.rpartition(".")
        owner = model.get_submodule(owner_path)
        old = owner.get_submodule(child)
        new = SharedExpertLinear(bank, expert, old.bias)
        new.train(old.training)
        touch(owner)
        setattr(owner, child, new)
