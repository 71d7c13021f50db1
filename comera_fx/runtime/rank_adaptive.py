"""Rank-adaptive training of TT layers: ℓ1 pressure on the rank gates, CoMERA's two-stage schedule, and physical
removal of dead rank slices (cores, gates and the optimizer's state shrink together).

``RankAdaptive`` attaches to an existing optimizer through its step hooks, so the training loop stays as it is; the
only extra call is ``hook.observe(loss)`` before ``optimizer.step()`` when the schedule needs the loss (a target
loss, plateau detection, or just the loss column of the history). See docs/rank_adaptive.md.

Objects, in the order the hook uses them:

* ``tt_matrices(model)`` — every ``TTMatrix`` once (tied ones are shared objects), with a report-style name.
* ``add_gate_penalty_`` — adds weight · ∂R/∂g to the gates' ``.grad``; R is the mean (or sum) of |g| over the
  live gate entries.
* ``achievement_lambda`` — CoMERA's late-stage switch: 1 when the size is relatively farther from its target than
  the loss, else 0.
* ``shrink_`` — removes the dead slices of one matrix and swaps the new parameters into the optimizer.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx, nn

from ..report import DEFAULT_GATE_THRESHOLD, _layer_name
from ..tt.layers import TTMatrix, planned_envelope, planned_ops

EARLY, LATE = "early", "late"

# --------------------------------------------------------------------------------------------- finding matrices


@dataclass(frozen=True)
class MatrixEntry:
    """One TT matrix of the model. ``shrinkable`` is False for matrices registered by the graph pass
    (``passes.tensorize``): their ranks are baked into the graph as constants, so their slices cannot be removed."""

    name: str
    tt: TTMatrix
    shrinkable: bool


def tt_matrices(model: nn.Module) -> list[MatrixEntry]:
    """Every TTMatrix of ``model`` once, in registration order (a tied matrix appears under its first name)."""
    found: dict[int, MatrixEntry] = {}
    frozen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        for child in module.children():
            if isinstance(child, TTMatrix) and isinstance(module, fx.GraphModule):
                frozen.add(id(child))
        if isinstance(module, TTMatrix) and id(module) not in found:
            found[id(module)] = MatrixEntry(_layer_name(path), module, True)
    return [MatrixEntry(e.name, e.tt, id(e.tt) not in frozen) for e in found.values()]


def param_groups(
    model: nn.Module,
    *,
    lr_cores: float = 1e-4,
    lr_gates: float = 1e-3,
    lr_other: float = 5e-5,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups "tt_cores", "tt_gates" and "other" with CoMERA's separate learning rates.

    Every parameter appears exactly once (a tied matrix's cores too). Empty groups are left out. The gates get no
    weight decay whatever ``weight_decay`` is: decay would be a second, unscheduled rank penalty next to the one
    ``RankAdaptive`` controls.
    """
    matrices = tt_matrices(model)
    cores = [p for m in matrices for p in m.tt.cores]
    gates = [p for m in matrices for p in m.tt.gates]
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken]
    groups = [
        {"name": "tt_cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "tt_gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "other", "params": other, "lr": lr_other, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


# ------------------------------------------------------------------------------------------------ size accounting


def _live_counts(matrices: Sequence[MatrixEntry], threshold: float) -> list[tuple[int, ...]]:
    """Live gate entries (|g| > threshold) per bond of each matrix, read back with one transfer per device."""
    gates = [g for m in matrices for g in m.tt.gates]
    if not gates:
        return [() for _ in matrices]
    counts = [(g.detach().abs() > threshold).sum().to(gates[0].device) for g in gates]
    flat = iter(torch.stack(counts).tolist())
    return [tuple(next(flat) for _ in m.tt.gates) for m in matrices]


def params_at_ranks(tt: TTMatrix, internal_ranks: Sequence[int]) -> int:
    """Cores + gates of ``tt`` if its bonds had ``internal_ranks``; 0 once a bond is 0 (the matrix is zero and
    pruning empties every core)."""
    if any(r == 0 for r in internal_ranks):
        return 0
    return tt.layout.with_ranks((1, *internal_ranks, 1)).num_params  # num_params counts the gates too


def physical_params(tt: TTMatrix) -> int:
    return sum(p.numel() for p in tt.parameters())


# ------------------------------------------------------------------------------------------------ gradient terms


def add_gate_penalty_(gates: Sequence[Tensor], weight: float, threshold: float, reduction: str = "mean") -> None:
    """Add weight · ∂R/∂g to each gate's ``.grad``, R = mean (or sum) of |g| over the live entries (|g| > threshold).

    Adding to ``.grad`` instead of to the loss keeps the user's loss and backward untouched. The number of live
    entries is piecewise constant, so it is treated as a constant; dead entries get no pull (they count as zero and
    pruning removes them). Everything stays on the device: no host synchronisation.
    """
    gates = [g for g in gates if g.requires_grad and g.numel() > 0]
    if not gates or weight == 0:
        return
    masks = [g.detach().abs() > threshold for g in gates]
    count = None
    if reduction == "mean":
        count = torch.stack([m.sum().to(gates[0].device) for m in masks]).sum().clamp_min(1)
    for gate, mask in zip(gates, masks):
        # weight stays a Python float so the scale is computed in the gate's own precision
        scale = weight if count is None else weight / count.to(gate.device, gate.dtype)
        pull = torch.sign(gate.detach()) * mask * scale
        if gate.grad is None:
            gate.grad = pull
        else:
            gate.grad.add_(pull)


def scale_grads_(params: Iterable[Tensor], factor: float) -> None:
    """Multiply every existing gradient by ``factor`` (the late stage's weight on the task loss)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def achievement_lambda(loss: float | None, target_loss: float | None, size: int, target_size: float) -> float:
    """CoMERA's λ = [(L − L_t)/L < (S − S_t)/S]: 1 pushes the size, 0 the loss — whichever is relatively farther
    from its target.

    Without a target loss (or an observed loss) the loss counts as on target (gap 0), so the size is pushed until
    it reaches S_t and the task loss gets the gradient afterwards. |L| is the denominator so negative losses work.
    """
    loss_gap = 0.0
    if loss is not None and target_loss is not None:
        loss_gap = (loss - target_loss) / max(abs(loss), 1e-12)
    size_gap = (size - target_size) / size if size > 0 else -math.inf
    return 1.0 if loss_gap < size_gap else 0.0


# ------------------------------------------------------------------------------------------------------ shrinking


@dataclass(frozen=True)
class ShrinkRecord:
    """What ``shrink_`` did to one matrix. ``zeroed``: a bond lost every slice, so the whole matrix is zero and
    every core is now empty (the layer keeps only its bias)."""

    name: str
    old_ranks: tuple[int, ...]
    new_ranks: tuple[int, ...]
    params_before: int
    params_after: int
    zeroed: bool


def _take(t: Tensor, first: Tensor | None, last: Tensor | None) -> Tensor:
    """Keep the given indices on the first and/or last axis (index_select copies, so the result owns its memory)."""
    if first is not None:
        t = t.index_select(0, first)
    if last is not None:
        t = t.index_select(t.dim() - 1, last)
    return t


def _slice_state(state: dict[str, Any], old: Tensor, fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """Slice every per-element optimizer state tensor (Adam's moments, SGD's momentum) like the parameter; keep
    scalars (``step``). Any other shape means a factored state we cannot slice safely, so refuse."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != old.shape:
                raise NotImplementedError(f"optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                                          f"parameter's {tuple(old.shape)}; RankAdaptive can only slice "
                                          f"elementwise optimizer states (Adam, AdamW, SGD, RMSprop, ...)")
            value = fn(value)
        out[key] = value
    return out


def swap_parameter_(optimizer: torch.optim.Optimizer | None, old: nn.Parameter, new: nn.Parameter,
                    fn: Callable[[Tensor], Tensor]) -> None:
    """Put ``new`` at ``old``'s position in every param group and move ``old``'s state over, sliced by ``fn``."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if p is old:
                params[i] = new
    if old in optimizer.state:
        optimizer.state[new] = _slice_state(optimizer.state.pop(old), old, fn)


def _replace_(plist: nn.ParameterList, k: int, fn: Callable[[Tensor], Tensor],
              optimizer: torch.optim.Optimizer | None) -> None:
    old = plist[k]
    new = nn.Parameter(fn(old.detach()), requires_grad=old.requires_grad)
    if old.grad is not None:  # keep accumulated gradients of a loop that does not zero them right after step
        new.grad = fn(old.grad)
    plist[k] = new
    swap_parameter_(optimizer, old, new, fn)


def shrink_(tt: TTMatrix, *, threshold: float = DEFAULT_GATE_THRESHOLD, optimizer: torch.optim.Optimizer | None = None,
            name: str = "") -> ShrinkRecord | None:
    """Remove the slices of ``tt`` whose gate entry is dead (|g| <= threshold), physically.

    Gate k sits between core k (last axis) and core k+1 (first axis): its dead entries are dropped from all three,
    and the new parameters replace the old ones in ``tt``'s ParameterLists and in ``optimizer`` (same positions,
    state sliced to match). Exact when the dead entries are exactly 0; otherwise it drops terms of size
    <= threshold, as CoMERA's masking does. If a bond loses every entry the matrix is zero and every core becomes
    empty (``TTMatrix.is_zero``). Returns None when nothing is dead.
    """
    if not tt.gates or tt.is_zero:
        return None
    masks = [g.detach().abs() > threshold for g in tt.gates]
    counts = torch.stack([m.sum().to(masks[0].device) for m in masks]).tolist()
    sizes = [m.numel() for m in masks]
    if counts == sizes:
        return None
    old_ranks, before = tt.ranks, physical_params(tt)
    was_planned = planned_ops(tt.layout)
    zeroed = 0 in counts
    if zeroed:
        masks = [torch.zeros_like(m) for m in masks]
    keep = [m.nonzero().squeeze(1) for m in masks]
    changed = [zeroed or c != s for c, s in zip(counts, sizes)]
    n = len(tt.cores)
    for k in range(n):
        first = keep[k - 1] if k > 0 and changed[k - 1] else None
        last = keep[k] if k < n - 1 and changed[k] else None
        if first is not None or last is not None:
            _replace_(tt.cores, k, lambda t, f=first, l=last: _take(t, f, l), optimizer)
    for k in range(n - 1):
        if changed[k]:
            _replace_(tt.gates, k, lambda t, i=keep[k]: t.index_select(0, i), optimizer)
    if not tt.is_zero:
        # Plan the new ranks now for what was planned before: a compiled model retraces after the shapes change,
        # and a traced graph can only read plans (without one it would run the fixed fallback order).
        for op in was_planned:
            planned_envelope(tt.layout, op)
    return ShrinkRecord(name, old_ranks, tt.ranks, before, physical_params(tt), zeroed)


# ------------------------------------------------------------------------------------------------- stage switch


@dataclass
class PlateauDetector:
    """Says when the loss stopped improving: no new best (by a relative margin ``tol``) for ``patience`` steps.
    Compares against the best loss so far, which tolerates per-batch noise better than step-to-step changes."""

    patience: int
    tol: float
    best: float = math.inf
    since: int = 0

    def update(self, loss: float) -> bool:
        if self.best == math.inf or loss < self.best - self.tol * abs(self.best):
            self.best, self.since = loss, 0
        else:
            self.since += 1
        return self.since >= self.patience


# ------------------------------------------------------------------------------------------------------ history


@dataclass(frozen=True)
class HistoryEntry:
    """The state after one optimizer step. ``ranks``: stored core ranks; ``live_ranks``: gate entries above the
    threshold. ``lam`` is the late stage's λ (None in the early stage); ``shrunk`` lists the layers pruned at
    this step and ``zeroed`` those that became entirely zero (removed: only their bias is left)."""

    step: int
    stage: str
    loss: float | None
    lam: float | None
    ranks: dict[str, tuple[int, ...]]
    live_ranks: dict[str, tuple[int, ...]]
    tt_params: int
    live_tt_params: int
    dense_params: int
    shrunk: tuple[str, ...]
    zeroed: tuple[str, ...]
    wall_time: float

    @property
    def compression(self) -> float | None:
        return self.dense_params / self.tt_params if self.tt_params else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = {k: list(v) for k, v in self.ranks.items()}
        out["live_ranks"] = {k: list(v) for k, v in self.live_ranks.items()}
        out["shrunk"], out["zeroed"] = list(self.shrunk), list(self.zeroed)
        out["compression"] = self.compression
        return out


# ------------------------------------------------------------------------------------------------------- the hook


def _check(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"RankAdaptive: {name} must be {what}; got {value!r}")


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass
class _Settings:
    """Validated constructor arguments (see ``RankAdaptive``)."""

    l1_weight: float
    threshold: float
    prune_every: int | None
    target_ratio: float | None
    target_params: int | None
    target_loss: float | None
    late_start_step: int | None
    plateau_patience: int | None
    plateau_tol: float
    reduction: str
    late_loss_weight: float
    late_size_weight: float
    history_every: int | None

    def __post_init__(self) -> None:
        _check("l1_weight", self.l1_weight, self.l1_weight >= 0, "a float >= 0")
        _check("threshold", self.threshold, self.threshold >= 0, "a float >= 0")
        for name in ("prune_every", "plateau_patience", "history_every"):
            value = getattr(self, name)
            _check(name, value, value is None or _is_int(value, 1), "an int >= 1 or None")
        _check("late_start_step", self.late_start_step,
               self.late_start_step is None or _is_int(self.late_start_step, 0), "an int >= 0 or None")
        _check("target_ratio", self.target_ratio, self.target_ratio is None or 0 < self.target_ratio <= 1,
               "a float in (0, 1] or None")
        _check("target_params", self.target_params, self.target_params is None or _is_int(self.target_params, 0),
               "an int >= 0 or None")
        _check("target_ratio / target_params", (self.target_ratio, self.target_params),
               self.target_ratio is None or self.target_params is None, "given at most one of them")
        _check("reduction", self.reduction, self.reduction in ("mean", "sum"), "'mean' or 'sum'")
        _check("plateau_tol", self.plateau_tol, self.plateau_tol >= 0, "a float >= 0")
        has_switch = self.late_start_step is not None or self.plateau_patience is not None
        _check("late_start_step / plateau_patience", (self.late_start_step, self.plateau_patience),
               not has_switch or self.has_target, "used with target_ratio or target_params (the late stage "
               "needs a size target)")

    @property
    def has_target(self) -> bool:
        return self.target_ratio is not None or self.target_params is not None


class RankAdaptive:
    """Rank adaptation of every TT layer of ``model``, driven by ``optimizer``'s step hooks.

    Build it after the optimizer (whose parameters must include the TT gates); then per step::

        loss.backward(); hook.observe(loss); optimizer.step(); optimizer.zero_grad()

    Early stage: ``l1_weight`` · ∂R/∂g is added to the gates' gradients, R = mean |live gate entries| over all TT
    matrices (``reduction="sum"``: the sum). Late stage (needs ``target_ratio`` or ``target_params``; optional
    ``target_loss``), from step ``late_start_step`` or once the observed loss plateaus (no relative improvement
    over ``plateau_tol`` for ``plateau_patience`` steps): every gradient is scaled by (1 − λ) + ``late_loss_weight``
    and (λ + ``late_size_weight``) · ∂R/∂g is added, with λ from ``achievement_lambda`` on the live TT parameter
    count. ``late_size_weight`` defaults to 0 (CoMERA's code uses 0.01): any size pull left on once the target is met
    keeps moving every unimportant gate by about one learning rate per step under Adam, and the size falls far below
    the target (docs/rank_adaptive.md). Every ``prune_every`` steps the dead slices (|g| <= ``threshold``) are
    removed for real, optimizer state included. ``history`` holds one ``HistoryEntry`` per ``history_every`` steps
    and per pruning.

    The parameters of shrunk matrices are new objects: read ``model.parameters()`` afresh after a pruning step
    (do not keep lists of them across steps).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        l1_weight: float = 0.01,
        threshold: float = DEFAULT_GATE_THRESHOLD,
        prune_every: int | None = 100,
        target_ratio: float | None = None,
        target_params: int | None = None,
        target_loss: float | None = None,
        late_start_step: int | None = None,
        plateau_patience: int | None = None,
        plateau_tol: float = 1e-3,
        reduction: str = "mean",
        late_loss_weight: float = 0.1,
        late_size_weight: float = 0.0,
        history_every: int | None = 1,
    ):
        self.settings = _Settings(l1_weight, threshold, prune_every, target_ratio, target_params, target_loss,
                                  late_start_step, plateau_patience, plateau_tol, reduction, late_loss_weight,
                                  late_size_weight, history_every)
        self.model, self.optimizer = model, optimizer
        self.matrices = tt_matrices(model)
        self._check_model()
        self.initial_tt_params = sum(physical_params(m.tt) for m in self.matrices)
        self.step = 0
        self.stage = EARLY
        self.switch_step: int | None = None
        self.history: list[HistoryEntry] = []
        self._plateau = PlateauDetector(plateau_patience, plateau_tol) if plateau_patience is not None else None
        self._pending_loss: float | None = None
        self._step_loss: float | None = None
        self._step_lam: float | None = None
        self._start = time.perf_counter()
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def _check_model(self) -> None:
        if not self.matrices:
            raise ValueError("RankAdaptive: the model has no TTMatrix; run comera_fx.tensorize_(model, ...) first")
        optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [m.name for m in self.matrices if any(id(g) not in optimized for g in m.tt.gates)]
        if missing:
            raise ValueError(f"RankAdaptive: the optimizer does not hold the gates of {missing}; build it after "
                             f"tensorize_ (e.g. from comera_fx.runtime.param_groups(model))")
        frozen = [m.name for m in self.matrices if not m.shrinkable]
        if frozen and self.settings.prune_every is not None:
            warnings.warn(f"RankAdaptive: {frozen} come from the graph pass, whose ranks are constants of the graph; "
                          f"their gates are penalised but their slices are never removed", stacklevel=3)

    # -- public API ----------------------------------------------------------------------------------------------

    @property
    def target_size(self) -> float | None:
        """S_t in TT parameters (cores + gates), or None without a target."""
        if self.settings.target_params is not None:
            return float(self.settings.target_params)
        if self.settings.target_ratio is not None:
            return self.settings.target_ratio * self.initial_tt_params
        return None

    def observe(self, loss: float | Tensor) -> None:
        """Pass this step's loss; call once per step, before ``optimizer.step()`` (it applies to that step).
        Reads the value to the host (one synchronisation)."""
        self._pending_loss = float(loss.detach()) if torch.is_tensor(loss) else float(loss)

    def tt_params(self) -> int:
        """Stored TT parameters (cores + gates) now."""
        return sum(physical_params(m.tt) for m in self.matrices)

    def live_tt_params(self) -> int:
        """TT parameters the model would hold if every dead slice were removed now (the S of the late stage)."""
        counts = _live_counts(self.matrices, self.settings.threshold)
        return sum(params_at_ranks(m.tt, c) for m, c in zip(self.matrices, counts))

    def prune(self) -> list[ShrinkRecord]:
        """Remove every dead slice now (also done automatically every ``prune_every`` steps)."""
        records = []
        for m in self.matrices:
            if m.shrinkable:
                record = shrink_(m.tt, threshold=self.settings.threshold, optimizer=self.optimizer, name=m.name)
                if record is not None:
                    records.append(record)
        return records

    def remove(self) -> None:
        """Detach from the optimizer; later steps are plain optimizer steps. Safe to call twice."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> "RankAdaptive":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def history_as_dicts(self) -> list[dict[str, Any]]:
        return [entry.to_dict() for entry in self.history]

    def save_history(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.history_as_dicts(), indent=1))

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (not the history), so a resumed run switches stage and prunes at the same steps."""
        plateau = None if self._plateau is None else {"best": self._plateau.best, "since": self._plateau.since}
        return {"step": self.step, "stage": self.stage, "switch_step": self.switch_step,
                "initial_tt_params": self.initial_tt_params, "plateau": plateau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.stage, self.switch_step = state["step"], state["stage"], state["switch_step"]
        self.initial_tt_params = state["initial_tt_params"]
        if self._plateau is not None and state.get("plateau") is not None:
            self._plateau.best, self._plateau.since = state["plateau"]["best"], state["plateau"]["since"]

    # -- hooks ---------------------------------------------------------------------------------------------------

    def _gates(self) -> list[Tensor]:
        return [g for m in self.matrices for g in m.tt.gates]

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _update_stage(self, loss: float | None) -> None:
        """Early → late at ``late_start_step`` or on a plateau of the observed loss; never back."""
        if self.stage == LATE or not self.settings.has_target:
            return
        plateaued = self._plateau is not None and loss is not None and self._plateau.update(loss)
        start = self.settings.late_start_step
        if plateaued or (start is not None and self.step >= start):
            self.stage, self.switch_step = LATE, self.step

    def _late_lambda(self, loss: float | None) -> float:
        if self.settings.target_loss is not None and loss is None:
            raise RuntimeError("RankAdaptive: target_loss is set, so call hook.observe(loss) before every "
                               "optimizer.step() in the late stage")
        return achievement_lambda(loss, self.settings.target_loss, self.live_tt_params(), self.target_size)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if closure is not None:
            raise RuntimeError("RankAdaptive: optimizer.step(closure) is not supported; the gradients must exist "
                               "before step() (call backward first)")
        loss, self._pending_loss = self._pending_loss, None
        self._update_stage(loss)
        s = self.settings
        if self.stage == EARLY:
            lam = None
            add_gate_penalty_(self._gates(), s.l1_weight, s.threshold, s.reduction)
        else:
            lam = self._late_lambda(loss)
            scale_grads_(self._params(), (1.0 - lam) + s.late_loss_weight)
            add_gate_penalty_(self._gates(), lam + s.late_size_weight, s.threshold, s.reduction)
        self._step_loss, self._step_lam = loss, lam

    def _post_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        s = self.settings
        records = self.prune() if s.prune_every is not None and self.step % s.prune_every == 0 else []
        if records or (s.history_every is not None and self.step % s.history_every == 0):
            self.history.append(self._entry(records))

    def _entry(self, records: Sequence[ShrinkRecord]) -> HistoryEntry:
        counts = _live_counts(self.matrices, self.settings.threshold)
        ranks = {m.name: m.tt.ranks for m in self.matrices}
        live = {m.name: (1, *c, 1) for m, c in zip(self.matrices, counts)}
        live_params = sum(params_at_ranks(m.tt, c) for m, c in zip(self.matrices, counts))
        dense = sum(m.tt.layout.dense_params for m in self.matrices)
        return HistoryEntry(self.step, self.stage, self._step_loss, self._step_lam, ranks, live, self.tt_params(),
                            live_params, dense, tuple(r.name for r in records),
                            tuple(r.name for r in records if r.zeroed), time.perf_counter() - self._start)
