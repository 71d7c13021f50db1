"""The training loop of distillation, for any student: ``match_teacher`` trains it (AdamW, warm-up then cosine) to
reproduce the teacher's outputs and hidden states until a budget of steps or seconds is spent, under
``torch.distributed`` too. ``distill_`` and ``compress_`` build the student, then call it."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.nn.parallel import DistributedDataParallel

from ..quantize import on_grid, quantized_specs
from ..runtime.distributed import RankSync, world_size
from .augment import Augmenter
from .batches import Batches, BatchStream
from .calling import call_model, default_output, eval_modes
from .distill_config import DistillConfig, check_distill_config, matched_loss, refuse_loose_settings, resolved
from .keep_best import BestWeights
from .match_hooks import HiddenCapture, TeacherInputs
from .student_checks import check_budget


def match_teacher(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    budget_seconds: float | None = None,
    *,
    steps: int | None = None,
    config: DistillConfig | None = None,
    on_optimizer: Callable[[torch.optim.Optimizer, nn.Module], Callable[[], nn.Module] | None] | None = None,
    observe: Callable[[Tensor], Any] | None = None,
    postfix: Callable[[], dict] | None = None,
    validation: Sequence[Any] | None = None,
    validation_curve: list[tuple[int, float]] | None = None,
    **removed: Any,
) -> tuple[list[float], float, list[str]]:
    """Train ``student`` (any model: no tensorization here) to reproduce ``teacher`` on ``batches`` until
    ``budget_seconds`` (on ``config.clock``, default ``time.perf_counter``) and/or ``steps`` are spent; the
    distillation settings are ``config`` (a ``DistillConfig``; its model-derived defaults resolved against these
    models). Returns (loss per step, seconds, notes).

    ``on_optimizer(optimizer, model)`` runs once the optimizer exists, with the model the loop calls (attach a
    ``RankAdaptive`` to it there); it may return a callable giving the model to call from then on
    (``lambda: hook.model``). ``observe(loss)`` runs before every ``optimizer.step()``; ``postfix()`` adds fields to
    the progress bar. Both models run in eval mode; their training flags are restored. With ``config.quant_aware``
    the last share of the run trains at the weights ``quantize_`` / ``apply_formats_`` put on a grid, rounded
    (``comera_fx.quantize.on_grid``), and the step updates their float values; ``requantize_`` the student
    afterwards.

    ``validation``: batches not trained on; their loss is measured at the start and every 5 % of the budget (at the
    rounded weights when the student has quantized ones), and the weights at the lowest one are put back at the end
    (a note says so), so the run never returns a student worse on them than it started (``keep_best``). Not with
    ``on_optimizer`` (rank adaptation changes the shapes a snapshot would restore). ``validation_curve``: a list
    that receives (step, validation loss) of every check.

    Under ``torch.distributed`` (an initialized group of several ranks; every rank calls it with its own batches)
    the student is wrapped in ``DistributedDataParallel(student, find_unused_parameters=True)`` for the loop (its
    constructor broadcasts rank 0's parameters and buffers), rank 0's clock decides the end of a
    ``budget_seconds`` run, the run ends on every rank when any rank's batches run out, and the losses returned are
    the mean over the ranks, the seconds rank 0's."""
    refuse_loose_settings("match_teacher", removed)
    check_budget("match_teacher", budget_seconds, steps)
    if validation is not None and on_optimizer is not None:
        raise ValueError(
            "match_teacher(validation=...) restores a snapshot of the best weights at the end, and on_optimizer "
            "(e.g. a RankAdaptive hook) may change their shapes; pass one or the other"
        )
    config = resolved(check_distill_config("match_teacher", config), student, teacher)
    _check_blockwise(config)
    _check_quant_aware(config.quant_aware, student)
    stream = batches if isinstance(batches, BatchStream) else BatchStream(batches)
    augmenter = Augmenter(config.augment) if config.augment is not None else None
    output_fn = config.output_fn or default_output
    clock = config.clock or time.perf_counter
    autocast = autocast_context(config.autocast, model_device(student))
    hidden_modules, quant_aware, blockwise = config.hidden_modules, config.quant_aware, config.blockwise_fraction
    notes: list[str] = []
    trainable = [p for p in student.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the student has no trainable parameter (every weight is frozen); nothing to distill")
    sync = RankSync(None) if world_size() > 1 else None
    device = model_device(student)
    # find_unused_parameters: a part of the model the matched output does not depend on (BERT's pooler) gets no
    # gradient; DDP would otherwise raise at the next step
    runner = DistributedDataParallel(student, find_unused_parameters=True) if sync is not None else student
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    current = on_optimizer(optimizer, runner) if on_optimizer is not None else None

    modes = contextlib.ExitStack()  # both models in eval mode for the loop, each module's flag restored after it
    modes.enter_context(eval_modes(teacher))
    modes.enter_context(eval_modes(student))
    t_capture = HiddenCapture(teacher, hidden_modules) if hidden_modules else None
    s_capture = HiddenCapture(student, hidden_modules) if hidden_modules else None
    feed = TeacherInputs(teacher, student, hidden_modules) if blockwise else None
    bar = _progress_bar(config.progress and (sync is None or dist.get_rank() == 0), steps, budget_seconds)
    losses: list[float] = []
    keeper = None
    if validation is not None:
        keeper = BestWeights(
            student,
            teacher,
            validation,
            config=config,
            output_fn=output_fn,
            hidden=(t_capture, s_capture) if t_capture else None,
            reduce=(lambda value: sync.mean(value, device)) if sync is not None else None,
        )
    start = clock()
    try:
        if keeper is not None:
            _validate(keeper, feed, 0, 0.0)
        while True:
            elapsed = clock() - start
            if sync is not None and budget_seconds:
                elapsed = sync.value(elapsed, device)  # rank 0's clock: every rank stops at the same step
            done = [len(losses) / steps if steps else 0.0, elapsed / budget_seconds if budget_seconds else 0.0]
            if max(done) >= 1.0:
                break
            batch = stream.next()
            ran_out = batch is None
            if sync is not None:
                ran_out = sync.mean(float(ran_out), device) > 0  # any rank's iterator ends the run on all
            if ran_out:
                notes.append(f"the batch iterator ran out after {len(losses)} steps, before the budget was spent")
                break
            if augmenter is not None:
                batch = augmenter(batch)
            model = current() if current is not None else runner
            for group in optimizer.param_groups:
                group["lr"] = config.lr * lr_factor(max(done))
            if feed is not None:
                feed.active = max(done) < blockwise
                feed.new_step()
            with torch.no_grad(), autocast():
                target = widened(output_fn(call_model(teacher, batch)).detach())
                t_hidden = {k: widened(v.detach()) for k, v in t_capture.outputs.items()} if t_capture else {}
            with on_grid(student) if quant_aware and max(done) >= 1 - quant_aware else contextlib.nullcontext():
                with autocast():
                    out = output_fn(call_model(model, batch))
                s_hidden = {k: widened(v) for k, v in s_capture.outputs.items()} if s_capture else {}
                loss = matched_loss(config, widened(out), target, s_hidden, t_hidden)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            if observe is not None:
                observe(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
            if keeper is not None:
                # the clock read at the top of this step (rank 0's under torch.distributed): every rank checks at
                # the same steps, as the check's loss is all-reduced
                progress = max(len(losses) / steps if steps else 0.0, done[1])
                if keeper.due(progress):
                    _validate(keeper, feed, len(losses), progress)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", **(postfix() if postfix else {}))
        if keeper is not None:
            if not keeper.curve or keeper.curve[-1][0] != len(losses):
                _validate(keeper, feed, len(losses), 1.0)
            notes += keeper.restore(len(losses))
            if validation_curve is not None:
                validation_curve.extend(keeper.curve)
    finally:
        if t_capture:
            t_capture.remove()
            s_capture.remove()
        if feed is not None:
            feed.remove()
        modes.close()
        if bar is not None:
            bar.close()
    seconds = clock() - start
    if not losses:
        raise ValueError("batches yielded no batch; pass an iterable of model inputs or a callable returning one")
    if sync is not None:
        seconds = sync.value(seconds, device)
        mean = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        losses = (mean / sync.size).tolist()
    return losses, seconds, notes


def _validate(keeper: BestWeights, feed: TeacherInputs | None, step: int, progress: float) -> None:
    """A validation check with every block on its own predecessor's output (block-wise feeding off)."""
    active = feed.active if feed is not None else False
    if feed is not None:
        feed.active = False
    try:
        keeper.check(step, progress)
    finally:
        if feed is not None:
            feed.active = active


def lr_factor(progress: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first 5 % of the budget, then cosine decay to 10 % of the peak."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def widened(t: Tensor) -> Tensor:
    """``t`` in fp32 if autocast left it in bf16 / fp16 (the loss in full precision), else as it is (a float64
    model stays float64)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class FullPrecisionAttention(TorchFunctionMode):
    """Inside autocast, ``scaled_dot_product_attention`` in fp32: its CPU backward in bf16 took 26 ms a call against
    5.3 ms in fp32 (MiniLM's distillation batches of 32 rows; benchmarks/history/2026-12-06-issue-46-session9.md),
    and the softmax keeps its precision."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        device = args[0].device.type
        with torch.autocast(device, enabled=False):
            args = [widened(a) if isinstance(a, Tensor) else a for a in args]
            kwargs = {k: widened(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
            return func(*args, **kwargs)


def autocast_context(
    dtype: torch.dtype | None, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward passes' context for ``DistillConfig.autocast``: autocast to ``dtype`` with attention
    in fp32 (``FullPrecisionAttention``); a no-op for None."""
    if dtype is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def context():
        with torch.autocast(device.type, dtype=dtype), FullPrecisionAttention():
            yield

    return context


def model_device(model: nn.Module) -> torch.device:
    """Where collectives' tensors go: the model's (NCCL needs CUDA tensors, gloo takes CPU ones)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _check_blockwise(config: DistillConfig) -> None:
    if config.blockwise_fraction and not config.hidden_modules:
        raise ValueError(
            "blockwise_fraction > 0 feeds the teacher's inputs to the hidden_modules blocks, and the model has no "
            "repeated blocks to take by default; name them: DistillConfig(hidden_modules=(...)) (e.g. the encoder "
            "layers)"
        )


def _check_quant_aware(quant_aware: float, student: nn.Module) -> None:
    if quant_aware and not quantized_specs(student):
        raise ValueError(
            "quant_aware > 0 trains at the quantized weights, and the student has none; round it onto "
            "a grid first (comera_fx.quantize_ or comera_fx.apply_formats_), or leave DistillConfig(quant_aware=None)"
        )


def _progress_bar(progress: bool, steps: int | None, budget_seconds: float | None):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    desc = "distill" + (f" ({budget_seconds:.0f} s)" if budget_seconds else "")
    return tqdm(total=steps, desc=desc, unit="step")
