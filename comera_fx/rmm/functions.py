"""Linear products whose forward is exact and whose weight gradient is estimated from a sketch of the input.

``rmm_linear(x, W, b)`` is ``F.linear`` forward; backward gives dX = dY·W and db = Σ dY exactly and
dW ≈ (S·dY)ᵀ(S·X) with S the sketch drawn for this call (``sketch.py``): the only activation kept for backward is
S·X (ρ·B rows instead of B) and a seed. ``rmm_tt_product`` does the same for a TT matrix: dX exact through the
planned transposed product, the core gradients from the planned backward run on the sketched pair (S·X, S·dY).

Several linears reading one tensor (Q, K and V) share one sketch: ``shared_sketch`` remembers, per input tensor,
the last sketch and which modules used it, so memory falls for every ρ < 1 (three separate sketches would keep
more than exact autograd, which saves the shared input once, as soon as ρ > 1/3).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from ..tt import layers
from ..tt import plan as planner
from ..tt.plan.autograd import not_a_view
from .sketch import check_sketch, draw_seed, projected_rows, rho_ratio, sketch_rows


def _needs_token_dim(x: Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(
            f"{what}: the input has shape {tuple(x.shape)}, with no token dimension to sketch; "
            f"call it with a batch dimension (x[None]) or leave this layer exact "
            f"(comera_fx.restore_backward_, or filter_fn in randomize_backward_)"
        )


# -- sharing one sketch between the linears that read the same tensor ---------------------------------------------

# id(input) -> entry; an entry dies with its input (weakref callback), and is only reused while the input is
# unchanged (version counter) by modules that have not used it yet. A module meeting its own entry again is a new
# forward pass (or a layer applied twice): it draws a new sketch.
_SHARED: dict[tuple, "_Entry"] = {}


class _Entry:
    __slots__ = ("ref", "version", "sketch", "seed", "users")

    def __init__(self, ref, version, sketch, seed, user):
        self.ref, self.version, self.sketch, self.seed, self.users = ref, version, sketch, seed, {user}


def _forget(key):
    def callback(_ref):
        _SHARED.pop(key, None)

    return callback


def shared_sketch(x2d: Tensor, rows, kind: str, user: object | None = None) -> tuple[Tensor, Tensor]:
    """(S·x, seed) for the token-major matrix ``x2d``, reusing the sketch another module made of the same tensor in
    this forward pass. ``user`` identifies the caller (a module); None never shares. Under ``torch.compile`` every
    call sketches (the graph pass ``passes.share_sketches`` merges sketches of one tensor instead)."""
    if user is None or torch.compiler.is_compiling():
        seed = draw_seed(x2d)
        return sketch_rows(x2d.detach(), seed, rows, kind), seed
    base = x2d if x2d._base is None else x2d._base  # before detach(), which makes a new tensor
    x2d = x2d.detach()
    # The same view of the same storage: a slice of the same base tensor is another input.
    key = (id(base), x2d.storage_offset(), tuple(x2d.shape), tuple(x2d.stride()), int(rows), kind)
    entry = _SHARED.get(key)
    if entry is not None and entry.ref() is base and entry.version == base._version and user not in entry.users:
        entry.users.add(user)
        return entry.sketch, entry.seed
    seed = draw_seed(x2d)
    sketch = sketch_rows(x2d, seed, rows, kind)
    _SHARED[key] = _Entry(weakref.ref(base, _forget(key)), base._version, sketch, seed, user)
    return sketch, seed


# -- dense linear ---------------------------------------------------------------------------------------------------


class RandomizedLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b; saves W, S·x and the seed (not x)."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_sketch, seed, kind):
        ctx.kind = kind
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, x_sketch, seed)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        weight, x_sketch, seed = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        # Under autocast dY arrives in the autocast dtype while W and S·x keep theirs; autograd casts each gradient
        # back to its input's dtype.
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight.to(dy.dtype))
        if ctx.needs_input_grad[1]:
            dw = sketch_rows(dy2, seed, x_sketch.shape[0], ctx.kind).to(x_sketch.dtype).t().mm(x_sketch)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None


def rmm_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    rho: float | tuple[int, int] = 0.25,
    sketch: str = "gaussian",
    share_key: object | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)`` whose backward keeps a sketch of x (ρ of its tokens) instead of x.

    Without grad (``torch.no_grad``, a frozen weight) it is plain ``F.linear`` and draws nothing. ``share_key``:
    an object identifying the caller, to share one sketch between linears reading the same x (modules pass
    themselves); None sketches separately.
    """
    ratio = rho_ratio(rho)
    check_sketch(sketch)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    _needs_token_dim(x, "rmm_linear")
    x2d = x.reshape(-1, x.shape[-1])
    rows = projected_rows(x2d.shape[0], ratio)
    x_sketch, seed = shared_sketch(x2d, rows, sketch, share_key)
    return RandomizedLinearFunction.apply(x, weight, bias, x_sketch, seed, sketch)


# -- TT matrices ----------------------------------------------------------------------------------------------------


class RandomizedTTProduct(torch.autograd.Function):
    """x @ M of a TT matrix: forward by ``runners[0]`` (the plan for B tokens) keeping nothing but S·x, the seed and
    the cores; backward: dX by ``runners[1]`` (the transposed product's plan), the core gradients by the planned
    backward of ``runners[2]`` (the plan for B_proj tokens) on (S·x, S·dY)."""

    @staticmethod
    def forward(ctx, x, x_sketch, seed, runners, kind, *cores):
        ctx.runners, ctx.kind = runners, kind
        ctx.save_for_backward(x_sketch, seed, *cores)
        return not_a_view(runners[0].forward(x, cores, keep=False)[0])  # in-place writes allowed (plan.autograd)

    @staticmethod
    def backward(ctx, dy):
        x_sketch, seed, *cores = ctx.saved_tensors
        forward_run, dx_run, sketch_run = ctx.runners
        dx = None
        if ctx.needs_input_grad[0]:  # under autocast dY comes in the autocast dtype, the cores in theirs
            dx = dx_run.forward(dy, [c.to(dy.dtype) for c in cores], keep=False)[0]
        dy_sketch = sketch_rows(dy.reshape(-1, forward_run.n_out), seed, x_sketch.shape[0], ctx.kind)
        work = torch.promote_types(x_sketch.dtype, cores[0].dtype)
        x_sketch, dy_sketch = x_sketch.to(work), dy_sketch.to(work)
        cores = [c.to(work) for c in cores]
        _, lefts, rights = sketch_run.forward(x_sketch, cores)
        _, core_grads, _ = sketch_run.backward(lefts, rights, dy_sketch, need_x=False)
        return (dx, None, None, None, None, *core_grads)


def _envelope(layout, op: str, device):
    """The planner's training envelope for (layout, op) on ``device``: the one every TT product uses
    (``tt.layers``)."""
    if torch.compiler.is_compiling():
        envelope = layers.cached_envelope(layout, op, device=device)
        if envelope is None:
            raise RuntimeError(
                f"no contraction plan for {layout} ({op}) inside torch.compile: call "
                f"tt.prepare_plans() on every TT matrix before compiling (tensorize_ does)"
            )
        return envelope
    return layers.planned_envelope(layout, op, device=device)


def _inference_envelope(layout, op: str, device):
    """Forward-only envelope: under RMM the full-batch forward and dX products save nothing, so they run orders
    planned for inference. Inside torch.compile, the training envelope when none was made eagerly (another order of
    the same exact product, never another result)."""
    if torch.compiler.is_compiling():
        envelope = layers.cached_envelope(layout, op, device=device, backward=False)
        return envelope if envelope is not None else _envelope(layout, op, device)
    return layers.planned_envelope(layout, op, device=device, backward=False)


def prepare_rmm_plans(tt) -> None:
    """Plan what ``rmm_tt_product`` runs for ``tt``'s current ranks (both orientations) on the device its cores
    are on, before ``torch.compile``."""
    for op in ("matmul", "matmul_t"):
        _inference_envelope(tt.layout, op, tt.device)
        _envelope(tt.layout, op, tt.device)


def rmm_tt_product(
    x: Tensor,
    tt,
    *,
    transposed: bool = False,
    rho: float | tuple[int, int] = 0.25,
    sketch: str = "gaussian",
    share_key: object | None = None,
) -> Tensor:
    """x @ M (or x @ Mᵀ) of a ``TTMatrix`` with an exact forward and dX, and core gradients estimated from the
    sketched pair (S·x, S·dY) — the gate gradients follow through the gated cores. Plain planned product without
    grad. The planner's costs account for ρ: the forward and dX save nothing, so they run the orders planned for
    inference at B tokens; the core gradients run the training order planned for the B_proj sketched rows."""
    ratio = rho_ratio(rho)
    check_sketch(sketch)
    if tt.stored_empty or not torch.is_grad_enabled() or not any(p.requires_grad for p in tt.parameters()):
        return tt.matmul_t(x) if transposed else tt.matmul(x)
    _needs_token_dim(x, "rmm_tt_product")
    op, other = ("matmul_t", "matmul") if transposed else ("matmul", "matmul_t")
    layout = tt.layout
    n_in = layout.cols if transposed else layout.rows
    x2d = x.reshape(-1, n_in)
    tokens = x2d.shape[0]
    rows = projected_rows(tokens, ratio)
    runners = (
        planner.plan_runner(layers.choose_plan(_inference_envelope(layout, op, x.device), tokens)),
        planner.plan_runner(layers.choose_plan(_inference_envelope(layout, other, x.device), tokens)),
        planner.plan_runner(layers.choose_plan(_envelope(layout, op, x.device), rows)),
    )
    x_sketch, seed = shared_sketch(x2d, rows, sketch, share_key)
    return RandomizedTTProduct.apply(x, x_sketch, seed, runners, sketch, *tt.gated_cores())
