"""Sequential, error-compensating refit of a tensorized student's TT linears to its dense teacher.

``calibrate`` + ``tensorize_`` decompose every layer from the *teacher's* inputs: layer l's TT matrix M̂ is fit so
that ||X (M - M̂)|| is small, but in the compressed model layer l sees X̂, the output of the already-compressed
layers before it, and the errors pile up through the depth. ``refit_sequential_`` redoes the decomposition layer by
layer in execution order, each layer fit on the inputs the compressed model really gives it (GPTQ and SVD-LLM's
sequential calibration) and to the output the teacher's layer gives on the teacher's inputs:

    min over M̂, b̂  of  E||x_t M + b - (x_s M̂ + b̂)||²      x_t: the teacher's input, x_s: the student's, same token.

For a fixed M̂ the best bias is b̂ = b + Mᵀμ_t - M̂ᵀμ_s, and what is left is a weighted least-squares problem on the
centred inputs (no bias: on the raw inputs). With C = E[x_s x_sᵀ] and K = E[x_s x_tᵀ] (centred when there is a bias)
its unconstrained optimum is M' = C⁻¹ K M, and E||x_t M - x_s M̂||² = tr((M' - M̂)ᵀ C (M' - M̂)) + const, so the TT
that minimises it is the whitened TT-SVD (``tt.whiten``) of M' with the student's C, at the layer's current ranks.
The local error before and after is measured on the same statistics; a layer keeps its old cores if the refit
would not lower it (it can only be higher through the TT-SVD's quasi-optimality).

Layers that read the same input tensor (Q, K, V) are fit from one pass. Each group's pass runs the teacher and the
student only up to the group's last layer (a forward hook stops it), so the whole refit costs about
(number of groups / 2) forward passes of both models per calibration batch; with ``blocks`` (a transformer's
layers) only the group's own block runs, on cached inputs (1.7x faster on all-MiniLM-L6-v2, the rest being the
TT-SVDs themselves).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .calibrate import _check_max_batches, _iterate
from ..runtime.distributed import agreed_sum, world_size
from .calling import default_output, eval_modes, first_input, input_slot, preserved_rng, real_rows
from ..passes.find import split_example_inputs
from ..tt.inventory import is_hf_conv1d
from ..tt.layers import TTLinear
from ..tt.whiten import DEFAULT_EPS, regularized_gram, tt_chain_to_matrix, whitened_matrix_to_tt

MaskFn = Callable[[object], Tensor]

#: The refit's ridge (times the mean diagonal of C); see ``refit_sequential_``'s ``eps``.
REFIT_EPS = 1e-2


@dataclass
class LayerRefit:
    """One layer: relative local error sqrt(E||target - output||² / E||target||²) before and after."""

    name: str
    tokens: int
    error_before: float
    error_after: float
    refit: bool  # False: the new cores were not better, the old ones kept


@dataclass
class RefitSummary:
    layers: list[LayerRefit] = field(default_factory=list)
    batches: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.layers:
            return "refit_sequential_: no TT linear with a dense teacher layer"
        before = sum(l.error_before for l in self.layers) / len(self.layers)
        after = sum(l.error_after for l in self.layers) / len(self.layers)
        kept = sum(not l.refit for l in self.layers)
        return (
            f"refit_sequential_: {len(self.layers)} layers on {self.batches} batches in {self.seconds:.1f} s; "
            f"mean local error {before:.3f} -> {after:.3f}"
            + (f" ({kept} kept their cores)" if kept else "")
            + "".join(f"; {note}" for note in self.notes)
        )


class _Stop(Exception):
    """Raised by a hook once every layer of interest has run: the rest of the forward is not needed."""


def refit_sequential_(
    student: nn.Module,
    teacher: nn.Module,
    batches,
    *,
    max_batches: int | None = None,
    token_mask: MaskFn | None = None,
    blocks: Sequence[str] = (),
    eps: float = REFIT_EPS,
) -> RefitSummary:
    """Refit ``student``'s TT linears, in execution order, to ``teacher``'s dense layers at the same paths.

    Args:
        student: a ``tensorize_``-d copy of ``teacher`` (its ``TTLinear`` modules sit where the teacher has
            ``nn.Linear`` / ``Conv1D``); changed in place: cores, gates (reset to 1, the cores carry the weight) and
            biases of the refit layers. Ranks and layouts stay.
        teacher: the dense model; never modified.
        batches: a list of batches (dicts of keyword inputs, tuples of positional inputs, or tensors), or a callable
            returning one (called ``max_batches`` times, default 8). The same batches are replayed for every group.
        token_mask: ``token_mask(batch) -> Tensor`` of shape (batch, seq), nonzero at real tokens: padding rows are
            left out of the statistics of every layer whose input has those leading dims (e.g.
            ``lambda b: b["attention_mask"]``). Without it every input row counts.
        blocks: names (``named_modules()``) of blocks that run one after the other, each on the previous one's
            output (a transformer's layers, e.g. ``[f"encoder.layer.{i}" for i in range(6)]``): the layers inside
            them are then fit by calling one block at a time on cached inputs instead of whole forwards (several
            times faster on deep models). Checked on the first batch against a real forward; blocks that do not
            chain so fall back to whole forwards (noted in the summary). The result is the same either way.
        eps: ridge on C, times its mean diagonal (``tt.whiten``'s, whose own default is 1e-4). The refit's
            default 1e-2 is larger: M' = C⁻¹KM has d_in × d_out free entries and fits the noise of a few thousand
            calibration tokens (on MiniLM at 32 batches: cosine 0.717 at 1e-4, 0.723 at 1e-2, 0.715 at 1e-1;
            retrieval top-1 0.455 / 0.515 / 0.550; benchmarks/RESULTS.md).

    Both models run in eval mode under ``torch.no_grad()``; training flags and the RNG state are restored.

    Under ``torch.distributed`` (an initialized group of several ranks, each calling it with its own batches on the
    same student) the statistics of every group are summed over the ranks before the fit (``agreed_sum``: the
    same bits everywhere), so every rank computes the same cores, those of one process refitting on all the
    ranks' batches together.
    """
    started = time.perf_counter()
    drawn = _draw(batches, max_batches)
    pairs = _paired_layers(student, teacher)
    summary = RefitSummary(batches=len(drawn))
    if not pairs:
        return summary
    with eval_modes(student), eval_modes(teacher), preserved_rng(), torch.no_grad():
        chain = _BlockChain.build(student, teacher, blocks, drawn, summary.notes) if blocks else None
        for group in _groups(student, pairs, drawn[0]):
            index = chain.index_of(group) if chain is not None else None
            if index is not None:
                chain.advance_to(index)
            stats = {name: _Moments(pairs[name][0].tt.rows) for name in group}
            t_modules = {n: pairs[n][1] for n in group}
            s_modules = {n: pairs[n][0] for n in group}
            for b, batch in enumerate(drawn):
                mask = token_mask(batch) if token_mask is not None else None
                if index is None:
                    t_rows = _capture(_call(teacher, batch), t_modules, mask)
                    s_rows = _capture(_call(student, batch), s_modules, mask)
                else:
                    t_rows = _capture(chain.teacher_call(index, b), t_modules, mask)
                    s_rows = _capture(chain.student_call(index, b), s_modules, mask)
                for name in group:
                    for xs, xt in zip(s_rows[name], t_rows[name]):
                        stats[name].add(xs, xt)
            for name in group:
                stats[name].agree()  # under torch.distributed: the sums of all ranks' batches, the same bits
                tt_module, dense_module = pairs[name]
                summary.layers.append(_refit_layer(name, tt_module, dense_module, stats[name], eps))
    summary.seconds = time.perf_counter() - started
    return summary


# ---------------------------------------------------------------------------------------------- the math


class _Moments:
    """Running float64 sums of x_s x_sᵀ, x_s x_tᵀ, x_t x_tᵀ, x_s, x_t over paired token rows."""

    def __init__(self, d_in: int):
        self.n = 0
        square = lambda: torch.zeros(d_in, d_in, dtype=torch.float64)  # noqa: E731
        self.ss, self.st, self.tt = square(), square(), square()
        self.s, self.t = torch.zeros(d_in, dtype=torch.float64), torch.zeros(d_in, dtype=torch.float64)

    def add(self, xs: Tensor, xt: Tensor) -> None:
        if xs.shape != xt.shape:
            raise ValueError(f"student and teacher inputs differ in shape: {tuple(xs.shape)} vs {tuple(xt.shape)}")
        xs, xt = xs.to(torch.float64).cpu(), xt.to(torch.float64).cpu()
        self.ss += xs.T @ xs
        self.st += xs.T @ xt
        self.tt += xt.T @ xt
        self.s += xs.sum(0)
        self.t += xt.sum(0)
        self.n += xs.shape[0]

    def agree(self) -> None:
        """Sum the moments over the ranks of the default process group (no-op in one process)."""
        if world_size() == 1:
            return
        parts = [self.ss, self.st, self.tt, self.s, self.t]
        flat = torch.cat([p.reshape(-1) for p in parts] + [torch.tensor([float(self.n)], dtype=torch.float64)])
        agreed_sum(flat)
        chunks = flat[:-1].split([p.numel() for p in parts])
        self.ss, self.st, self.tt, self.s, self.t = (c.view(p.shape) for c, p in zip(chunks, parts))
        self.n = int(round(float(flat[-1])))


def compensated_target(m: Tensor, c_ss: Tensor, c_st: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """M' = (C + λI)⁻¹ K M: the dense matrix that best maps the student's inputs to the teacher's outputs."""
    c = regularized_gram(c_ss, c_ss.shape[0], eps)
    return torch.linalg.solve(c, c_st @ m)


def local_error(m: Tensor, b: Tensor | None, m_hat: Tensor, b_hat: Tensor | None, mom: "_Moments") -> float:
    """sqrt(E||x_t M + b - x_s M̂ - b̂||² / E||x_t M + b||²) from the moments (augmented with the constant 1)."""
    n = mom.n
    d_out = m.shape[1]
    zero = m.new_zeros(d_out)
    mt = torch.cat([m, (b if b is not None else zero)[None]])  # target map of [x_t, 1]
    ms = torch.cat([m_hat, (b_hat if b_hat is not None else zero)[None]])  # student map of [x_s, 1]

    def aug(second, first_a, first_b):
        top = torch.cat([second, first_a[:, None]], 1)
        bottom = torch.cat([first_b, torch.tensor([float(n)], dtype=torch.float64)])[None]
        return torch.cat([top, bottom]) / n

    a_tt, a_ss, a_st = aug(mom.tt, mom.t, mom.t), aug(mom.ss, mom.s, mom.s), aug(mom.st, mom.s, mom.t)
    target = torch.einsum("ij,ik,kj->", mt, a_tt, mt)
    err = target - 2 * torch.einsum("ij,ik,kj->", ms, a_st, mt) + torch.einsum("ij,ik,kj->", ms, a_ss, ms)
    return math.sqrt(max(float(err), 0.0) / max(float(target), 1e-300))


def _refit_layer(name: str, module: TTLinear, dense: nn.Module, mom: _Moments, eps: float) -> LayerRefit:
    tt = module.tt
    # the fit runs in float64 on the CPU (the moments live there), whatever the models' device
    m = _dense_matrix(dense).to("cpu", torch.float64)
    b = dense.bias.detach().to("cpu", torch.float64) if getattr(dense, "bias", None) is not None else None
    n = mom.n
    if n == 0:
        raise ValueError(f"refit_sequential_: {name} saw no input row (every token masked by token_mask?)")
    c_ss, c_st = mom.ss / n, mom.st / n
    if b is not None:  # the bias absorbs the means: fit on centred inputs
        mu_s, mu_t = mom.s / n, mom.t / n
        c_ss, c_st = c_ss - torch.outer(mu_s, mu_s), c_st - torch.outer(mu_s, mu_t)
    old_m = tt.dense().detach().to("cpu", torch.float64)
    old_b = module.bias.detach().to("cpu", torch.float64) if module.bias is not None else None
    before = local_error(m, b, old_m, old_b, mom)

    target = compensated_target(m, c_ss, c_st, eps)
    ranks = tt.ranks
    cores = whitened_matrix_to_tt(target, c_ss, tt.row_modes, tt.col_modes, ranks, eps=eps)
    cores = [_pad_core(core, tuple(old.shape)) for core, old in zip(cores, tt.cores)]
    new_m = tt_chain_to_matrix(cores, tt.row_modes, tt.col_modes, tt.rows, tt.cols)
    new_b = None
    if module.bias is not None:
        shift = (m.T @ (mom.t / n) - new_m.T @ (mom.s / n)) if b is not None else -(new_m.T @ (mom.s / n))
        new_b = (b if b is not None else torch.zeros_like(shift)) + shift
    after = local_error(m, b, new_m, new_b, mom)
    if not after < before:
        return LayerRefit(name, n, before, before, False)
    with torch.no_grad():
        for param, core in zip(tt.cores, cores):
            param.copy_(core.to(param.dtype))
        for gate in tt.gates:
            gate.fill_(1.0)
        if module.bias is not None:
            module.bias.copy_(new_b.to(module.bias.dtype))
    return LayerRefit(name, n, before, after, True)


def _pad_core(core: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Zero slices up to the module's core shape (a bond the TT-SVD found lower-rank than its cap)."""
    if tuple(core.shape) == shape:
        return core
    out = core.new_zeros(shape)
    out[: core.shape[0], :, : core.shape[2]] = core
    return out


def _dense_matrix(module: nn.Module) -> Tensor:
    """The teacher layer's M (in × out): Wᵀ for nn.Linear, W itself for GPT-2's Conv1D."""
    weight = module.weight.detach()
    return weight if is_hf_conv1d(module) else weight.T


# ---------------------------------------------------------------------------------------------- running the models


def _paired_layers(student: nn.Module, teacher: nn.Module) -> dict[str, tuple[TTLinear, nn.Module]]:
    """Module path -> (student TTLinear, teacher dense layer) where both exist with the same shape."""
    dense = dict(teacher.named_modules())
    pairs = {}
    for name, module in student.named_modules():
        if not isinstance(module, TTLinear) or module.transposed or module.tt.is_zero:
            continue
        other = dense.get(name)
        if other is None or not (isinstance(other, nn.Linear) or is_hf_conv1d(other)):
            continue
        if tuple(_dense_matrix(other).shape) != (module.tt.rows, module.tt.cols):
            raise ValueError(
                f"refit_sequential_: {name} is {module.tt.rows} x {module.tt.cols} in the student but "
                f"{tuple(_dense_matrix(other).shape)} in the teacher; pass the teacher this student was "
                f"tensorized from"
            )
        pairs[name] = (module, other)
    return pairs


def _groups(student: nn.Module, pairs: dict, batch) -> list[list[str]]:
    """The paired layers in the order the student first calls them, consecutive readers of one input grouped."""
    order: list[tuple[str, Tensor]] = []

    def hook(name):
        def record(module, args, kwargs, output):
            if all(seen != name for seen, _ in order):
                order.append((name, first_input(args, kwargs)))

        return record

    handles = [module.register_forward_hook(hook(name), with_kwargs=True) for name, (module, _) in pairs.items()]
    try:
        _call(student, batch)()
    finally:
        for handle in handles:
            handle.remove()
    groups: list[list[str]] = []
    last_input = None
    for name, x in order:
        if groups and x is last_input:
            groups[-1].append(name)
        else:
            groups.append([name])
        last_input = x
    return groups


def _call(model: nn.Module, batch) -> Callable[[], object]:
    args, kwargs = split_example_inputs(batch)
    return lambda: model(*args, **kwargs)


def _capture(run: Callable[[], object], modules: dict[str, nn.Module], mask: Tensor | None) -> dict[str, list]:
    """The (masked, flattened) input rows of each module during ``run()`` (a forward), one entry per call; the
    forward stops once every module has run."""
    rows: dict[str, list] = {name: [] for name in modules}

    def hook(name):
        def record(module, args, kwargs, output):
            x = first_input(args, kwargs).detach()
            rows[name].append(real_rows(x, mask, x.shape[-1]))
            if all(rows.values()):
                raise _Stop

        return record

    handles = [module.register_forward_hook(hook(name), with_kwargs=True) for name, module in modules.items()]
    try:
        run()
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return rows


class _BlockChain:
    """Runs the named blocks (e.g. a transformer's layers) one at a time on cached inputs instead of whole forwards.

    The teacher's input to every block (its args and kwargs) is recorded once per batch from real forwards. The
    student's input to block i is the output of its block i - 1 (refit by then) in the place of the teacher's
    hidden state, the other arguments (attention mask, ...) being those of the student's first block. That is
    checked on the first batch against a real forward of the student before it is used; a model whose blocks do
    not chain that way (T5 passes a position bias from its first block on) falls back to whole forwards."""

    def __init__(self, student_blocks, teacher_blocks, names, teacher_calls, student_calls):
        self.names, self.student_blocks, self.teacher_blocks = list(names), student_blocks, teacher_blocks
        self.teacher_calls, self.student_inputs, self.position = teacher_calls, student_calls, 0
        # where each batch's hidden state sits, found once: replacing it keeps it there for every later block
        self.slots = [input_slot(*call) for call in student_calls]

    @classmethod
    def build(cls, student, teacher, names, batches, notes: list[str]) -> "_BlockChain | None":
        s_modules, t_modules = dict(student.named_modules()), dict(teacher.named_modules())
        unknown = [n for n in names if n not in s_modules or n not in t_modules]
        if unknown:
            raise ValueError(
                f"refit_sequential_: blocks {unknown} are not modules of both models; names are those "
                f"of named_modules(), e.g. the layers of a transformer"
            )
        s_blocks, t_blocks = [s_modules[n] for n in names], [t_modules[n] for n in names]
        teacher_calls = [_block_calls(teacher, t_blocks, batch) for batch in batches]
        first = _block_calls(student, s_blocks, batches[0])
        problem = next((p for calls in teacher_calls + [first] if (p := _check_calls(calls, names))), None)
        problem = problem or _chain_problem(s_blocks, first, names)
        if problem:
            notes.append(f"blocks not used ({problem}): every group ran whole forwards")
            return None
        student_calls = [first[0]] + [_block_calls(student, s_blocks[:1], batch)[0] for batch in batches[1:]]
        return cls(s_blocks, t_blocks, names, teacher_calls, student_calls)

    def index_of(self, group: list[str]) -> int | None:
        """The block holding every layer of the group (None: outside the blocks, or a block already passed)."""
        for i, name in enumerate(self.names):
            if all(layer.startswith(name + ".") for layer in group):
                return i if i >= self.position else None
        return None

    def advance_to(self, index: int) -> None:
        while self.position < index:
            block = self.student_blocks[self.position]
            self.student_inputs = [
                _next_call(call, block(*call[0], **call[1]), slot)
                for call, slot in zip(self.student_inputs, self.slots)
            ]
            self.position += 1

    def teacher_call(self, index: int, b: int) -> Callable[[], object]:
        args, kwargs = self.teacher_calls[b][index]
        return lambda: self.teacher_blocks[index](*args, **kwargs)

    def student_call(self, index: int, b: int) -> Callable[[], object]:
        args, kwargs = self.student_inputs[b]
        return lambda: self.student_blocks[index](*args, **kwargs)


def _block_calls(model: nn.Module, blocks: list[nn.Module], batch) -> list:
    """(args, kwargs) of every call of each block in one forward (a list per block); stops after the last block."""
    calls: list[list] = [[] for _ in blocks]

    def hook(i):
        def record(module, args, kwargs):
            calls[i].append((args, dict(kwargs)))
            if i == len(blocks) - 1:
                raise _Stop

        return record

    handles = [block.register_forward_pre_hook(hook(i), with_kwargs=True) for i, block in enumerate(blocks)]
    try:
        _call(model, batch)()
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return [c[0] if len(c) == 1 else None for c in calls]


def _check_calls(calls: list, names: list[str]) -> str | None:
    for name, call in zip(names, calls):
        if call is None:
            return f"{name} ran other than once per forward"
        if input_slot(*call) is None:
            return f"{name} was called without a tensor input"
    return None


def _next_call(call: tuple, output, slot: int | str) -> tuple:
    """The next block's (args, kwargs): this block's call with its hidden state (at ``slot``, ``input_slot`` of the
    call) replaced by the output."""
    args, kwargs = call
    hidden = default_output(output)
    if isinstance(slot, int):
        return args[:slot] + (hidden,) + args[slot + 1 :], kwargs
    return args, {**kwargs, slot: hidden}


def _chain_problem(blocks: list[nn.Module], real: list, names: list[str]) -> str | None:
    """Why calling the blocks in a chain from the first one's call would not reproduce the real forward, if so."""
    call = real[0]
    slot = input_slot(*call)
    for i in range(1, len(blocks)):
        try:
            call = _next_call(call, blocks[i - 1](*call[0], **call[1]), slot)
        except ValueError:  # default_output found no tensor in the block's output
            return f"the output of {names[i - 1]} holds no tensor"
        (args, kwargs), (want_args, want_kwargs) = call, real[i]
        if len(args) != len(want_args) or kwargs.keys() != want_kwargs.keys():
            return f"{names[i]} is called with other arguments than {names[0]}"
        for got, want in list(zip(args, want_args)) + [(kwargs[k], want_kwargs[k]) for k in kwargs]:
            if isinstance(got, Tensor) or isinstance(want, Tensor):
                same = (
                    isinstance(got, Tensor)
                    and isinstance(want, Tensor)
                    and got.shape == want.shape
                    and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
                )
            else:
                same = got is want or got == want
            if not same:
                return f"the input of {names[i]} is not the output of the block before it"
    return None


def _draw(batches, max_batches: int | None) -> list:
    _check_max_batches(max_batches)
    drawn = list(_iterate(batches, max_batches or (8 if callable(batches) else None)))  # a callable: 8 by default
    if not drawn:
        raise ValueError("refit_sequential_ got no batches; pass a list of batches or a callable returning one")
    return drawn
