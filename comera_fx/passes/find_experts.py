"""Find the expert weights of mixture-of-experts layers.

The graph finder (``passes.find``) cannot see them. The eager loop over the experts a batch hits is
data-dependent (``nonzero``, ``.tolist()`` or a tensor ``if``), so Dynamo breaks the graph there, and the
captured graphs hold the 3D parameter only as an input of ``getitem`` / ``transpose`` / ``_grouped_mm`` nodes,
which are not linear-like ops on a 2D weight. Three layouts are recognised here instead:

* **transformers experts modules** (``use_experts_implementation``: Mixtral, Qwen2/3-MoE, ...): found by module
  scan, with or without example inputs; converted by swapping the module (``TTExperts``), whichever of
  transformers' implementations (eager loop, batched_mm, grouped_mm) the config selects.
* **experts in an ``nn.ModuleList``** (the older layout: one ``nn.Linear`` per expert, or one small MLP per
  expert): the graph finder already lists each ``nn.Linear`` and ``tensorize_`` converts it to its own
  ``TTLinear``; this scan names the expert list and the expert index of each (the summary's notes).
* **a raw 3D parameter** (experts × a × b) in a module comera_fx does not know: its forward decides how the
  slices are read, so it must be run. With example inputs the model runs once eagerly under a
  ``TorchFunctionMode`` that records what every op does with a 3D parameter: ``P[e]`` feeding ``F.linear`` /
  ``matmul``, or the whole of P as the right operand of ``torch.bmm`` / ``matmul`` (the expert dimension is the
  batch dimension). It also records which experts' ops ran (``experts_seen``): the loop reaches only the experts
  the example tokens were routed to. A parameter that any other op also reads is not converted; one that only
  other ops read (a ``Conv1d`` weight) is not an expert weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..moe.experts import hf_projection_names, is_hf_experts
from ..moe.weight import single_index
from .find import parameter_table, split_example_inputs
from .isolation import _restore_buffers, _snapshot_buffers

HF_EXPERTS, MODULE_LIST, PARAMETER_3D = "hf-experts", "module-list", "3d-parameter"


@dataclass
class ExpertCandidate:
    """One 3D expert parameter (or one ``nn.Linear`` of an expert list) and how its experts are read.

    ``expert_dim`` is the axis of ``shape`` that indexes experts (0 for a 3D parameter; for a module list it is
    the list index, and ``shape`` is one expert's). ``uses`` are the op names seen reading the slices or the
    whole parameter; ``experts_seen`` the experts whose ops ran on the example inputs (None without them).
    """

    fqn: str
    holder: str
    layout: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_experts: int
    expert_dim: int = 0
    slice_use: str = "linear"
    uses: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    experts_seen: tuple[int, ...] | None = None
    expert_index: int | None = None  # module-list layout: which expert this nn.Linear belongs to
    expert_list: str | None = None  # module-list layout: the nn.ModuleList's path

    @property
    def slice_shape(self) -> tuple[int, int]:
        """The shape of one expert's matrix (P[e])."""
        return tuple(self.shape[1:]) if self.layout != MODULE_LIST else tuple(self.shape)

    def describe(self) -> str:
        """One line for the summary: the expert dimension, and what was seen."""
        if self.layout == MODULE_LIST:
            return (
                f"expert {self.expert_index} of {self.num_experts} in the nn.ModuleList {self.expert_list!r} "
                f"(expert dim = the list index)"
            )
        seen = (
            ""
            if self.experts_seen is None
            else (
                f"; ops of experts {list(self.experts_seen)} ran on the example inputs"
                if self.experts_seen
                else "; no expert's op ran on the example inputs"
            )
        )
        return (
            f"{self.layout}: expert dim 0 of {self.shape} ({self.num_experts} experts of "
            f"{self.slice_shape[0]}×{self.slice_shape[1]}, slices read by {self.slice_use}){seen}"
        )


@dataclass
class ExpertScan:
    """Every expert weight found, and how the model was read."""

    candidates: list[ExpertCandidate]
    traced: bool  # True when the model ran on example inputs (raw 3D parameters can only be found then)

    def of_layout(self, layout: str) -> list[ExpertCandidate]:
        return [c for c in self.candidates if c.layout == layout]


def find_experts(model: nn.Module, example_inputs=None) -> ExpertScan:
    """Expert weights of ``model``: transformers experts modules and expert ``nn.ModuleList``s by module scan,
    raw 3D parameters read through slices or ``bmm`` by running ``example_inputs`` (when given)."""
    params = parameter_table(model)
    fqn_of = {id(p): fqn for fqn, (p, _) in params.items()}
    found: dict[str, ExpertCandidate] = {}
    for path, module in model.named_modules():
        if is_hf_experts(module):
            for name in hf_projection_names(module):
                p = getattr(module, name)
                fqn = fqn_of[id(p)]
                found[fqn] = ExpertCandidate(
                    fqn,
                    path,
                    HF_EXPERTS,
                    tuple(p.shape),
                    p.dtype,
                    p.shape[0],
                    slice_use="matmul" if module.is_transposed else "linear",
                )
        elif isinstance(module, nn.ModuleList):
            for cand in _module_list_experts(module, path, fqn_of):
                found[cand.fqn] = cand
        else:
            for cand in _counted_experts(module, path, fqn_of):
                found[cand.fqn] = cand
    if example_inputs is not None:
        three_d = {id(p): fqn for fqn, (p, _) in params.items() if p.dim() == 3}
        if three_d:
            for fqn, (uses, unsupported, seen) in record_expert_uses(model, example_inputs, three_d).items():
                p = params[fqn][0]
                cand = found.get(fqn)
                if cand is None and not uses:
                    continue  # no op read it as experts (e.g. a Conv1d weight): not an expert weight
                if cand is not None and cand.layout == PARAMETER_3D:  # found by the module scan: now seen run
                    cand.slice_use = "linear" if any(u.startswith("linear") for u in uses) else "matmul"
                    cand.unsupported = sorted(unsupported)
                if cand is None:
                    holder = fqn.rpartition(".")[0]
                    use = "linear" if any(u.startswith("linear") for u in uses) else "matmul"
                    cand = found[fqn] = ExpertCandidate(
                        fqn, holder, PARAMETER_3D, tuple(p.shape), p.dtype, p.shape[0], slice_use=use
                    )
                    cand.unsupported = sorted(unsupported)
                cand.uses = sorted(uses)
                cand.experts_seen = tuple(sorted(seen))
                if cand.layout == HF_EXPERTS and unsupported:  # grouped_mm / batched_mm read P whole: swapped anyway
                    impl = getattr(
                        getattr(model.get_submodule(cand.holder), "config", None), "_experts_implementation", None
                    )
                    cand.uses.append(f"{impl or 'experts'} path (all experts at once)")
                    cand.experts_seen = cand.experts_seen or None
    order = {fqn: i for i, fqn in enumerate(params)}
    return ExpertScan(sorted(found.values(), key=lambda c: order.get(c.fqn, len(order))), example_inputs is not None)


def _counted_experts(module: nn.Module, path: str, fqn_of: Mapping[int, str]) -> list[ExpertCandidate]:
    """3D float parameters of a module that says how many experts it has (``num_experts`` /
    ``num_local_experts``, e.g. Llama 4's ``Llama4TextExperts``, JetMoE's ``JetMoeParallelExperts``) whose first
    dimension is that count: expert weights even without example inputs (their reads are then unknown, so
    they get the weight-space form unless a run shows only reads ``ExpertWeight`` serves)."""
    count = next(
        (getattr(module, n) for n in ("num_experts", "num_local_experts") if isinstance(getattr(module, n, None), int)),
        None,
    )
    if count is None or count < 2:
        return []
    out = []
    for name, p in module.named_parameters(recurse=False):
        if p.dim() == 3 and p.shape[0] == count and p.dtype.is_floating_point:
            out.append(
                ExpertCandidate(fqn_of[id(p)], path, PARAMETER_3D, tuple(p.shape), p.dtype, count, slice_use="linear")
            )
    return out


def _module_list_experts(module: nn.ModuleList, path: str, fqn_of: Mapping[int, str]) -> list[ExpertCandidate]:
    """The ``nn.Linear`` weights of an expert list: >= 2 members of one class whose linears have equal shapes."""
    members = list(module)
    if len(members) < 2 or len({type(m) for m in members}) != 1:
        return []
    linears = [[(name, sub) for name, sub in m.named_modules() if isinstance(sub, nn.Linear)] for m in members]
    signature = [(name, tuple(sub.weight.shape)) for name, sub in linears[0]]
    if not signature or any([(n, tuple(s.weight.shape)) for n, s in ls] != signature for ls in linears):
        return []
    if not _looks_like_experts(path, module):
        return []
    out = []
    for index, member_linears in enumerate(linears):
        for name, linear in member_linears:
            w = linear.weight
            holder = f"{path}.{index}" + (f".{name}" if name else "")
            out.append(
                ExpertCandidate(
                    fqn_of[id(w)],
                    holder,
                    MODULE_LIST,
                    tuple(w.shape),
                    w.dtype,
                    len(members),
                    expert_dim=0,
                    uses=["linear"],
                    expert_index=index,
                    expert_list=path,
                )
            )
    return out


def _looks_like_experts(path: str, module: nn.ModuleList) -> bool:
    """Transformer blocks are also lists of identical modules; an expert list is named so (``experts``), which
    every MoE implementation we know does."""
    return path.rpartition(".")[2] in ("experts", "local_experts")


# ----------------------------------------------------------------------------------------------- eager recording

_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.mm, Tensor.matmul, Tensor.mm, Tensor.__matmul__}
_BMM = {torch.bmm, torch.matmul, Tensor.bmm, Tensor.matmul, Tensor.__matmul__}
_METADATA = {
    "size",
    "dim",
    "__get__",
    "numel",
    "is_floating_point",
    "__len__",
    "requires_grad_",
    "type",
    "__hash__",
    "ndimension",
    "is_contiguous",
    "element_size",
    "stride",
    "storage_offset",
    "data_ptr",
}


class _UseRecorder(TorchFunctionMode):
    """Records, for each 3D parameter, the ops that read it (directly or through one expert's slice)."""

    def __init__(self, params: Mapping[int, str]):
        super().__init__()
        self.params = params
        self.slices: dict[int, tuple[str, int, Tensor]] = {}  # id(slice) -> (fqn, expert, the slice, kept alive)
        self.uses: dict[str, set[str]] = {}
        self.unsupported: dict[str, set[str]] = {}
        self.seen: dict[str, set[int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _METADATA:
            return out
        operands = list(args) + list(kwargs.values())
        if name == "__getitem__" and id(args[0]) in self.params:
            fqn = self.params[id(args[0])]
            expert = single_index(args[1])
            if expert is None:
                self.unsupported.setdefault(fqn, set()).add("index by many experts")
            else:
                self.slices[id(out)] = (fqn, expert, out)
            return out
        for position, operand in enumerate(operands):
            if id(operand) in self.slices:
                fqn, expert, _ = self.slices[id(operand)]
                weight = args[1] if len(args) > 1 else kwargs.get("weight")
                if func in _LINEAR and operand is weight:
                    self._use(fqn, "linear(x, P[e])", expert)
                elif position == 1 and func in _MATMUL and len(args) == 2:
                    self._use(fqn, "matmul(x, P[e])", expert)
                else:
                    self.unsupported.setdefault(fqn, set()).add(f"{name} on P[e]")
            elif id(operand) in self.params:
                fqn = self.params[id(operand)]
                x = args[0] if args else None
                if position == 1 and func in _BMM and len(args) == 2 and isinstance(x, Tensor) and x.dim() == 3:
                    self._use(fqn, f"{name}(x, P)", *range(operand.shape[0]))
                else:
                    self.unsupported.setdefault(fqn, set()).add(name)
        return out

    def _use(self, fqn: str, what: str, *experts: int) -> None:
        self.uses.setdefault(fqn, set()).add(what)
        self.seen.setdefault(fqn, set()).update(experts)


def record_expert_uses(
    model: nn.Module, example_inputs, params: Mapping[int, str]
) -> dict[str, tuple[set[str], set[str], set[int]]]:
    """Run ``model`` once eagerly (no grad) and return, per 3D parameter that was read: (supported uses,
    unsupported ops, experts whose ops ran). The model's buffers and the RNG state are left as they were."""
    args, kwargs = split_example_inputs(example_inputs)
    buffers = _snapshot_buffers(model)
    recorder = _UseRecorder(params)
    try:
        with torch.random.fork_rng(), torch.no_grad(), recorder:
            model(*args, **kwargs)
    finally:
        _restore_buffers(buffers)
    names = set(recorder.uses) | set(recorder.unsupported)
    return {
        fqn: (recorder.uses.get(fqn, set()), recorder.unsupported.get(fqn, set()), recorder.seen.get(fqn, set()))
        for fqn in names
    }
