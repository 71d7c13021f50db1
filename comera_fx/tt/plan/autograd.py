"""The planned backward: ``PlanRunner`` (forward and backward as plain functions) and the custom
``torch.autograd.Function`` built from it (``plan_function``, ``execute_function``), each made once per plan
(``plan_runner``, ``plan_function``; ``prepare_plan`` makes all of them ahead of a traced region).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import ops
from ..layout import TTLayout
from .execution import _as_matrix, _check_operands, _kept, plan_program
from .plans import Plan


def _permuted_shape(view: tuple, dims: tuple[int, ...], batched: bool) -> tuple[int, ...]:
    """Shape of ``t.reshape(lead + dims).permute(perm)`` in ``_as_matrix`` (the batch as -1, always leading)."""
    perm = view[1]
    if batched:
        return (-1,) + tuple(dims[p - 1] for p in perm[1:])
    return tuple(dims[p] for p in perm)


def _unview(grad, view: tuple, dims: tuple[int, ...], rows: int, cols: int, batched: bool):
    """The gradient of a stored tensor from the gradient of its matrix view (the inverse of ``_as_matrix``),
    in the stored tensor's element order; a permute's inverse is not a view of that order (a copy follows)."""
    if view[0] == "view":
        return grad
    if view[0] == "t":
        return grad.t()
    inverse = tuple(sorted(range(len(view[1])), key=view[1].__getitem__))
    return grad.reshape(_permuted_shape(view, dims, batched)).permute(inverse)


# MKL (torch 2.13 CPU, 2 threads, AMD EPYC) runs the skinny GEMMs of a two-factor plan (x·L with N = r, t·R with
# K = r, and their gradients) far below their rate at kernel-friendly widths: at 4096 × 768 and r = 7 / 11 / 13 / 30
# the six b-dependent GEMMs took 8.4 / 10.5 / 7.6 / 12.1 ms against 5.6 ms at r = 16 and 9.7 ms at r = 32
# (benchmarks/investigations/bench_rank_widths.py; benchmarks/RESULTS.md, "Kernel-friendly rank padding"). Zero
# slices on the bond between the two factors change no number: x·[L 0] = [t 0] and [t 0]·[R; 0] = t·R, and the
# gradients of the true slices are the same.
#: Pad the bond between the two factors of a two-factor plan to ``kernel_rank`` (False: the A/B switch of
#: benchmarks/bench_tt_module.py).
PAD_RANKS = True

#: The device types where the padding was measured to pay (benchmarks/gpu_check.py measures it on CUDA).
PAD_DEVICES = frozenset({"cpu"})

#: Where the padded bond has a spare slice, carry the bias in it: t gets a column of ones and R the bias as a row,
#: so y = [t 1 0]·[R; bias; 0] adds the bias inside the GEMM without addmm's broadcast copy into y, and the gradient
#: of that row, d_bias = 1ᵀ·dY, comes out of the GEMM that computes dR = tᵀ·dY (one pass over dY, not two).
BIAS_IN_GEMM = True


def kernel_rank(rank: int, device_type: str) -> int:
    """The width the bond between a two-factor plan's factors runs at: ``rank`` rounded up to a multiple of 8, at
    least 16, on the ``PAD_DEVICES`` (CPU, measured there, see above); ``rank`` elsewhere or with ``PAD_RANKS`` off."""
    if not PAD_RANKS or device_type not in PAD_DEVICES:
        return rank
    return max(16, -(-rank // 8) * 8)


def _two_factor_steps(chosen: Plan) -> tuple[int, int] | None:
    """(i, j) when the plan's b-dependent work is t = x·L (step i) then y = t·R (step j, the last): the two batched
    steps of CoMERA's merged halves, the order the planner picks for large batches. t is b × r, read as is."""
    steps, instructions = chosen.steps, plan_program(chosen).instructions
    batched = [k for k, step in enumerate(steps) if step.batched]
    if len(batched) != 2:
        return None
    i, j = batched
    first, last = steps[i], steps[j]
    if (
        j != len(steps) - 1
        or first.left != 0
        or first.m != 1
        or last.m != 1
        or last.left != first.result
        or last.k != first.n
        or instructions[j].left_view != ("view",)
    ):
        return None
    return i, j


# MKL (torch 2.13 CPU, 2 threads) computes Aᵀ·dC for a tall A (m × k) and a narrow dC (m × n) 5–10× slower when
# n < 12 than as (dCᵀ·A)ᵀ: [1536×2048]·[2048×n] took 20–30 ms for n = 4..11, 3 ms for n = 12, and 2–4 ms the
# other way round. Pruned TT bonds land on such ranks, which made pruned layers slower than unpruned ones.
_NARROW_GRADIENT = 12


class PlanRunner:
    """The planned forward (optionally keeping each step's operands) and the planned backward of one plan, as
    plain functions of tensors — what ``plan_function`` runs, reusable by ops that feed the backward other inputs
    (``comera_fx.rmm`` runs the core gradients on a sketch of x and of dy).

    Per step, backward needs the left operand A (for dB = Aᵀ·dC; b-dependent exactly when the step is batched,
    which is what the cost model counts as saved) and the right operand B (for dA = dC·Bᵀ; never b-dependent: x
    is always on the left). Backward runs the steps in reverse, one GEMM per gradient, and undoes each operand's
    view (a transposed view back, a permute back: the copy the model counts).
    """

    def __init__(self, chosen: Plan):
        net, layout = chosen.network, chosen.network.layout
        self.plan = chosen
        program = plan_program(chosen)
        self.steps, self.instructions = chosen.steps, program.instructions
        self.n_in, self.n_out = (layout.rows, layout.cols) if net.op == "matmul" else (layout.cols, layout.rows)
        self.pad_in, self.pad_out = math.prod(net.in_modes), math.prod(net.out_modes)
        self.core_shapes = layout.core_shapes
        self.n_leaves = net.n_tensors
        self.final_perm, self.final_dims = program.final_perm, program.final_dims
        self.two_factor = _two_factor_steps(chosen)
        #: The true rank of the bond between the two factors (0 for a plan without two factors).
        self.bond_rank = self.steps[self.two_factor[0]].n if self.two_factor is not None else 0
        self.writes_y = _writes_y(chosen)

    def padded_rank(self, x) -> int:
        """The width the bond between the two factors runs at for input ``x``; 0 for a plan without two factors."""
        return kernel_rank(self.bond_rank, x.device.type) if self.two_factor is not None else 0

    @property
    def folds_bias(self) -> bool:
        """Does the last GEMM write y itself, so a bias can ride in addmm (``FOLD_BIAS`` on)? Read from
        ``writes_y``, found once per plan: Dynamo would otherwise trace the plan walk again for every layer."""
        return FOLD_BIAS and self.writes_y

    def bias_in_gemm(self, x, bias) -> bool:
        """Does ``forward`` carry ``bias`` in the padded bond's spare slice (``BIAS_IN_GEMM``)? Only where y is the
        last GEMM's output itself and the dtypes agree without autocast (which would cast the bias row)."""
        return (
            BIAS_IN_GEMM
            and bias is not None
            and self.writes_y
            and self.padded_rank(x) > self.bond_rank
            and bias.dtype == x.dtype
            and bias.device == x.device
            and not _autocasting(x)
        )

    def forward(self, x, cores: Sequence, keep: bool = True, bias=None):
        """(y, lefts, rights): y = x @ M (or x @ Mᵀ) + bias of shape (..., n_out); the operands when ``keep``.

        The bias goes into the last GEMM when that GEMM writes y itself: as a row of the padded R where the padded
        bond has room (``bias_in_gemm``), else through addmm (``folds_bias``), as nn.Linear's does — a separate add
        would read and write all of y once more. A two-factor plan runs its bond at ``padded_rank``; the kept
        operands are then the padded ones (``backward`` reads the padding from their shapes)."""
        x2 = x.reshape(-1, self.n_in)
        if self.pad_in != self.n_in:
            x2 = F.pad(x2, (0, self.pad_in - self.n_in))
        stored = [x2, *cores]
        lefts, rights = [], []
        ones = self.bias_in_gemm(x2, bias)
        # Fold only where addmm sees the dtypes mm would (autocast casts all three alike; else bias must match).
        foldable = not ones and bias is not None and self.folds_bias and (bias.dtype == x2.dtype or _autocasting(x2))
        fold = bias if foldable else None
        first, last = self.two_factor if self.two_factor is not None else (-1, -1)
        n_last = len(self.steps) - 1
        rank = self.bond_rank
        pad = self.padded_rank(x2) - rank
        for i, (step, inst) in enumerate(zip(self.steps, self.instructions)):
            right = _as_matrix(stored[step.right], inst.right_view, inst.right_dims, step.k, step.n, False)
            if pad and i == last:
                left = stored[step.left]  # t as stored: b × padded rank
                right = _pad_rows(right, pad, bias if ones else None)
            else:
                left = _as_matrix(stored[step.left], inst.left_view, inst.left_dims, step.m, step.k, step.batched)
                if pad and i == first:
                    right = F.pad(right, (0, pad))
            if keep:
                lefts.append(left)
                rights.append(right)
            result = torch.addmm(fold, left, right) if fold is not None and i == n_last else torch.mm(left, right)
            if ones and i == first:
                result[:, rank] = 1
            stored.append(result)
        out = stored[-1]
        if self.final_perm is not None:
            out = out.reshape((-1,) + self.final_dims).permute(self.final_perm)
        out = ops._trim_cols(out.reshape(-1, self.pad_out), self.n_out, self.pad_out)
        if bias is not None and fold is None and not ones:  # under autocast cast the bias as F.linear does
            out = out + (bias.to(out.dtype) if _autocasting(out) else bias)
        return out.reshape(x.shape[:-1] + (self.n_out,)), lefts, rights

    def backward(
        self,
        lefts: Sequence,
        rights: Sequence,
        dy,
        need_x: bool = True,
        bias_in_gemm: bool = False,
        gemm_dtype: torch.dtype | None = None,
    ):
        """(dx or None, [d core_k], d_bias or None) from the kept operands and the output gradient dy (..., n_out);
        d_bias only when the forward carried the bias in the padded bond (``bias_in_gemm``). ``gemm_dtype``: the
        forward's autocast dtype, in which the backward's GEMMs run too (as autocast runs a built-in op's backward in
        its forward's dtype); None: each GEMM in the wider of its operands' dtypes."""
        steps, instructions = self.steps, self.instructions
        n_steps = len(steps)
        grad = dy.reshape(-1, self.n_out)
        if self.pad_out != self.n_out:
            grad = F.pad(grad, (0, self.pad_out - self.n_out))
        if self.final_perm is not None:
            inverse = tuple(sorted(range(len(self.final_perm)), key=self.final_perm.__getitem__))
            shape = (-1,) + tuple(self.final_dims[p - 1] for p in self.final_perm[1:])
            grad = grad.reshape(shape).permute(inverse)
        grads: list = [None] * (self.n_leaves + n_steps)
        grads[steps[-1].result] = grad
        d_bias = None
        for i in range(n_steps - 1, -1, -1):
            step, inst = steps[i], instructions[i]
            width = rights[i].shape[1]  # step.n, or the padded rank of a two-factor plan's first factor
            d_out = grads[step.result].reshape(-1 if step.batched else step.m, width)
            grads[step.result] = None
            if step.left != 0 or need_x:
                d_left = _mm(d_out, rights[i].t(), gemm_dtype)
                grads[step.left] = _unview(d_left, inst.left_view, inst.left_dims, step.m, step.k, step.batched)
            if width < _NARROW_GRADIENT:  # Aᵀ·dC with few columns: as (dCᵀ·A)ᵀ, the same numbers
                d_right = _mm(d_out.t(), lefts[i], gemm_dtype).t()
            else:
                d_right = _mm(lefts[i].t(), d_out, gemm_dtype)
            if bias_in_gemm and i == n_steps - 1:
                d_bias = d_right[step.k]
            if tuple(d_right.shape) != (step.k, step.n):  # drop the padded slices' gradients
                d_right = d_right[: step.k, : step.n]
            grads[step.right] = _unview(d_right, inst.right_view, inst.right_dims, step.k, step.n, False)
        dx = None
        if need_x:
            dx = grads[0].reshape(-1, self.pad_in)
            if self.pad_in != self.n_in:
                dx = dx[:, : self.n_in]
            dx = dx.reshape(dy.shape[:-1] + (self.n_in,))
        return dx, [grads[k + 1].reshape(self.core_shapes[k]) for k in range(self.n_leaves - 1)], d_bias


def _pad_rows(right, pad: int, bias=None):
    """R (r × n) with ``pad`` rows below: zeros, the first of them ``bias`` when given (``bias_in_gemm``)."""
    if bias is None:
        return F.pad(right, (0, 0, 0, pad))
    rows = [right, bias.reshape(1, -1)]
    if pad > 1:
        rows.append(right.new_zeros(pad - 1, right.shape[1]))
    return torch.cat(rows)


#: Fold a bias into the last GEMM where the plan allows it (``folds_bias``); False adds it separately (the A/B switch
#: of benchmarks/bench_tt_module.py).
FOLD_BIAS = True


def folds_bias(chosen: Plan) -> bool:
    """Does the plan's last GEMM write y itself, so a bias can ride in addmm (``FOLD_BIAS`` on)?"""
    return plan_runner(chosen).folds_bias


def _writes_y(chosen: Plan) -> bool:
    """Does the plan's last GEMM write y itself, (b × n_out) with nothing after it (no permute, no trimming)?"""
    last, net = chosen.steps[-1], chosen.network
    return (
        last.batched
        and last.m == 1
        and plan_program(chosen).final_perm is None
        and math.prod(net.out_modes) == (net.layout.cols if net.op == "matmul" else net.layout.rows)
    )


def _autocasting(t) -> bool:
    return torch.is_autocast_enabled(t.device.type)


def _autocast_dtype(t) -> torch.dtype | None:
    """The autocast dtype on t's device, None where autocast is off or has no such device (meta: asking raises)."""
    if t.device.type == "meta" or not _autocasting(t):
        return None
    return torch.get_autocast_dtype(t.device.type)


def _mm(a, b, dtype: torch.dtype | None = None):
    """torch.mm in ``dtype`` (the forward's autocast dtype: its GEMMs ran in bf16 on fp32 cores, so backward meets
    a bf16 gradient and fp32 operands; autograd casts each gradient back to its input's dtype), else in the wider of
    the two dtypes."""
    if dtype is not None:
        return torch.mm(a.to(dtype), b.to(dtype))
    if a.dtype != b.dtype:
        dtype = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dtype), b.to(dtype)
    return torch.mm(a, b)


def plan_runner(chosen: Plan) -> PlanRunner:
    """The planned forward and backward of ``chosen`` as plain functions, made once per plan."""
    return _kept(chosen, "_runner", PlanRunner)


def plan_function(chosen: Plan) -> type:
    """A ``torch.autograd.Function`` that runs ``chosen`` with its planned backward (``execute_function``), made
    once per plan."""
    return _kept(chosen, "_function", _make_function)


def prepare_plan(chosen: Plan) -> None:
    """Make everything running ``chosen`` needs (program, runner, Function) now, outside any traced region: a
    compiled graph reads them, it must not build them."""
    plan_function(chosen)  # with it, the runner and the program


def _make_function(chosen: Plan) -> type:
    """A torch.autograd.Function running ``chosen`` forward and its planned backward (``PlanRunner``).

    Forward saves, per step, the two operands its backward needs and nothing else: intermediates that are only
    step results are not saved.
    """
    runner = plan_runner(chosen)
    n_steps = len(chosen.steps)

    class PlannedProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, bias, *cores):
            out, lefts, rights = runner.forward(x, cores, bias=bias)
            ctx.save_for_backward(*lefts, *rights)
            ctx.bias_in_gemm = runner.bias_in_gemm(x, bias)
            ctx.gemm_dtype = _autocast_dtype(x)
            return not_a_view(out)

        @staticmethod
        def backward(ctx, dy):
            saved = ctx.saved_tensors
            dx, core_grads, d_bias = runner.backward(
                saved[:n_steps], saved[n_steps:], dy, ctx.needs_input_grad[0], ctx.bias_in_gemm, ctx.gemm_dtype
            )
            if ctx.needs_input_grad[1] and d_bias is None:
                d_bias = dy.reshape(-1, dy.shape[-1]).sum(0)
            return (dx, d_bias, *core_grads)

    PlannedProduct.__name__ = PlannedProduct.__qualname__ = "PlannedProduct"
    return PlannedProduct


def not_a_view(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a custom Function's output that the caller may modify in place, without a copy.

    A planned product's y is a reshape (a view) of its last GEMM's result. Returned as is from
    ``Function.forward``, autograd forbids any in-place write to it ("Output 0 of PlannedProduct is a view and is
    being modified inplace"), so a model doing ``out = mlp(x); out.add_(...)`` (Llama 4's MoE block) failed under
    grad. ``detach()`` gives the same memory as a tensor autograd does not count as a view; the GEMM result it
    shares memory with is saved by no one, so no saved tensor can be overwritten."""
    return out.detach()


def execute_function(chosen: Plan, x, cores: Sequence, layout: TTLayout, bias=None):
    """``execute`` through a custom ``torch.autograd.Function`` (``plan_function``): the same forward, and a backward
    that runs the planned gradient GEMMs and keeps only the operands the cost model counts. ``bias`` (n_out,) is
    added inside the last GEMM where the plan allows (``folds_bias``). Real tensors only (use ``execute`` on
    ``torch.fx`` proxies); traces under ``torch.compile`` (Dynamo) without graph breaks."""
    _check_operands(chosen, cores, layout)
    if not torch.is_grad_enabled():
        # Nothing to save: the forward alone. (Also sidesteps Dynamo, which under no_grad inlines two such Functions
        # of different layouts in one graph wrongly: their forwards share one code object, only the closures differ.)
        return plan_runner(chosen).forward(x, cores, keep=False, bias=bias)[0]
    return plan_function(chosen).apply(x, bias, *cores)
