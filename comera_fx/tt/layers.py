"""Modules that own TT cores and rank gates as trainable parameters.

``TTMatrix`` holds one TT-parameterised matrix M (cores + gates) and knows how to multiply and index it without
building it. ``TTLinear`` and ``TTEmbedding`` are drop-in replacements for ``nn.Linear`` / ``nn.Embedding`` that
use a ``TTMatrix``; a tied embedding and output head share one ``TTMatrix`` instance.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import decompose, kernels, merged, ops
from .dense_view import check_same_size, dense_view, source_of
from . import plan as planner
from .layout import TTFormat, TTLayout, chain_dims
from .plan.cost import device_launch
from .plan_cache import cached_envelope, choose_plan, planned_envelope
from .shapes import auto_num_modes, capped_ranks, choose_modes, feasible_ranks, order_for_chain


class TTMatrix(nn.Module):
    """A matrix M (rows × cols) stored as TT or TTM cores with one gate vector per internal bond.

    Ranks are read from the cores, so shrinking a bond is just replacing three parameters. Loading a state dict
    whose cores have other ranks (a pruned checkpoint) adopts the checkpoint's shapes.

    Held wider (``runtime.shrink.round_to_ranks_(..., in_place=True)``): the stored cores may keep zero slices
    beyond each bond's live rank, with zero gates, so that a prune changes no stored shape (a compiled graph keeps
    running, ``RankAdaptive``'s ``shrink_slack``). ``layout`` is then the stored one, what every product runs;
    ``ranks``, ``live_layout`` and ``is_zero`` are the live ones, what sizes and reports count.
    """

    def __init__(self, layout: TTLayout, cores: Sequence[Tensor], gates: Sequence[Tensor] | None = None):
        super().__init__()
        expected = layout.core_shapes
        if [tuple(c.shape) for c in cores] != expected:
            raise ValueError(f"core shapes {[tuple(c.shape) for c in cores]} do not match layout {expected}")
        self.format = layout.format
        self.rows, self.cols = layout.rows, layout.cols
        self.row_modes, self.col_modes = layout.row_modes, layout.col_modes
        self.cores = nn.ParameterList([nn.Parameter(c.detach().clone()) for c in cores])
        if gates is None:
            gates = [torch.ones(r, dtype=cores[0].dtype, device=cores[0].device) for r in layout.internal_ranks]
        self.gates = nn.ParameterList([nn.Parameter(g.detach().clone()) for g in gates])
        #: The live internal ranks when the stored cores are wider (zero slices past them), else None.
        self.live_internal_ranks: tuple[int, ...] | None = None
        #: The planner's envelope per product ("matmul", "matmul_t") that this matrix last ran or prepared: what
        #: compiled code reads. Dynamo then guards on this matrix's own entry, so matrices of one layout share a
        #: compiled graph and planning another layout recompiles nothing (reading the global cache, Dynamo guards on
        #: its keys: any insertion recompiled every region). A deep copy shares them (same layout, immutable plans);
        #: a pickle drops them and the unpickled module plans its own (``__setstate__``).
        self._plan_pins: dict[str, planner.PlanEnvelope] = {}

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def from_matrix(
        cls,
        matrix: Tensor,
        *,
        format: TTFormat,
        row_modes: Sequence[int],
        col_modes: Sequence[int],
        max_rank: int | None = None,
        rank_ratio: float | None = None,
        rel_tol: float | None = None,
    ) -> "TTMatrix":
        """TT-SVD (or TTM-SVD) of a dense matrix, truncated by max_rank / rank_ratio / rel_tol."""
        row_modes, col_modes = tuple(row_modes), tuple(col_modes)
        dims = chain_dims(format, row_modes, col_modes)
        caps = capped_ranks(dims, max_rank, rank_ratio)
        split = decompose.matrix_to_tt if format is TTFormat.TT else decompose.matrix_to_ttm
        cores = split(matrix, row_modes, col_modes, caps, rel_tol)
        ranks = (1,) + tuple(c.shape[-1] for c in cores)
        layout = TTLayout(format, matrix.shape[0], matrix.shape[1], row_modes, col_modes, ranks)
        return cls(layout, cores)

    @classmethod
    def random(
        cls,
        rows: int,
        cols: int,
        *,
        format: TTFormat,
        row_modes: Sequence[int],
        col_modes: Sequence[int],
        max_rank: int | None = None,
        rank_ratio: float | None = None,
        std: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> "TTMatrix":
        """Random cores whose reconstructed entries have standard deviation ``std`` (the dense init's)."""
        row_modes, col_modes = tuple(row_modes), tuple(col_modes)
        ranks = capped_ranks(chain_dims(format, row_modes, col_modes), max_rank, rank_ratio)
        layout = TTLayout(format, rows, cols, row_modes, col_modes, ranks)
        cores = decompose.random_tt_cores(layout.core_shapes, std, dtype=dtype, device=device, generator=generator)
        return cls(layout, cores)

    # -- metadata ------------------------------------------------------------------------------------------------

    @property
    def layout(self) -> TTLayout:
        """The stored cores' layout: what every product and plan runs (wider than ``live_layout`` while the matrix
        is held wider)."""
        cores = self._stored_cores()
        if torch.compiler.is_compiling():
            _specialize_ranks(cores)
        ranks = (1,) + tuple(core.shape[-1] for core in cores)
        return TTLayout(self.format, self.rows, self.cols, self.row_modes, self.col_modes, ranks)

    @property
    def device(self) -> torch.device:
        """Where the stored cores live: the device whose launch cost the products' plans are chosen with."""
        return self._stored_cores()[0].device

    def _stored_cores(self) -> list[Tensor]:
        """The core tensors themselves, for their shapes: read past ``nn.Module.__getattr__``, which
        ``torch.fx.symbolic_trace`` patches to hand out proxies (a proxy's shape cannot drive Python control flow)."""
        return list(self.cores._parameters.values())

    def _stored_gates(self) -> list[Tensor]:
        """The gate tensors, read as ``_stored_cores`` reads the cores: iterating a ``ParameterList`` costs a
        string-index lookup per entry, which the rank hook would pay for every gate at every step."""
        return list(self.gates._parameters.values())

    @property
    def live_layout(self) -> TTLayout:
        """The layout at the live ranks: the matrix's true size (``layout`` while it is not held wider)."""
        layout = self.layout
        live = self.live_internal_ranks
        return layout if live is None else layout.with_ranks((1, *live, 1))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The live ranks (the stored cores may be wider: ``layout.ranks``)."""
        return self.live_layout.ranks

    @property
    def is_zero(self) -> bool:
        """True when a bond has live rank 0 (rank adaptation removed all its slices): M is exactly zero."""
        live = self.live_internal_ranks
        return self.stored_empty or (live is not None and 0 in live)

    @property
    def stored_empty(self) -> bool:
        """True when a stored core is empty: the contraction code, which needs ranks >= 1, is bypassed. What the
        products test (not ``is_zero``), so that a graph reads only shapes, never the live ranks."""
        return any(core.numel() == 0 for core in self._stored_cores())

    def live_cores(self) -> list[Tensor]:
        """The cores cut to the live ranks (views; the cores themselves while not held wider)."""
        live = self.live_internal_ranks
        if live is None:
            return list(self.cores)
        ranks = (1, *live, 1)
        return [core[: ranks[k], ..., : ranks[k + 1]] for k, core in enumerate(self.cores)]

    def live_gates(self) -> list[Tensor]:
        """The gates cut to the live ranks (views)."""
        live = self.live_internal_ranks
        return list(self.gates) if live is None else [g[:r] for g, r in zip(self.gates, live)]

    @property
    def full_ranks(self) -> tuple[int, ...]:
        return feasible_ranks(chain_dims(self.format, self.row_modes, self.col_modes))

    def extra_repr(self) -> str:
        layout = self.live_layout
        stored = "" if self.live_internal_ranks is None else f", stored ranks={self.layout.ranks}"
        params = 0 if self.is_zero else layout.num_params
        return (
            f"format={layout.format.value}, modes={layout.describe_modes()}, ranks={layout.ranks}{stored}, "
            f"params={params}, compression={f'{layout.compression:.1f}x' if params else 'zero matrix'}"
        )

    # -- math ----------------------------------------------------------------------------------------------------

    def gated_cores(self, layout: TTLayout | None = None) -> list[Tensor]:
        """The cores with each internal gate folded into the core on its left. Under Dynamo the parameters are
        read from the lists' dicts (``_stored_cores``): iterating a ``ParameterList`` traces a string-index lookup
        per entry, a third of a TT product's trace time."""
        if torch.compiler.is_compiling():
            cores, gates = self._stored_cores(), self._stored_gates()
        else:
            cores, gates = list(self.cores), list(self.gates)
        return ops.gate_cores(cores, gates, layout if layout is not None else self.layout)

    def dense(self) -> Tensor:
        """M itself (rows × cols). Builds the full matrix: for checks, not for the hot path."""
        if self.stored_empty:
            return self.cores[0].new_zeros(self.rows, self.cols)
        return ops.to_dense(self.gated_cores(), self.layout)

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ M (+ bias) in the order the planner chose for this batch size (see ``comera_fx.plan``); the bias
        rides in the last GEMM where the order allows, as in nn.Linear's addmm. Eager no-grad products of few
        tokens (decoding) run from cached merged forms instead (``tt.merged``)."""
        if merged.may_serve(x, self.rows) and (found := merged.cached_form(self, "matmul")):
            return merged.product(x, *found, "matmul", bias)
        if self.stored_empty:
            return _with_bias(_zero_product(x, self.cols), bias)
        return self._planned_product(x, "matmul", bias)

    def matmul_t(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ Mᵀ (+ bias) (a tied output head), planned like ``matmul``."""
        if merged.may_serve(x, self.cols) and (found := merged.cached_form(self, "matmul_t")):
            return merged.product(x, *found, "matmul_t", bias)
        if self.stored_empty:
            return _with_bias(_zero_product(x, self.rows), bias)
        return self._planned_product(x, "matmul_t", bias)

    def prepare_plans(self, ops: Sequence[str] = planner.OPS) -> None:
        """Plan the products (both by default) for the current ranks now. Call before ``torch.compile`` if the
        module has not run eagerly since its ranks last changed: a compiled graph reads plans, it does not make
        them."""
        layout, device = self.layout, self.device
        for op in ops:
            self._plan_pins[op] = planned_envelope(layout, op, device=device)

    def _envelope(self, layout: TTLayout, op: str, device: torch.device) -> "planner.PlanEnvelope | None":
        """Eagerly: the planner's envelope for ``device`` (made if needed) and pinned. Compiling: the pinned one if
        it is for ``layout`` and ``device``'s launch cost, else the global cache's (None when nothing was planned:
        the caller's fixed order)."""
        if not torch.compiler.is_compiling():
            envelope = self._plan_pins[op] = planned_envelope(layout, op, device=device)
            return envelope
        pinned = self._plan_pins.get(op)
        if pinned is not None and pinned.network.layout == layout and pinned.model.launch == device_launch(device):
            return pinned
        return cached_envelope(layout, op, device=device)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.cpu``, ...), then the pinned products planned again for
        the device the cores are on now: a plan is chosen with its device's launch cost, and a model moved and
        then compiled before any eager call must trace the new device's plans, not the old one's."""
        moved = super()._apply(fn, recurse)
        if getattr(self, "_plan_pins", None) and not self.stored_empty:
            self.prepare_plans(list(self._plan_pins))
        return moved

    def __deepcopy__(self, memo):
        """The default deep copy, with the plan pins carried in its state and shared, not copied (the envelopes are
        immutable): a copied model compiled before it ever ran eagerly would otherwise trace reads of the global
        plan cache, which Dynamo guards by its keys. A copy of an unplanned module plans in ``__setstate__``."""
        for envelope in self._plan_pins.values():
            memo[id(envelope)] = envelope
        constructor, args, state, *rest = self.__reduce_ex__(4)
        state["_plan_pins"] = self._plan_pins  # __getstate__ drops them for pickling; deepcopy gives a new dict
        return copy._reconstruct(self, memo, constructor, args, state, *rest)

    def __getstate__(self):
        state = super().__getstate__()
        state["_plan_pins"] = {}  # envelopes are shared planner objects: a loaded module plans its own
        state.pop("_merged", None)  # merged.py's cache of the cores' products: never copied or saved
        state.pop(merged.FROZEN, None)  # a copy made inside serving.frozen is not frozen
        return state

    def __setstate__(self, state):
        """A loaded module plans its products at once (cheap: planned once per layout and process), so that a
        checkpoint compiled before any eager call traces its own pins, never the global plan cache."""
        super().__setstate__(state)
        self.__dict__.setdefault("_plan_pins", {})  # modules pickled before the pins existed
        if not self._plan_pins and not self.stored_empty:
            self.prepare_plans()

    def _planned_product(self, x: Tensor, op: str, bias: Tensor | None = None) -> Tensor:
        layout = self.layout
        cores = self.gated_cores(layout)
        if kernels.chain_applies(x, cores, layout):  # opt-in (kernels.FUSED_CHAIN): x·L·R in one Triton kernel
            return kernels.tt_chain_product(x, cores, layout, op, bias)
        envelope = self._envelope(layout, op, cores[0].device)
        if envelope is None:  # compiled before any plan was made: CoMERA's fixed order
            fixed = ops.matmul if op == "matmul" else ops.matmul_t
            return _with_bias(fixed(x, cores, layout), bias)
        batch = x.numel() // (layout.rows if op == "matmul" else layout.cols)
        chosen = choose_plan(envelope, batch)
        if CUSTOM_AUTOGRAD:
            return planner.execute_function(chosen, x, cores, layout, bias)
        return planner.execute(chosen, x, cores, layout, bias)

    def take_rows(self, index: Tensor) -> Tensor:
        if self.stored_empty:
            return self.cores[0].new_zeros(tuple(index.shape) + (self.cols,))
        if merged.may_serve(index, 1) and (found := merged.cached_form(self, "rows")):
            return merged.rows(index, *found)
        # The kernels run on CUDA when triton is there (the gates folded into the merges, never as a separate
        # pass); everywhere else this is ops.take_rows.
        return kernels.take_rows(index, list(self.cores), self.layout, list(self.gates))

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A pruned checkpoint has smaller ranks: adopt its shapes before the children copy the values in. Only the
        # rank axes may differ; other modes, another format or a broken rank chain would load "successfully" and
        # compute another matrix, so they are refused (load_state_dict raises with every message).
        problem = self._checkpoint_problem(state_dict, prefix)
        if problem is not None:
            error_msgs.append(problem)
        else:
            for group_name, group in (("cores", self.cores), ("gates", self.gates)):
                for k, param in enumerate(group):
                    saved = state_dict.get(f"{prefix}{group_name}.{k}")
                    if saved is not None and saved.shape != param.shape:
                        self.live_internal_ranks = None  # the checkpoint's shapes are its ranks
                        group[k] = nn.Parameter(
                            torch.empty(saved.shape, dtype=param.dtype, device=param.device),
                            requires_grad=param.requires_grad,
                        )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _checkpoint_problem(self, state_dict, prefix: str) -> str | None:
        """Why the cores/gates in ``state_dict`` (under ``prefix``) are not this matrix with other ranks, or None."""
        cores = [state_dict.get(f"{prefix}cores.{k}") for k in range(len(self.cores))]
        gates = [state_dict.get(f"{prefix}gates.{k}") for k in range(len(self.gates))]
        if any(c is None for c in cores) or any(g is None for g in gates):
            return None  # missing keys: load_state_dict reports them (or strict=False skips them)
        mine = [tuple(c.shape) for c in self.cores]
        saved = [tuple(c.shape) for c in cores]
        name = prefix[:-1] if prefix else "<root>"
        layer = f"TT matrix {name!r} ({self.format.value}, modes {self.layout.describe_modes()})"
        if any(len(s) != len(m) or s[1:-1] != m[1:-1] for s, m in zip(saved, mine)):
            return (
                f"{layer}: the checkpoint's cores {saved} differ from the model's {mine} in more than the rank "
                f"axes (other modes or another format); tensorize the model with the checkpoint's modes and "
                f"format before loading"
            )
        ranks = [s[0] for s in saved] + [saved[-1][-1]]
        chained = all(a[-1] == b[0] for a, b in zip(saved, saved[1:])) and ranks[0] == ranks[-1] == 1
        gate_sizes = [tuple(g.shape) for g in gates]
        if not chained or gate_sizes != [(r,) for r in ranks[1:-1]]:
            return (
                f"{layer}: the checkpoint's cores {saved} and gates {gate_sizes} do not form a TT chain "
                f"(neighbouring cores and gates must agree on each rank, the end ranks must be 1); the model's "
                f"cores are {mine}"
            )
        return None


def _specialize_ranks(cores: Sequence[Tensor]) -> None:
    """Make Dynamo treat the cores' sizes as constants (guarded on) should it trace them as symbols.

    A user may trace parameters with dynamic shapes (``torch._dynamo.config.force_parameter_static_shapes =
    False``, or ``torch.compiler.config.dynamic_sources``); Dynamo then makes the cores' sizes symbols after a rank
    change. Plans are made for concrete ranks (the contraction order and every view depend on them), so the TT
    products specialize the ranks instead: a rank change recompiles, as with static shapes, where it would
    otherwise crash inside Dynamo. Rank changes avoid recompiles by keeping the stored shapes: ``RankAdaptive`` rounds
    in place under a compile (``BudgetConfig``'s defaults; ``shrink_slack`` overrides)."""
    for core in cores:
        torch._dynamo.mark_static(core)


def _with_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    if bias is None:
        return y
    return y + (bias.to(y.dtype) if torch.is_autocast_enabled(y.device.type) else bias)  # as F.linear casts it


def _zero_product(x: Tensor, n_out: int) -> Tensor:
    """x @ 0 with the shape and dtype of the real product, still connected to x (which gets a zero gradient)."""
    return x[..., :0] @ x.new_zeros(0, n_out)


#: Run TT products through the planner's custom autograd.Function (``plan.execute_function``: backward runs the
#: planned GEMMs and saves only the operands the cost model counts) instead of autograd on ``plan.execute``.
CUSTOM_AUTOGRAD = True


def prepare_plans_under(root: nn.Module) -> None:
    """Plan every TT matrix under ``root`` that stores cores: compiled code reads plans, it does not make them."""
    for module in root.modules():
        if isinstance(module, TTMatrix) and not module.stored_empty:
            module.prepare_plans()


class TTLinear(nn.Module):
    """y = x W^T + b with W stored as a TTMatrix; the dense bias is kept as is.

    Normally M = W^T (rows = in_features, cols = out_features: input modes then output modes, CoMERA's layout).
    A tied output head reuses an embedding's M = E, where W = M; then ``transposed=True``.
    """

    def __init__(self, tt: TTMatrix, bias: Tensor | None = None, *, transposed: bool = False):
        super().__init__()
        self.tt = tt
        self.transposed = transposed
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @property
    def in_features(self) -> int:
        return self.tt.cols if self.transposed else self.tt.rows

    @property
    def out_features(self) -> int:
        return self.tt.rows if self.transposed else self.tt.cols

    @property
    def weight(self) -> Tensor:
        """The dense (out × in) weight, rebuilt on each access — for code that insists on reading it. In eager code
        a ``TTDenseView``: in-place changes raise (they would be lost), see ``tt/dense_view.py``."""
        dense = self.tt.dense()
        return dense_view(dense if self.transposed else dense.t(), self.tt, transposed=not self.transposed)

    def __setattr__(self, name: str, value) -> None:
        # ``head.weight = embedding.weight`` (transformers' tie_weights) shares the other module's TTMatrix.
        if name == "weight":
            tt, transposed = source_of(value, "TTLinear.weight")
            if tuple(value.shape) != (self.out_features, self.in_features):
                raise ValueError(
                    f"cannot assign a {tuple(value.shape)} weight to TTLinear.weight of shape "
                    f"{(self.out_features, self.in_features)}"
                )
            super().__setattr__("tt", tt)
            super().__setattr__("transposed", not transposed)  # W = M when the value is M
        elif name in ("in_features", "out_features"):
            check_same_size("TTLinear", name, getattr(self, name), value)
        else:
            super().__setattr__(name, value)

    @classmethod
    def from_dense(cls, linear: nn.Linear, **options) -> "TTLinear":
        """Convert an ``nn.Linear``; ``options`` are those of ``make_tt_matrix`` (max_rank, init, format, ...)."""
        options.setdefault("format", TTFormat.TT)
        tt = make_tt_matrix(linear.weight.detach().t(), kind="linear", **options)
        return cls(tt, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.tt.matmul_t(x, self.bias) if self.transposed else self.tt.matmul(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TTEmbedding(nn.Module):
    """An embedding table E (num_embeddings × embedding_dim) stored as a TTMatrix; lookups never build E.

    Matches ``nn.Embedding`` for any index shape, including ``padding_idx``: that row is returned from a constant
    buffer and receives no gradient, as in ``nn.Embedding``. ``max_norm`` (which rewrites rows in place),
    ``scale_grad_by_freq`` and ``sparse`` have no TT equivalent and are refused.
    """

    def __init__(self, tt: TTMatrix, padding_idx: int | None = None, padding_row: Tensor | None = None):
        super().__init__()
        self.tt = tt
        if padding_idx is not None and padding_idx < 0:
            padding_idx += tt.rows
        self.padding_idx = padding_idx
        if padding_idx is not None:
            row = padding_row if padding_row is not None else torch.zeros(tt.cols)
            self.register_buffer("padding_row", row.detach().clone().to(tt.cores[0].device, tt.cores[0].dtype))
        else:
            self.padding_row = None

    @property
    def num_embeddings(self) -> int:
        return self.tt.rows

    @property
    def embedding_dim(self) -> int:
        return self.tt.cols

    @property
    def weight(self) -> Tensor:
        """The dense table, rebuilt on each access — for code that insists on reading it."""
        dense = self.tt.dense()
        if self.padding_idx is not None:
            dense = dense.index_copy(
                0, torch.tensor([self.padding_idx], device=dense.device), self.padding_row.to(dense.dtype)[None]
            )
        return dense_view(dense, self.tt, transposed=False)

    def __setattr__(self, name: str, value) -> None:
        # ``embedding.weight = other.weight`` shares the other module's TTMatrix (see TTLinear.__setattr__).
        if name == "weight":
            tt, transposed = source_of(value, "TTEmbedding.weight")
            if transposed:
                raise TypeError(
                    "cannot assign a TTLinear's weight (Mᵀ of its TT matrix) to TTEmbedding.weight: "
                    "TT lookups gather rows of M; tie the other way round (linear.weight = "
                    "embedding.weight)"
                )
            if tuple(value.shape) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(
                    f"cannot assign a {tuple(value.shape)} weight to TTEmbedding.weight of shape "
                    f"{(self.num_embeddings, self.embedding_dim)}"
                )
            super().__setattr__("tt", tt)
        elif name in ("num_embeddings", "embedding_dim"):
            check_same_size("TTEmbedding", name, getattr(self, name), value)
        else:
            super().__setattr__(name, value)

    @staticmethod
    def check_supported(embedding: nn.Embedding) -> str | None:
        """Why an nn.Embedding cannot become a TTEmbedding, or None."""
        if embedding.max_norm is not None:
            return "max_norm renormalises rows in place, which a TT table cannot do; set max_norm=None"
        if embedding.scale_grad_by_freq:
            return "scale_grad_by_freq is not supported; set scale_grad_by_freq=False"
        if embedding.sparse:
            return "sparse gradients are not supported; set sparse=False"
        return None

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, **options) -> "TTEmbedding":
        """Convert an ``nn.Embedding``; ``options`` are those of ``make_tt_matrix`` (TTM format by default)."""
        reason = cls.check_supported(embedding)
        if reason is not None:
            raise ValueError(f"cannot tensorize {embedding}: {reason}")
        options.setdefault("format", TTFormat.TTM)
        tt = make_tt_matrix(embedding.weight.detach(), kind="embedding", **options)
        pad = embedding.padding_idx
        return cls(tt, pad, embedding.weight.detach()[pad] if pad is not None else None)

    def forward(self, index: Tensor) -> Tensor:
        if not torch.compiler.is_compiling() and index.numel() > 0:
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(
                    f"index out of range in TTEmbedding: indices span [{low}, {high}], "
                    f"table has {self.num_embeddings} rows"
                )
        out = self.tt.take_rows(index)
        if self.padding_idx is not None:
            out = torch.where((index == self.padding_idx)[..., None], self.padding_row.to(out.dtype), out)
        return out

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def default_init_std(kind: str, fan_in: int) -> float:
    """Std of PyTorch's default init: nn.Linear's kaiming_uniform(a=√5) is U(±1/√fan_in); nn.Embedding is N(0, 1)."""
    if kind == "embedding":
        return 1.0
    return 1.0 / math.sqrt(3.0 * fan_in)


def choose_layout_modes(
    rows: int, cols: int, format: TTFormat, num_modes: int | None = None, max_pad_fraction: float = 0.25
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row and column modes for a (rows × cols) matrix.

    TT: each side gets its own number of modes (``num_modes`` or about one per factor of 10), largest modes at the
    chain's ends. TTM: both sides need the same number of modes, chosen from the geometric mean of the two sizes.
    """
    if format is TTFormat.TT:
        d_rows = num_modes or auto_num_modes(rows)
        d_cols = num_modes or auto_num_modes(cols)
        row_modes = order_for_chain(choose_modes(rows, d_rows, max_pad_fraction=max_pad_fraction), largest_first=True)
        col_modes = order_for_chain(choose_modes(cols, d_cols, max_pad_fraction=max_pad_fraction), largest_first=False)
        return row_modes, col_modes
    d = num_modes or auto_num_modes(math.isqrt(rows * cols))
    return (
        choose_modes(rows, d, max_pad_fraction=max_pad_fraction),
        choose_modes(cols, d, max_pad_fraction=max_pad_fraction),
    )


def make_tt_matrix(
    matrix: Tensor,
    *,
    kind: str,
    format: TTFormat = TTFormat.TT,
    init: str = "svd",
    max_rank: int | None = None,
    rank_ratio: float | None = None,
    rel_tol: float | None = None,
    num_modes: int | None = None,
    row_modes: Sequence[int] | None = None,
    col_modes: Sequence[int] | None = None,
    max_pad_fraction: float = 0.25,
    generator: torch.Generator | None = None,
) -> TTMatrix:
    """A TTMatrix for ``matrix`` (M, rows × cols): TT-SVD of it (``init="svd"``) or random cores of the same
    shape whose entries have the variance of PyTorch's default init for ``kind`` ("linear" or "embedding")."""
    if not matrix.is_floating_point():
        raise TypeError(f"only floating-point weights can be tensorized, got dtype {matrix.dtype}")
    format = TTFormat(format)
    rows, cols = matrix.shape
    if row_modes is None or col_modes is None:  # explicit modes must not depend on an automatic choice existing
        auto_rows, auto_cols = choose_layout_modes(rows, cols, format, num_modes, max_pad_fraction)
    row_modes = tuple(row_modes) if row_modes is not None else auto_rows
    col_modes = tuple(col_modes) if col_modes is not None else auto_cols
    if init == "svd":
        return TTMatrix.from_matrix(
            matrix,
            format=format,
            row_modes=row_modes,
            col_modes=col_modes,
            max_rank=max_rank,
            rank_ratio=rank_ratio,
            rel_tol=rel_tol,
        )
    if init == "random":
        fan_in = cols if kind == "embedding" else rows
        return TTMatrix.random(
            rows,
            cols,
            format=format,
            row_modes=row_modes,
            col_modes=col_modes,
            max_rank=max_rank,
            rank_ratio=rank_ratio,
            std=default_init_std(kind, fan_in),
            dtype=matrix.dtype,
            device=matrix.device,
            generator=generator,
        )
    raise ValueError(f"init must be 'svd' or 'random', got {init!r}")
