"""A candidate format's error measured at the model's output (``choose_formats``' output and short-list scoring),
replaying the blocks a layer cannot influence so each measurement runs only the part of the model it changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .calling import default_output
from .distill_config import repeated_blocks


class OutputError:
    """A candidate's error measured at the model's output: only that layer's weight swapped for the candidate's
    dense equivalent, ||y' - y||² / ||y||² summed over ``batches``.

    A layer inside one of the model's repeated blocks (``repeated_blocks``: a transformer's layers) cannot change
    what the blocks that finished before that block started computed, so those blocks are replayed: each call of
    theirs returns the output it gave on the reference pass, and only the embedding, that block and the ones after
    it run. The replay is used only where it is safe to read off the reference pass (every block runs in the same
    order on every batch, the layer and its weight belong to one block only) and after one check that a pass replaying
    all blocks but the last reproduces the reference outputs bit for bit; a model without repeated blocks, or
    failing any of this, is run whole."""

    def __init__(self, model: nn.Module, batches: Sequence, output_fn):
        from ..passes.find import split_example_inputs

        self.model, self.output_fn = model, output_fn or default_output
        self.calls = [split_example_inputs(b) for b in batches]
        self.blocks = [(path, model.get_submodule(path)) for path in repeated_blocks(model)]
        self.reference, self._outputs, self._before = self._record()
        self._owner = self._owners(model)
        self.passes = 0
        if self.blocks and not self._replays_exactly():
            self._before = {}

    def _run(self, replay: dict[int, list] | None = None) -> list[Tensor]:
        """The output tensors over the batches (float64); ``replay``: block index -> its outputs per batch."""
        swaps = []
        try:
            for i, outputs in (replay or {}).items():
                path, block = self.blocks[i]
                parent_path, _, name = path.rpartition(".")
                parent = self.model.get_submodule(parent_path)
                stand_in = _Replay(outputs)
                setattr(parent, name, stand_in)
                swaps.append((parent, name, block, stand_in))
            found = []
            for b, (args, kwargs) in enumerate(self.calls):
                for *_, stand_in in swaps:
                    stand_in.start(b)
                found.append(self.output_fn(self.model(*args, **kwargs)).detach().double())
            return found
        finally:
            for parent, name, block, _ in swaps:
                setattr(parent, name, block)

    def _record(self):
        """The reference outputs, each block's outputs per batch and call, and per block the blocks that finished
        before it started on every batch (None where the order differed between batches)."""
        tick = [0]
        starts: dict[int, list] = {i: [] for i in range(len(self.blocks))}
        ends: dict[int, list] = {i: [] for i in range(len(self.blocks))}
        outputs: dict[int, list] = {i: [] for i in range(len(self.blocks))}
        handles = []

        def pre(i):
            def hook(module, args):
                starts[i][-1].append(tick[0])
                tick[0] += 1

            return hook

        def post(i):
            def hook(module, args, output):
                ends[i][-1].append(tick[0])
                outputs[i][-1].append(output)
                tick[0] += 1

            return hook

        for i, (_, block) in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(pre(i)))
            handles.append(block.register_forward_hook(post(i)))
        reference = []
        try:
            for args, kwargs in self.calls:
                for i in starts:
                    starts[i].append([])
                    ends[i].append([])
                    outputs[i].append([])
                reference.append(self.output_fn(self.model(*args, **kwargs)).detach().double())
        finally:
            for h in handles:
                h.remove()
        before: dict[int, list[int]] = {}
        for k in starts:
            if not all(starts[k][b] for b in range(len(self.calls))):
                continue
            done = [
                i
                for i in starts
                if i != k and all(ends[i][b] and max(ends[i][b]) < min(starts[k][b]) for b in range(len(self.calls)))
            ]
            before[k] = done
        return reference, outputs, before

    def _owners(self, model: nn.Module) -> dict[int, int]:
        """id(linear) -> the index of the one block holding it, for linears held once whose weight is not shared."""
        seen: dict[int, int] = {}
        for _, module in model.named_modules(remove_duplicate=False):
            seen[id(module)] = seen.get(id(module), 0) + 1
        shared = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
        owner = {}
        for i, (_, block) in enumerate(self.blocks):
            for module in block.modules():
                weight = getattr(module, "weight", None)
                if (
                    isinstance(module, nn.Linear)
                    and seen[id(module)] == 1
                    and isinstance(weight, Tensor)
                    and shared.get(id(weight), 0) == 1
                ):
                    owner[id(module)] = i
        return owner

    def _replay_for(self, module: nn.Module) -> dict[int, list]:
        k = self._owner.get(id(module))
        if k is None or k not in self._before:
            return {}
        return {i: self._outputs[i] for i in self._before[k]}

    def _replays_exactly(self) -> bool:
        last = len(self.blocks) - 1
        if last not in self._before:
            return False
        try:
            outputs = self._run({i: self._outputs[i] for i in self._before[last]})
        except Exception:  # noqa: BLE001  (a model the replay does not fit is run whole)
            return False
        return all(torch.equal(o, r) for o, r in zip(outputs, self.reference))

    def __call__(self, module: nn.Linear, weight: Tensor) -> float:
        original = module.weight.data
        module.weight.data = weight.to(original.dtype)
        self.passes += 1
        try:
            outputs = self._run(self._replay_for(module))
        finally:
            module.weight.data = original
        num = sum(float((o - r).square().sum()) for o, r in zip(outputs, self.reference))
        den = sum(float(r.square().sum()) for r in self.reference)
        return num / den if den > 0 else 0.0


class _Replay(nn.Module):
    """A block's stand-in: returns, call by call, what the block returned on the reference pass of that batch."""

    def __init__(self, outputs: list[list]):
        super().__init__()
        self.outputs, self.batch, self.call = outputs, 0, 0

    def start(self, batch: int) -> None:
        self.batch, self.call = batch, 0

    def forward(self, *args, **kwargs):
        found = self.outputs[self.batch][self.call]
        self.call += 1
        return found
