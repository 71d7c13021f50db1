"""``RankAdaptiveCallback``: rank adaptation inside a Hugging Face ``transformers.Trainer`` run.

The Trainer builds its optimizer (and wraps it in accelerate's ``AcceleratedOptimizer``) before training starts, so
``RankAdaptive`` cannot be built next to it as in a hand-written loop. The callback builds it at ``on_train_begin``
on the unwrapped ``torch.optim.Optimizer``: its step hooks then run inside every optimizer step the Trainer takes,
and pruning swaps the shrunk parameters (and their sliced optimizer state) into that optimizer's param groups,
which the learning-rate scheduler keeps reading. The horizon is the Trainer's ``max_steps``.

Importing this module imports ``transformers``; ``comera_fx`` itself never does.
"""

from __future__ import annotations

import warnings

import torch
from transformers import TrainerCallback

from ..runtime.rank_adaptive import RankAdaptive
from ..runtime.rank_config import BUDGET, ScheduleConfig, check_schedule_config
from ..tt import TTMatrix


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside accelerate's ``AcceleratedOptimizer`` (or any wrapper holding it as
    ``.optimizer``): step hooks must sit on the object whose ``step`` really runs. (``AcceleratedOptimizer`` is
    itself an ``Optimizer`` subclass, but one that never initialised the hook tables.)"""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"RankAdaptiveCallback: cannot find a torch.optim.Optimizer in the Trainer's {type(optimizer).__name__}"
        )
    return optimizer


def declare_tt_ties_(model: torch.nn.Module) -> dict[str, str]:
    """Add to ``model._tied_weights_keys`` the cores and gates of every ``TTMatrix`` that two modules share (a
    tied embedding and head after ``tensorize_``), and return the added ``{alias: source}`` keys.

    ``save_pretrained`` (and so ``Trainer.save_model``) writes safetensors, which refuse aliased tensors unless
    the model declares them tied; the model's own ties name ``lm_head.weight``, which a TT head no longer has.
    The aliases are left out of the file; loading into a tensorized model fills them through the shared matrix.
    """
    owners: dict[int, str] = {}
    added: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TTMatrix):
            continue
        source = owners.setdefault(id(module), name)
        if source != name:
            for key, _ in module.named_parameters():
                added[f"{name}.{key}"] = f"{source}.{key}"
    if added:
        declared = dict(getattr(model, "_tied_weights_keys", None) or {})
        model._tied_weights_keys = {**declared, **added}
    return added


class RankAdaptiveCallback(TrainerCallback):
    """``Trainer(..., callbacks=[RankAdaptiveCallback(BudgetConfig(keep_fraction=0.3))])`` on a model already
    tensorized (``comera_fx.tensorize_`` before the Trainer is built, so its optimizer holds the TT cores and gates).

    ``config`` is what ``RankAdaptive`` takes (``BudgetConfig`` or ``CoMERAConfig``), ``clock`` / ``history_every``
    too. A ``BudgetConfig`` without a horizon (neither ``total_steps`` nor ``budget_seconds``) runs to the Trainer's
    ``max_steps``, known only once training begins. ``self.rank_adaptive`` is the live object (``summary()``,
    ``history``) once training has begun. TT matrices shared by two modules are declared tied
    (``declare_tt_ties_``) so that ``Trainer.save_model`` can write them. At the end of training every matrix is
    stored at its live ranks (``RankAdaptive.shrink_eagerly``: a compiled run holds them wider while it trains).

    Not supported: several processes (``RankAdaptive`` would have to rebuild the Trainer's DDP wrapper), schedules
    that read the loss (``target_loss``, ``plateau_patience``: the Trainer does not hand the loss to callbacks),
    and resuming a pruned run from a Trainer checkpoint.
    """

    def __init__(self, config: ScheduleConfig, *, clock=None, history_every: int | None = 1):
        check_schedule_config("RankAdaptiveCallback(config)", config)
        self.config = config
        self.hook_options = {"clock": clock, "history_every": history_every}
        self.rank_adaptive: RankAdaptive | None = None
        self._steps_seen = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.world_size > 1:
            raise NotImplementedError(
                "RankAdaptiveCallback runs in a single process; under several the pruned "
                "parameters would leave the Trainer's DDP wrapper out of step"
            )
        if model is None or optimizer is None:
            raise RuntimeError("RankAdaptiveCallback: the Trainer gave no model or optimizer at on_train_begin")
        config = self.config
        if config.schedule == BUDGET and not config.has_horizon:
            config = config.replace(total_steps=state.max_steps)
        self.rank_adaptive = RankAdaptive(model, unwrap_optimizer(optimizer), config, **self.hook_options)
        declare_tt_ties_(model)  # so that Trainer.save_model can write the shared TT head
        self._steps_seen = self.rank_adaptive.step

    def on_optimizer_step(self, args, state, control, **kwargs):
        # The hooks count the steps they ran in; a step they missed means the Trainer stepped another optimizer.
        hook = self.rank_adaptive
        if hook is not None and hook.step == self._steps_seen:
            warnings.warn(
                "RankAdaptiveCallback: the Trainer took an optimizer step that RankAdaptive's hooks did "
                "not see (was the optimizer replaced after training began?); ranks are not adapted",
                stacklevel=2,
            )
        if hook is not None:
            self._steps_seen = hook.step

    def on_train_end(self, args, state, control, **kwargs):
        if self.rank_adaptive is not None:
            # A compiled run holds its cores at stored widths wider than the live ranks (zero slices past them,
            # fewer recompiles); training is over, so store the live ranks: what save_model writes is the
            # pruned size. (A no-op for an eager run, which shrank at every prune.)
            self.rank_adaptive.shrink_eagerly()
            self.rank_adaptive.remove()  # the hooks go; the object stays readable
