"""Where distillation's batches come from: the user's iterable (restarted when exhausted) or callable, one batch at a
time. Shared by ``distill_``, ``match_teacher``, ``compress_`` and ``augmented``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

Batches = Iterable[Any] | Callable[[], Any]


class BatchStream:
    """Batches from a callable (one call per batch) or an iterable (restarted when exhausted, if it can be)."""

    def __init__(self, batches: Batches):
        if callable(batches) and not isinstance(batches, (Sequence, nn.Module)):
            self._call, self._iterable = batches, None
        elif isinstance(batches, Iterable):
            self._call, self._iterable = None, batches
        else:
            raise ValueError(
                f"batches must be an iterable of model inputs or a callable returning one; got {type(batches).__name__}"
            )
        self._it = None
        self._replay: list[Any] = []
        self.exhausted = False

    def push_back(self, batches: Sequence[Any]) -> None:
        """Hand these batches out again first (the calibration batches also serve for training)."""
        self._replay = list(batches) + self._replay

    def next(self) -> Any | None:
        """The next batch, or None when a one-shot iterator is used up."""
        batch = self._replay.pop(0) if self._replay else self._draw()
        if batch is not None and not isinstance(batch, (Mapping, tuple, list, Tensor)):
            raise ValueError(
                f"a batch must be a dict of keyword inputs, a tuple of positional inputs or a tensor; "
                f"got {type(batch).__name__}"
            )
        return batch

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` batches (fewer when a one-shot iterator runs out); a ValueError when there is none at all."""
        drawn = [b for b in (self.next() for _ in range(n)) if b is not None]
        if n and not drawn:
            raise ValueError("batches yielded no batch; pass an iterable of model inputs or a callable returning one")
        return drawn

    def _draw(self) -> Any | None:
        if self._call is not None:
            return self._call()
        for attempt in range(2):
            if self._it is None:
                self._it = iter(self._iterable)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                if self._iterable is iter(self._iterable) or attempt:  # a one-shot iterator, or an empty iterable
                    self.exhausted = True
                    return None
        return None
