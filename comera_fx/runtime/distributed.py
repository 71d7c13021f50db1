"""Rank adaptation under ``torch.distributed``: every rank prunes the same slices, and the DDP wrapper follows.

Pruning gives shrunk TT matrices new parameter objects. ``DistributedDataParallel`` registers its all-reduce hooks
on the parameters it was built with, so after a prune the old wrapper would silently never average the new
parameters' gradients (pytorch#12603). ``RankAdaptive`` therefore, when given a DDP model:

* decides every prune on rank 0 and broadcasts the decision (the ranks kept per bond, or the dead-slice masks), so
  all ranks remove the same slices even if a float differs somewhere (the importances are computed from the
  all-reduced gradients and would normally agree anyway); the observed loss is averaged over the ranks (CoMERA's
  λ and plateau detection read it) and, with ``budget_seconds``, rank 0's clock decides when to prune;
* after a prune that changed something, builds a new ``DistributedDataParallel`` around the same module with the
  same settings (``rewrap_ddp``) — its construction checks that all ranks hold the same shapes and broadcasts
  rank 0's parameters — and exposes it as ``hook.model``; the old wrapper refuses to run, naming ``hook.model``.
  The optimizer keeps working: the shrink swaps the new parameters into its param groups.

FSDP2 (``fully_shard``) is refused: its parameters are DTensor shards, so neither the singular values of a bond
nor the physical removal of slices can be computed locally. Prune under DDP, or at a checkpoint boundary (gather
the full state dict, prune in one process, shard the smaller model again) — docs/distributed.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .compiled import compiled_module

__all__ = ["RankSync", "agreed_sum", "rewrap_ddp", "is_fsdp2", "unwrap", "world_size"]

_MB = 1024 * 1024


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``model`` itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_fsdp2(model: nn.Module) -> bool:
    """True when ``model`` or a submodule went through ``torch.distributed.fsdp.fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without distributed support
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


FSDP2_REFUSAL = (
    "RankAdaptive does not run under FSDP2 (fully_shard): its parameters are DTensor shards, so the singular values "
    "of a TT bond and the physical removal of rank slices cannot be computed on one rank. Either train with "
    "DistributedDataParallel (RankAdaptive then rebuilds the wrapper after each prune, see hook.model), or prune at "
    "a checkpoint boundary: gather torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True)), load it into a single-process model, prune there "
    "(RankAdaptive.prune_to / runtime.shrink_), save it, and fully_shard the smaller model again "
    "(docs/distributed.md)"
)


class _StaleDDP:
    """Replaces the ``forward`` of a DDP wrapper that ``rewrap_ddp`` superseded."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "this DistributedDataParallel wrapper was replaced after the TT ranks were pruned: its "
            "reducer still holds the old parameters and would not all-reduce the new ones' gradients "
            f"(pytorch#12603). Use the new wrapper: {self.where}"
        )


def _settings(old: DistributedDataParallel) -> dict[str, Any]:
    """The constructor arguments of ``old`` that can be read back, refusing what cannot be rebuilt faithfully."""
    problems = []
    if getattr(old, "_comm_hooks", None):
        problems.append("a registered communication hook (its state may hold per-bucket tensors)")
    if getattr(old, "mixed_precision", None) is not None:
        problems.append("mixed_precision")
    if getattr(old, "_delay_all_reduce_params", None):
        problems.append("delay_all_reduce_named_params")
    if getattr(old, "device_mesh", None) is not None:
        problems.append("device_mesh")
    if problems:
        raise NotImplementedError(
            f"rewrap_ddp: cannot rebuild a DistributedDataParallel with {', '.join(problems)} "
            f"from its attributes; build it yourself: hook.distributed.wrap = lambda module: "
            f"DistributedDataParallel(module, ...) for RankAdaptive, or rewrap_ddp(old, "
            f"wrap=...)"
        )
    caps = list(old.bucket_bytes_cap_list)
    kwargs = dict(
        device_ids=old.device_ids,
        output_device=old.output_device,
        dim=old.dim,
        process_group=old.process_group,
        find_unused_parameters=old.find_unused_parameters,
        gradient_as_bucket_view=old.gradient_as_bucket_view,
        static_graph=old.static_graph,
        forward_sync_buffers=old.forward_sync_buffers,
    )
    if caps:
        kwargs["bucket_cap_mb_list"] = [c / _MB for c in caps]
    elif not old.bucket_bytes_cap_default:  # the default keeps its smaller first bucket only if left unset
        kwargs["bucket_cap_mb"] = old.bucket_bytes_cap / _MB
    return kwargs


def rewrap_ddp(
    old: DistributedDataParallel,
    *,
    wrap: Callable[[nn.Module], DistributedDataParallel] | None = None,
    where: str = "the wrapper rewrap_ddp returned",
) -> DistributedDataParallel:
    """A new ``DistributedDataParallel`` around ``old.module``, built with ``old``'s settings (or by ``wrap``), for
    after the module's parameters were replaced. A collective: call it on every rank at the same point. ``old``'s
    forward then raises, so a loop that kept it fails instead of training without gradient averaging."""
    kwargs = None if wrap is not None else _settings(old)
    module = old.module
    new = wrap(module) if wrap is not None else DistributedDataParallel(module, **kwargs)
    if not isinstance(new, DistributedDataParallel) or new.module is not module:
        raise TypeError("rewrap_ddp: wrap(module) must return a DistributedDataParallel around that module")
    old.forward = _StaleDDP(where)
    return new


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the default group when None); 1 without an initialized process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def agreed_sum(t: Tensor, group: Any = None) -> Tensor:
    """The sum of ``t`` over the ranks, bitwise the same on every rank (in place; a collective).

    Reduced on the group's first rank, then broadcast from it: an all-reduce may leave the ranks with sums that
    differ in the last bits (summed in different orders), and statistics that decide TT shapes must agree exactly.
    On NCCL the tensor travels through the current CUDA device. Without a group of several ranks: ``t`` itself."""
    if world_size(group) == 1:
        return t
    nccl = "nccl" in str(dist.get_backend(group))
    work = t.to(torch.device("cuda", torch.cuda.current_device())) if nccl else t
    work = work.contiguous()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.reduce(work, dst=src, group=group)
    dist.broadcast(work, src=src, group=group)
    if work is not t:
        t.copy_(work)
    return t


class RankSync:
    """What ``RankAdaptive`` needs to stay consistent across ranks: agreement on decisions (broadcast from
    ``src``), the mean loss, and the rebuild of the DDP wrapper after a prune.

    ``wrapper``: the DDP model given to ``RankAdaptive`` (None when it got the bare module: then nothing is rebuilt,
    and ``on_prune`` callbacks are how the caller rebuilds its wrapper). ``wrap``: how to build the new wrapper
    (default: ``rewrap_ddp`` from the old one's settings)."""

    def __init__(
        self,
        wrapper: DistributedDataParallel | None = None,
        *,
        group: Any = None,
        src: int = 0,
        wrap: Callable[[nn.Module], DistributedDataParallel] | None = None,
    ):
        self.wrapper = wrapper
        self.group = wrapper.process_group if group is None and wrapper is not None else group
        self.src, self.wrap = src, wrap
        self.callbacks: list[Callable[[Any], None]] = []
        self.rewraps = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> tuple["RankSync | None", nn.Module]:
        """(the sync object or None, the module to find TT matrices in) for the model given to RankAdaptive.

        A bare module while a process group of several ranks exists is taken to be replicated on every rank of the
        default group (data parallel, e.g. the module of a DDP model): decisions are still broadcast. Models that
        differ between ranks (pipeline stages) are not supported."""
        if is_fsdp2(model):
            raise NotImplementedError(FSDP2_REFUSAL)
        if isinstance(model, DistributedDataParallel):
            return cls(model), compiled_module(model.module)
        if world_size() > 1:  # the module of a DDP model, or a replicated model trained by hand
            return cls(None), compiled_module(model)
        return None, compiled_module(model)

    def check(self) -> None:
        """Raise now (before a prune removes anything) if the wrapper could not be rebuilt afterwards."""
        if self.wrapper is not None and self.wrap is None:
            _settings(self.wrapper)

    @property
    def size(self) -> int:
        return world_size(self.group)

    def on_prune(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(hook_model)`` on every rank after each prune that changed a matrix (after the rebuild)."""
        self.callbacks.append(fn)

    # -- agreement ---------------------------------------------------------------------------------------------

    def _broadcast(self, values: Tensor) -> Tensor:
        if self.size > 1:
            dist.broadcast(
                values,
                src=dist.get_global_rank(self.group, self.src) if self.group is not None else self.src,
                group=self.group,
            )
        return values

    def ints(self, values: Sequence[int], device: torch.device) -> list[int]:
        """Rank ``src``'s ``values`` on every rank (one broadcast)."""
        if not values:
            return []
        return self._broadcast(torch.tensor(list(values), dtype=torch.int64, device=device)).tolist()

    def masks(self, masks: Sequence[Tensor]) -> list[Tensor]:
        """Rank ``src``'s boolean masks (same shapes on every rank: DDP checked the parameter shapes)."""
        if not masks:
            return []
        flat = self._broadcast(torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]))
        return [part.view(m.shape).to(torch.bool) for part, m in zip(flat.split([m.numel() for m in masks]), masks)]

    def value(self, x: float, device: torch.device) -> float:
        """Rank ``src``'s ``x`` (e.g. the clock of a ``budget_seconds`` horizon)."""
        return float(self._broadcast(torch.tensor([x], dtype=torch.float64, device=device))[0])

    def mean(self, x: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
        """The mean of ``x`` over the ranks (the observed loss): a tensor's stays a 0-d float64 tensor on
        ``device`` (all-reduced there, not read back), a float's is a float."""
        if self.size == 1:
            return x
        t = (
            x.detach().reshape(1).to(device, torch.float64, copy=True)  # all_reduce is in place: never the loss
            if torch.is_tensor(x)
            else torch.tensor([x], dtype=torch.float64, device=device)
        )
        dist.all_reduce(t, group=self.group)
        return t[0] / self.size if torch.is_tensor(x) else float(t[0]) / self.size

    # -- after a prune -----------------------------------------------------------------------------------------

    def after_prune(self, module: nn.Module) -> nn.Module:
        """Rebuild the wrapper (if any) and run the callbacks; returns what ``hook.model`` is now."""
        if self.wrapper is not None:
            self.wrapper = rewrap_ddp(self.wrapper, wrap=self.wrap, where="hook.model (RankAdaptive)")
            self.rewraps += 1
        current = self.wrapper if self.wrapper is not None else module
        if self.wrapper is None and not self.callbacks and self.size > 1:
            warnings.warn(
                "RankAdaptive pruned a model trained by several processes, but was given the bare module: "
                "if it is inside DistributedDataParallel, that wrapper no longer averages the pruned "
                "matrices' gradients. Pass the DDP model to RankAdaptive (it then rebuilds it, see "
                "hook.model) or rebuild it in hook.distributed.on_prune(fn)",
                stacklevel=3,
            )
        for fn in self.callbacks:
            fn(current)
        return current
