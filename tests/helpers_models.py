"""Small hand-written models shared by the finder / tensorize / graph-pass / report tests, and comparison helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import opt_einsum as oe
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from hypothesis import strategies as st

from comera_fx import TTFormat, TTMatrix
from comera_fx.tt import plan as planner

DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_code_lm.py"


def load_demo(module_name: str = "train_code_lm"):
    """Import examples/train_code_lm.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(module_name, DEMO_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@st.composite
def random_trees(draw, n: int) -> planner.Tree:
    """Any contraction tree over n leaves: repeatedly join two of the remaining nodes."""
    nodes: list = list(range(n))
    while len(nodes) > 1:
        a = nodes.pop(draw(st.integers(0, len(nodes) - 1)))
        b = nodes.pop(draw(st.integers(0, len(nodes) - 1)))
        nodes.append((a, b))
    return nodes[0]


def tt_dense_reference(tt: TTMatrix) -> Tensor:
    """M (rows × cols) of a TT matrix in float64 by opt_einsum from its cores and gate vectors (each gate its own
    operand on its bond, not folded into a core), padding sliced away: independent of the library's products."""
    return tt_chain_dense([c.detach().double() for c in tt.cores], [g.detach().double() for g in tt.gates], tt.layout)


def tt_chain_dense(cores, gates, layout) -> Tensor:
    """``tt_dense_reference`` of given core and gate tensors (autograd flows through it: a reference for core
    gradients)."""
    operands = []
    for k, core in enumerate(cores):
        modes = [100 + k] if layout.format is TTFormat.TT else [100 + k, 200 + k]
        operands += [core, [k, *modes, k + 1]]
    for k, gate in enumerate(gates):
        operands += [gate, [k + 1]]
    n = len(cores)
    modes = [100 + k for k in range(n)] + ([200 + k for k in range(n)] if layout.format is TTFormat.TTM else [])
    full = oe.contract(*operands, [0, *modes, n])
    return full.reshape(layout.padded_rows, layout.padded_cols)[: layout.rows, : layout.cols]


def rel_err(actual: Tensor, expected: Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def relative_tolerance(model: nn.Module, example_inputs, rel: float) -> dict:
    """rtol/atol for ``comera_fx.testing.assert_rewrite_equivalent`` holding a rewrite to relative error ``rel``.

    Every element must lie within ``rel`` times the RMS of ``model``'s float outputs on ``example_inputs`` (a
    tuple of positional or a dict of keyword inputs, already in the model's dtype). That implies the norm-wise
    ``||rewritten - original|| <= rel * ||original||`` and asks more of each element; an element-wise ``rtol``
    alone would fail on outputs near zero, whose rounding error scales with the output, not with the element.
    Gradients (float64 checks) are held to the same absolute bound.
    """
    args, kwargs = ((), example_inputs) if isinstance(example_inputs, dict) else (tuple(example_inputs), {})
    with torch.no_grad():
        outputs = pytree.tree_leaves(model(*args, **kwargs))
    floats = torch.cat([o.reshape(-1).double() for o in outputs if isinstance(o, Tensor) and o.is_floating_point()])
    return dict(rtol=0.0, atol=rel * float(floats.pow(2).mean().sqrt()))


def assert_bf16_autocast_grads_close(model: nn.Module, reference: nn.Module, x: Tensor, rel: float = 0.02) -> None:
    """``model`` under CPU bf16 autocast gives every parameter a gradient of the parameter's dtype within ``rel``
    (relative norm) of ``reference``'s in float32 (the same loss, y.sum())."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == q.dtype
        assert float((p.grad - q.grad).norm() / q.grad.norm()) < rel


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tt_param_count(tt: TTMatrix) -> int:
    """Cores + gates counted from the module's own parameters."""
    return sum(p.numel() for p in tt.parameters())


class MLP(nn.Module):
    """Two nn.Linear layers; the output size 100 = 2²·5² is factored without padding, 97 would be padded."""

    def __init__(self, d_in: int = 128, hidden: int = 256, d_out: int = 100):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Anisotropic(nn.Module):
    """A fixed mixing (a buffer) before an MLP(128, 256, 100) makes fc1's inputs anisotropic: singular values
    from 1 down to 10^-decay. fc1 and fc2 are large (128·256, 256·100)."""

    def __init__(self, decay: float = 2.5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        basis = torch.linalg.qr(torch.randn(128, 128, generator=g))[0]
        self.register_buffer("mix", basis * torch.logspace(0, -decay, 128))
        self.net = MLP(128, 256, 100)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x @ self.mix.T)


class Big(nn.Module):
    """For the save/load tests (a fresh process imports it too): the converted weights (512 × 1024 the largest)
    are far larger than anything that stays dense."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64, padding_idx=0)
        self.up = nn.Linear(64, 1024)
        self.mid = nn.Linear(1024, 512)
        self.down = nn.Linear(512, 64)

    def forward(self, ids):
        return self.down(torch.relu(self.mid(torch.relu(self.up(self.emb(ids))))))


class FunctionalLinear(nn.Module):
    """F.linear on raw nn.Parameters: no nn.Linear module anywhere."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(256, 128) / 11)
        self.b1 = nn.Parameter(torch.randn(256) / 10)
        self.w2 = nn.Parameter(torch.randn(96, 256) / 16)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(F.linear(x, self.w1, self.b1)), self.w2)


class MatmulModel(nn.Module):
    """Parameters read as the right operand of addmm / matmul / @ / Tensor.matmul / mm (y = x P)."""

    def __init__(self):
        super().__init__()
        self.w_addmm = nn.Parameter(torch.randn(128, 192) / 11)
        self.b_addmm = nn.Parameter(torch.randn(192) / 10)
        self.w_matmul = nn.Parameter(torch.randn(192, 128) / 14)
        self.w_at = nn.Parameter(torch.randn(128, 128) / 11)
        self.w_method = nn.Parameter(torch.randn(128, 128) / 11)
        self.w_mm = nn.Parameter(torch.randn(128, 128) / 11)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, 128)
        h = torch.addmm(self.b_addmm, x, self.w_addmm)
        h = torch.matmul(torch.tanh(h), self.w_matmul)
        h = h @ self.w_at
        h = h.matmul(self.w_method)
        return torch.mm(h, self.w_mm)


class TiedLM(nn.Module):
    """Embedding and output head sharing one weight (vocab × dim)."""

    def __init__(self, vocab: int = 300, dim: int = 128, padding_idx: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


class Mixed(nn.Module):
    """Everything at once: padded tied embedding + head, nn.Linear, F.linear on a raw parameter, addmm / @ / matmul."""

    def __init__(self, vocab: int = 300, dim: int = 128, padding_idx: int | None = 0):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.fc = nn.Linear(dim, 256)
        self.w = nn.Parameter(torch.randn(dim, 256) / 16)
        self.w2 = nn.Parameter(torch.randn(dim, dim) / 11)
        self.b2 = nn.Parameter(torch.randn(dim) / 10)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = F.linear(torch.tanh(self.fc(h)), self.w)
        a = torch.addmm(self.b2, h.reshape(-1, h.shape[-1]), self.w2).reshape(h.shape)
        return self.head(torch.tanh(a + h @ self.w2 + torch.matmul(h, self.w2)))


class Tiny(nn.Module):
    """Nothing large."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.emb(ids))


class Unsupported(nn.Module):
    """``scale`` is multiplied elementwise and ``left`` is the LEFT matmul operand: neither is linear-like."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.scale = nn.Parameter(torch.randn(128, 128))
        self.left = nn.Parameter(torch.randn(128, 128) / 11)

    def forward(self, x: Tensor) -> Tensor:  # x: (128, 128)
        return self.left @ (self.fc(x) * self.scale)


class EmbeddingModel(nn.Module):
    def __init__(self, embedding: nn.Embedding, d_out: int = 64):
        super().__init__()
        self.emb = embedding
        self.out = nn.Linear(embedding.embedding_dim, d_out)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.emb(ids))


class LinearAndMatmul(nn.Module):
    """Square weights read both as ``linear`` (x Wᵀ) and as the right operand of ``@`` (x W)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.w = nn.Parameter(torch.randn(128, 128) / 11)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x) + x @ self.fc.weight)
        return h @ self.w + F.linear(h, self.w)


def large_2d_parameters(model, config):
    """Independent reference: FQNs (canonical, first in module order) of every 2-D parameter above the threshold."""
    seen, out = set(), []
    for fqn, p in model.named_parameters():
        if id(p) not in seen and p.dim() == 2 and p.numel() >= config.min_numel and min(p.shape) >= config.min_dim:
            out.append(fqn)
        seen.add(id(p))
    return out
