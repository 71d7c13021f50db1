"""``TTExperts``: the TT replacement of a transformers experts module (Mixtral, Qwen2/3-MoE, ... layout).

transformers 5.x keeps the experts of a sparse MoE block in one module with 3D parameters (``gate_up_proj``
E × 2F × D or ``up_proj``, and ``down_proj`` E × D × F; transposed when the class says ``is_transposed``) and
runs them through one of several implementations chosen by ``config._experts_implementation``: an eager loop
that calls ``F.linear`` on ``weight[e]`` for each expert hit, ``batched_mm`` (``weight[expert_ids]`` then
``bmm``) or ``grouped_mm`` (the whole 3D tensor in one grouped GEMM, which has no float64 path). Only the eager
loop could read an indexable stand-in for the parameter; the other two need a real 3D tensor. So the *module* is
swapped: ``TTExperts`` takes the same call (hidden states, top-k indices, top-k weights) from the unchanged
router code and runs, for each expert a token reached, that expert's planned TT products. Whichever
implementation the dense model used, the converted one computes the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bank import TTExpertBank
from .unreached import expert_parameters, tie_unreached

# Attributes transformers' ``use_experts_implementation`` decorator sets on every experts module it wraps.
_DECORATOR_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module: wrapped by ``use_experts_implementation`` and holding 3D projections."""
    if not all(hasattr(module, flag) for flag in _DECORATOR_FLAGS) or not hasattr(module, "num_experts"):
        return False
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return all(
        isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
        for name in (first, "down_proj")
    )


def hf_experts_problem(module: nn.Module) -> str | None:
    """Why ``TTExperts`` cannot stand in for this transformers experts module, or None."""
    from transformers.integrations.moe import _default_apply_gate

    if module.has_post_expert_norm:
        return "the experts apply a norm after each expert (has_post_expert_norm), which TTExperts does not run"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts (sentinel routing) are not supported"
    if module.has_gate and not getattr(module, "is_concatenated", True):
        return "the gate and up columns are interleaved (is_concatenated=False), which TTExperts does not split"
    if module.has_gate and getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{type(module).__name__} has its own gating function (_apply_gate), which TTExperts does not reproduce"
    return probe_problem(module)


def probe_problem(module: nn.Module) -> str | None:
    """Whether the module computes what ``TTExperts`` computes, checked on its own dense weights: a few random
    tokens and routings through its forward and through ``TTExperts``' algorithm on the dense slices. A class
    that changes the loop (a scale, a clamp, another signature) is then not swapped; None when they agree."""
    up_name, _ = hf_projection_names(module)
    weight = getattr(module, up_name)
    if weight.device.type == "meta" or not hasattr(module, "act_fn"):
        return None if weight.device.type == "meta" else "the experts module has no act_fn for TTExperts to use"
    experts, dim = module.num_experts, module.down_proj.shape[2 if module.is_transposed else 1]
    generator = torch.Generator().manual_seed(0)
    tokens = 2 * experts
    hidden = torch.randn(tokens, dim, generator=generator).to(weight)
    index = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)]).to(weight.device)
    weights = torch.rand(tokens, 2, generator=generator).to(weight)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            # the class's own eager loop (what transformers' decorator wraps; grouped_mm has no float64 path),
            # without hooks: the user's hooks see no probe
            eager = getattr(type(module).forward, "__wrapped__", None)
            got = eager(module, hidden, index, weights) if eager else module.forward(hidden, index, weights)
        except Exception as exc:  # another signature: the module's forward must run itself
            return f"its forward does not take (tokens, top-k index, top-k weights) ({type(exc).__name__}: {exc})"
        expected = TTExperts.run_dense(module, hidden, index, weights)
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        return "its forward returns something else than TTExperts' (tokens × hidden) output"
    tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    if (got - expected).abs().max() > tol * max(float(expected.abs().max()), 1e-6):
        return "its forward computes something else than transformers' standard experts loop (checked on a probe)"
    return None


def hf_projection_names(module: nn.Module) -> tuple[str, str]:
    """The 3D parameters of an experts module: (up-projection name, down-projection name)."""
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


class TTExperts(nn.Module):
    """Stand-in for a transformers experts module whose projections are ``TTExpertBank``s.

    ``forward(hidden_states, top_k_index, top_k_weights)`` is the experts module's: tokens (T × D), each token's
    chosen experts (T × k) and routing weights (T × k). For every expert some token chose, its tokens are
    gathered, multiplied by that expert's TT matrices (gate/up, activation, down), weighted and added back —
    the eager path of transformers, with TT products in place of ``F.linear`` on a slice. Biases stay dense.
    """

    def __init__(
        self,
        up: TTExpertBank,
        down: TTExpertBank,
        act_fn: nn.Module,
        *,
        has_gate: bool,
        up_bias: Tensor | None = None,
        down_bias: Tensor | None = None,
        up_name: str = "gate_up_proj",
    ):
        super().__init__()
        if len(up) != len(down):
            raise ValueError(f"up and down banks hold {len(up)} and {len(down)} experts")
        self.num_experts = len(up)
        self.has_gate = has_gate
        self.up_name = up_name
        self.add_module(up_name, up)
        self.down_proj = down
        self.act_fn = act_fn
        self.up_bias = _parameter(up_bias)
        self.down_bias = _parameter(down_bias)

    @property
    def up(self) -> TTExpertBank:
        return self._modules[self.up_name]

    @classmethod
    def from_hf(cls, module: nn.Module, up: TTExpertBank, down: TTExpertBank) -> "TTExperts":
        """Replace transformers experts ``module`` by the given banks (its biases and activation are kept)."""
        up_name, _ = hf_projection_names(module)
        bias = (lambda name: getattr(module, f"{name}_bias", None)) if module.has_bias else (lambda name: None)
        new = cls(
            up,
            down,
            module.act_fn,
            has_gate=module.has_gate,
            up_bias=bias(up_name),
            down_bias=bias("down_proj"),
            up_name=up_name,
        )
        new.train(module.training)
        return new

    @staticmethod
    def run_dense(module: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """This class's algorithm on a dense transformers experts module's weights (``probe_problem``)."""
        up_name, _ = hf_projection_names(module)
        matrices = {name: getattr(module, name) for name in (up_name, "down_proj")}
        if module.is_transposed:
            matrices = {name: p.transpose(1, 2) for name, p in matrices.items()}
        bias = (lambda name: getattr(module, f"{name}_bias", None)) if module.has_bias else (lambda name: None)
        up_bias, down_bias = bias(up_name), bias("down_proj")

        def expert_forward(e: int, x: Tensor) -> Tensor:
            h = F.linear(x, matrices[up_name][e], None if up_bias is None else up_bias[e])
            h = _activate(h, module.act_fn, module.has_gate)
            return F.linear(h, matrices["down_proj"][e], None if down_bias is None else down_bias[e])

        return route(hidden, index, weights, module.num_experts, expert_forward)

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        """One expert on its tokens ``x`` (n × D) -> (n × D), through its TT products."""
        h = self.up.project(expert, x, None if self.up_bias is None else self.up_bias[expert])
        h = _activate(h, self.act_fn, self.has_gate)
        return self.down_proj.project(expert, h, None if self.down_bias is None else self.down_bias[expert])

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        reached: list[int] = []
        out = route(hidden_states, top_k_index, top_k_weights, self.num_experts, self.expert_forward, reached)
        # the experts no token reached get zero gradients, as the dense 3D weight's rows do (moe/unreached.py)
        missed = set(range(self.num_experts)) - set(reached)
        params = [p for bank in (self.up, self.down_proj) for p in expert_parameters(bank, missed)]
        if not reached:  # the biases (E × out, one parameter each) too
            params += [b for b in (self.up_bias, self.down_bias) if b is not None]
        return tie_unreached(out, params)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, has_gate={self.has_gate}"


def _activate(h: Tensor, act_fn, has_gate: bool) -> Tensor:
    if has_gate:
        gate, up = h.chunk(2, dim=-1)
        return act_fn(gate) * up
    return act_fn(h)


def route(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    num_experts: int,
    expert_forward,
    reached: list[int] | None = None,
) -> Tensor:
    """transformers' eager experts loop: every expert some token chose runs ``expert_forward(e, its tokens)``,
    weighted and added back; ``reached`` (when given) gets the experts that ran."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        # (experts, k, tokens): which (slot, token) pairs chose each expert; one extra class absorbs indices
        # past the last expert, as transformers' eager loop does.
        mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()  # the one host sync
    for expert in hit:
        if expert >= num_experts:
            continue
        if reached is not None:
            reached.append(expert)
        slot, token = torch.where(mask[expert])
        y = expert_forward(expert, hidden_states[token])
        y = y * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _parameter(value: Tensor | None) -> nn.Parameter | None:
    if value is None or isinstance(value, nn.Parameter):
        return value
    return nn.Parameter(value.detach().clone())
