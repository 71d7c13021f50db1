"""How comera_fx reads a model's calls: the tensor in a module's output, and where a block's hidden state sits.

Shared by distillation (matching outputs and hidden states, feeding blocks the teacher's inputs) and the sequential
refit (calling a transformer's blocks one at a time on cached inputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def default_output(outputs: Any) -> Tensor:
    """The tensor to match: the output itself, ``last_hidden_state``, or the first tensor of a tuple / dict."""
    if isinstance(outputs, Tensor):
        return outputs
    hidden = getattr(outputs, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    values = outputs.values() if isinstance(outputs, Mapping) else outputs if isinstance(outputs, (tuple, list)) else ()
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise ValueError(f"cannot find a tensor to match in the model's output of type {type(outputs).__name__}; "
                     f"pass output_fn=lambda outputs: <the tensor to match>")


def input_slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where a block's input hidden states sit in its call: the first tensor argument, else ``hidden_states=``."""
    for i, value in enumerate(args):
        if isinstance(value, Tensor):
            return i
    return "hidden_states" if isinstance(kwargs.get("hidden_states"), Tensor) else None
