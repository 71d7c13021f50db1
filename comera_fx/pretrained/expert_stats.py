"""Calibration statistics for expert weights: each expert's inputs, from the tokens routed to it.

``comera_fx.calibrate`` records the inputs of ``nn.Linear`` / Conv1D modules; an expert's matrix is a slice of a
3D parameter read inside the experts module's own loop, so there is no module to hook. Here the model runs on the
calibration batches under a ``TorchFunctionMode`` that sees every op reading one expert's slice (``F.linear(x,
P[e])``, ``x @ P[e]``) or the whole parameter as ``bmm``'s right operand, and accumulates C_e = XᵀX / n of the
rows x that reached expert e: only the tokens the router sent there. transformers experts modules run their eager
loop for this (their ``batched_mm`` / ``grouped_mm`` paths read all experts at once); the config is restored.

The statistics are keyed ``<3D parameter FQN>.<e>``, the name ``tensorize_`` gives expert e's matrix, and are
merged into a ``Calibration``: ``tensorize_(model, config, calibration=...)`` then decomposes each expert with the
activation-aware TT-SVD (``tt/whiten.py``), minimising ||X_e (M_e − M̂_e)|| instead of ||M_e − M̂_e||.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..moe.weight import single_index
from ..passes.find import split_example_inputs
from ..passes.find_experts import _BMM, _LINEAR, _MATMUL, find_experts
from .calibrate import Calibration, InputStats
from .calling import eval_modes, preserved_rng


class _InputRecorder(TorchFunctionMode):
    """Sums xᵀx (float64) per (3D parameter, expert) over the rows each expert's ops read."""

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.params = params
        self.slices: dict[int, tuple[str, int, Tensor]] = {}
        self.sums: dict[str, Tensor] = {}
        self.rows: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__getitem__" and args and id(args[0]) in self.params:
            expert = single_index(args[1])
            if expert is not None:
                self.slices[id(out)] = (self.params[id(args[0])], expert % args[0].shape[0], out)
            return out
        if len(args) < 2 or not isinstance(args[0], Tensor):
            return out
        x, weight = args[0], args[1]
        if id(weight) in self.slices and (func in _LINEAR or func in _MATMUL):
            fqn, expert, _ = self.slices[id(weight)]
            self._add(f"{fqn}.{expert}", x)
        elif id(weight) in self.params and func in _BMM and x.dim() == 3:
            for expert in range(x.shape[0]):
                self._add(f"{self.params[id(weight)]}.{expert}", x[expert])
        return out

    def _add(self, name: str, x: Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        gram = flat.T @ flat
        self.sums[name] = self.sums[name] + gram if name in self.sums else gram
        self.rows[name] = self.rows.get(name, 0) + flat.shape[0]


@contextmanager
def _eager_experts(model: nn.Module):
    """transformers experts modules run their eager loop (per-expert slices) inside the block."""
    configs = {
        id(c): (c, c._experts_implementation)
        for m in model.modules()
        if (c := getattr(m, "config", None)) is not None and hasattr(c, "_experts_implementation")
    }
    for config, _ in configs.values():
        config._experts_implementation = "eager"
    try:
        yield
    finally:
        for config, value in configs.values():
            config._experts_implementation = value


def calibrate_experts(model: nn.Module, batches, calibration=None, *, max_batches: int | None = None):
    """A ``Calibration`` holding, for every expert of every 3D expert weight of ``model``, the second moment of
    the inputs routed to it over ``batches`` (an iterable of model inputs: tensors, tuples or kwargs dicts),
    merged with ``calibration`` (e.g. ``comera_fx.calibrate``'s, for the other layers). An expert no token
    reached gets no entry: ``tensorize_`` then notes plain TT-SVD for it."""
    batches = list(batches)[:max_batches] if max_batches is not None else list(batches)
    if not batches:
        raise ValueError("calibrate_experts got no batches; pass an iterable of model inputs")
    scan = find_experts(model, batches[0])
    table = dict(model.named_parameters())
    params = {id(table[c.fqn]): c.fqn for c in scan.candidates if c.fqn in table and table[c.fqn].dim() == 3}
    recorder = _InputRecorder(params)
    with eval_modes(model), preserved_rng(), torch.no_grad(), _eager_experts(model), recorder:
        for batch in batches:
            args, kwargs = split_example_inputs(batch)
            model(*args, **kwargs)
    stats = dict(calibration or {})
    for name, total in recorder.sums.items():
        stats[name] = InputStats((total / recorder.rows[name]).cpu(), recorder.rows[name])
    return Calibration(stats, len(batches) + (calibration.batches if calibration is not None else 0))
