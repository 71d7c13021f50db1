"""What a model holds, as comera_fx names it: its TT matrices (each once, under its public layer name), their live
gates and sizes, and which dense modules are transformers' ``Conv1D``.

The one walk over a model that ``report``, rank adaptation (``runtime``) and ``pretrained`` all read, kept in the
bottom layer so each reaches it by importing downward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from .layers import TTMatrix

#: A gate entry at or below this magnitude counts as dead (CoMERA's code uses 1e-2).
DEFAULT_GATE_THRESHOLD = 1e-2


def layer_name(tt_path: str) -> str:
    """The public name of the layer a TT matrix at module path ``tt_path`` belongs to: 'fc.tt' -> 'fc' (a TT
    module's matrix); 'attn.weight_tt' -> 'attn.weight' (a functional parameter); 'comera_tt_w' -> 'w' (registered
    by ``passes.tensorize`` on a GraphModule)."""
    if tt_path.startswith("comera_tt_"):
        return tt_path[len("comera_tt_") :]
    if tt_path.endswith(".tt") or tt_path == "tt":
        return tt_path[:-3] or "<root>"
    return tt_path[:-3] if tt_path.endswith("_tt") else tt_path


@dataclass(frozen=True)
class MatrixEntry:
    """One TT matrix of the model. ``shrinkable`` is False for matrices registered by the graph pass
    (``passes.tensorize``): their ranks are baked into the graph as constants, so their slices cannot be removed.
    ``used_by``: every layer name it appears under (a tied matrix has several; the first is ``name``)."""

    name: str
    tt: TTMatrix
    shrinkable: bool
    used_by: tuple[str, ...] = ()


def tt_matrices(model: nn.Module) -> list[MatrixEntry]:
    """Every TTMatrix of ``model`` once, in registration order (a tied matrix appears under its first name)."""
    users: dict[int, list[str]] = {}
    matrices: dict[int, TTMatrix] = {}
    frozen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        for child in module.children():
            if isinstance(child, TTMatrix) and isinstance(module, fx.GraphModule):
                frozen.add(id(child))
        if isinstance(module, TTMatrix):
            matrices.setdefault(id(module), module)
            users.setdefault(id(module), []).append(layer_name(path))
    return [MatrixEntry(users[key][0], tt, key not in frozen, tuple(users[key])) for key, tt in matrices.items()]


def ints_on(device: torch.device, values: Sequence[int]) -> torch.Tensor:
    """``values`` as a long tensor on ``device``. On CUDA they travel from pinned memory without blocking: a plain
    host-to-device copy waits for the stream, which would stall every training step that sends them."""
    ints = torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type == "cuda":
        ints = ints.pin_memory()
    return ints.to(device, non_blocking=True)


def segment_sums(flat: torch.Tensor, lengths: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Sums of ``flat``'s consecutive segments of ``lengths``, added in ``dtype``: one ``index_add_`` for many small
    tensors concatenated; the lengths travel without a stream sync (``ints_on``)."""
    counts = ints_on(flat.device, lengths)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=flat.device), counts, output_size=sum(lengths))
    return torch.zeros(len(lengths), dtype=dtype, device=flat.device).index_add_(0, segment, flat.to(dtype))


def live_counts(matrices: Sequence[TTMatrix], threshold: float = DEFAULT_GATE_THRESHOLD) -> list[tuple[int, ...]]:
    """Live gate entries (|g| > threshold) per internal bond of each matrix, read back with one transfer per
    device and dtype (``live_counts_later`` with the read done now)."""
    return live_counts_later(matrices, threshold)()


def live_count_tensor(matrices: Sequence[TTMatrix], threshold: float = DEFAULT_GATE_THRESHOLD) -> torch.Tensor | None:
    """``live_counts`` of every internal bond, in (matrix, bond) order, as one long tensor on the first gate's
    device, never read back (None without gates): for sizes computed on the device (CoMERA's late stage)."""
    gates = [g.detach() for tt in matrices for g in tt._stored_gates()]
    if not gates:
        return None
    device = gates[0].device
    counts = torch.zeros(len(gates), dtype=torch.long, device=device)
    for members, alive in _count_groups(gates, threshold):
        if len(members) == len(gates):  # one device and dtype, in order: the usual case
            return alive.to(device)
        counts.index_copy_(0, ints_on(device, members), alive.to(device))
    return counts


def _count_groups(gates: Sequence[torch.Tensor], threshold: float) -> list[tuple[list[int], torch.Tensor]]:
    """(indices into ``gates``, their live counts on their device) per device and dtype: one segmented sum each."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, gate in enumerate(gates):  # the comparison in each gate's own dtype, as |g| > threshold reads it
        groups.setdefault((gate.device, gate.dtype), []).append(i)
    return [
        (
            members,
            segment_sums(
                torch.cat([gates[i].reshape(-1) for i in members]).abs() > threshold,
                [gates[i].numel() for i in members],
                torch.long,
            ),
        )
        for members in groups.values()
    ]


def live_counts_later(
    matrices: Sequence[TTMatrix], threshold: float = DEFAULT_GATE_THRESHOLD
) -> Callable[[], list[tuple[int, ...]]]:
    """``live_counts`` of the gates as they are now, counted on their device now (one segmented sum per device and
    dtype: a few kernels per gate would cost a GPU step more than its optimizer) and read back to the host when the
    returned function is called: a history entry taken every step then costs no synchronisation until it is read."""
    stored = [tt._stored_gates() for tt in matrices]
    gates = [g.detach() for tt_gates in stored for g in tt_gates]
    pending = _count_groups(gates, threshold)
    shape = [len(tt_gates) for tt_gates in stored]

    def read() -> list[tuple[int, ...]]:
        counts: list[int] = [0] * len(gates)
        for members, alive in pending:
            for i, n in zip(members, alive.tolist()):
                counts[i] = n
        flat_counts = iter(counts)
        return [tuple(next(flat_counts) for _ in range(n)) for n in shape]

    return read


def physical_params(tt: TTMatrix) -> int:
    """Entries ``tt`` stores now (cores + gates)."""
    return sum(p.numel() for p in tt._stored_cores()) + sum(g.numel() for g in tt._stored_gates())


def matrix_sizes(model: nn.Module) -> tuple[int, int]:
    """(TT params, dense params) of the model's TT matrices (cores + gates; a tied matrix once)."""
    tt = dense = 0
    for entry in tt_matrices(model):
        tt += physical_params(entry.tt)
        dense += entry.tt.rows * entry.tt.cols
    return tt, dense


def is_hf_conv1d(module_or_class: nn.Module | type) -> bool:
    """Is this (the class of) transformers' ``Conv1D`` — GPT-2's linear, y = x·W + b with W stored (in × out)?
    Recognised by name, so transformers need not be installed."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")
