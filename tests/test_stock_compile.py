"""Issue 44: ``RankAdaptive`` finds stock compiles on the module tree by itself (``runtime.compiled.
note_stock_compiles``): handed ``torch.compile(model)``, a model compiled in place (``model.compile()``), blocks
compiled one by one, or a submodule replaced by its compiled wrapper. Found, the run compiles once (at most one graph
after the first step, at the last prune point); a compile the hook cannot see still recompiles at every prune.
Dynamo's ``aot_eager`` backend keeps the compiles cheap; ``CompileCounterWithBackend`` counts the graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import comera_fx
from comera_fx.runtime import RankAdaptive
from comera_fx.runtime.compiled import REGIONAL, WHOLE, compile_state, note_stock_compiles, recompile_extras
from comera_fx.tt import TTMatrix

STEPS, PRUNES = 24, 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    return model


class Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def stack() -> Stack:
    torch.manual_seed(0)
    model = Stack().double()
    comera_fx.tensorize_(model, comera_fx.TensorizeConfig(max_rank=8, min_numel=1, min_dim=1))
    return model


def matrices(model: nn.Module) -> list[TTMatrix]:
    return [m for m in model.modules() if isinstance(m, TTMatrix)]


def run(model: nn.Module, hooked: nn.Module, called: nn.Module, counter) -> tuple[RankAdaptive, int, int, torch.Tensor]:
    """Train ``called`` (the module the loop calls) with the hook given ``hooked``; returns (hook, graphs after the
    first step, graphs at the end, the last output)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook = RankAdaptive(hooked, optimizer, comera_fx.BudgetConfig(keep_fraction=0.3, total_steps=STEPS, prunes=PRUNES))
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(16, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    x.requires_grad_(True)  # every block takes an input with grad: one graph serves them all
    first = None
    for _ in range(STEPS):
        loss = ((called(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        hook.observe(loss)
        optimizer.step()
        first = counter.frame_count if first is None else first
    assert sum(1 for e in hook.history if e.shrunk) >= PRUNES - 1
    return hook, first, counter.frame_count, called(x).detach()


def dense_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model`` run eagerly, each TT matrix's weight from ``TTMatrix.dense()`` (not the planned products)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Sequential):
                first, last = module[0], module[2]
                return nn.functional.gelu(x @ first.tt.dense() + first.bias) @ last.tt.dense() + last.bias
            if isinstance(module, Stack):
                for block in module.blocks:
                    x = (
                        x
                        + torch.tanh(x @ block.up.tt.dense() + block.up.bias) @ block.down.tt.dense()
                        + block.down.bias
                    )
                return x


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "how, build, state",
    [("wrapper", mlp, WHOLE), ("in_place", stack, WHOLE), ("in_place", mlp, REGIONAL)],
    ids=["torch.compile(model)", "model.compile()", "Sequential.compile()"],
)
def test_a_stock_whole_model_compile_is_found_and_recompiles_at_most_once(how, build, state, gemms_narrow_with_rank):
    """``RankAdaptive(torch.compile(model), ...)``, or ``model.compile()`` with the hook given ``model``: the hook
    finds the compile and holds the stored shapes until the last prune point: one graph after the first step, the
    blocks of a whole-model graph stored at one width per matrix role (their kernels then are one code). An
    ``nn.Sequential`` compiled in place runs its children's forwards as frames of their own (Dynamo skips torch.nn's
    code), shared by the two TT linears: regional, one shape for both."""
    model = build()
    counter = CompileCounterWithBackend("aot_eager")
    if how == "wrapper":
        compiled = torch.compile(model, backend=counter)
        hook, first, last, out = run(model, compiled, compiled, counter)
        assert [m.name for m in hook.matrices] == ["0", "2"]  # the layers' own names, not the wrapper's
    else:
        model.compile(backend=counter)
        hook, first, last, out = run(model, model, model, counter)
    assert hook.compiled_as == state and first == 1 and last - first == 1, (first, last)
    assert hook.stored_tt_params() < hook.initial_tt_params  # compacted at the last prune point
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(out, dense_reference(model, x), rtol=1e-10, atol=1e-12)
    if isinstance(model, Stack):  # whole-model graph: the blocks' matrices too get one stored shape per role
        ups = [block.up.tt for block in model.blocks]
        assert len({tt.ranks for tt in ups}) > 1, "the blocks should have been pruned to different live ranks"
        for role in ("up", "down"):
            assert len({getattr(block, role).tt.layout for block in model.blocks}) == 1
        assert hook.stored_tt_params() > hook.live_tt_params()


def test_blocks_compiled_one_by_one_are_found_as_regional_and_recompile_at_most_once(gemms_narrow_with_rank):
    """Stock ``block.compile()`` per block: regional, one shape per role across the blocks, one graph after the first
    step for the three blocks together."""
    model = stack()
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.blocks:
        block.compile(backend=counter)
    hook, first, last, _ = run(model, model, model, counter)
    assert hook.compiled_as == REGIONAL and first == 1 and last - first == 1, (first, last)
    for role in ("up", "down"):
        assert len({getattr(block, role).tt.layout for block in model.blocks}) == 1


def test_a_compile_the_hook_cannot_see_recompiles_at_every_prune():
    """The contrast that makes the counts above mean something: the loop calls ``torch.compile(model)`` but the hook
    is given ``model`` (nothing on its tree says compiled): eager policy, a physical shrink and a graph per prune."""
    model = mlp()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    hook, first, last, _ = run(model, model, compiled, counter)
    assert hook.compiled_as is None and last - first >= PRUNES - 1, (first, last)


def test_note_stock_compiles_marks_what_the_module_tree_shows():
    """The detection alone: nothing compiled, the wrapper, a replaced submodule, one or several in-place ones."""
    plain = mlp()
    assert not note_stock_compiles(plain) and compile_state(matrices(plain)) is None
    wrapped = mlp()
    assert note_stock_compiles(torch.compile(wrapped, backend="aot_eager"))
    assert compile_state(matrices(wrapped)) == WHOLE
    replaced = mlp()
    replaced[0] = torch.compile(replaced[0], backend="aot_eager")  # one of two TT linears: part of the model
    assert note_stock_compiles(replaced) and compile_state(matrices(replaced)) == REGIONAL
    one = stack()
    one.compile(backend="aot_eager")
    assert note_stock_compiles(one) and compile_state(matrices(one)) == WHOLE
    blocks = stack()
    for block in blocks.blocks:
        block.compile(backend="aot_eager")
    assert note_stock_compiles(blocks) and compile_state(matrices(blocks)) == REGIONAL


@pytest.mark.parametrize(
    "compile_, expected",
    [
        (lambda m: torch.compile(m), ""),
        (lambda m: torch.compile(m, backend="aot_eager"), ""),
        (lambda m: torch.compile(m, mode="reduce-overhead"), "CUDA graphs"),
        (lambda m: torch.compile(m, mode="max-autotune-no-cudagraphs"), "tunes its kernels"),
        (lambda m: torch.compile(m, mode="max-autotune"), "CUDA graphs are recorded again; max-autotune tunes"),
        (lambda m: m.compile(mode="max-autotune") or m, "CUDA graphs are recorded again; max-autotune tunes"),
        (lambda m: torch.compile(m, backend="cudagraphs"), "CUDA graphs"),
    ],
    ids=["default", "aot_eager", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune", "in-place", "cg"],
)
def test_recompile_extras_reads_the_compile_mode(compile_, expected):
    """Nothing is compiled here (torch.compile is lazy): only the wrappers are read."""
    model = compile_(mlp())
    cuda = recompile_extras(model, "cuda")
    assert (expected in cuda) if expected else cuda == ""
    assert "CUDA graphs" not in recompile_extras(model, "cpu")  # Inductor records none off CUDA


def comera_run(hooked: nn.Module, called: nn.Module, prune_every) -> list[str]:
    """Four CoMERA steps with one gate slice killed before each: the warnings the hook gave."""
    optimizer = torch.optim.SGD(hooked.parameters(), lr=1e-3)
    hook = RankAdaptive(hooked, optimizer, comera_fx.CoMERAConfig(prune_every=prune_every))
    x = torch.randn(4, 32, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with torch.no_grad():
                for m in hook.matrices:
                    m.tt.gates[0][-1:] = 0  # a dead slice for every prune to remove
            called(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if prune_every is None:
            hook.prune()
    assert hook.matrices[0].tt.layout.ranks[1] < 8  # slices were removed
    return [str(w.message) for w in caught if "RankAdaptive" in str(w.message)]


def test_comera_prunes_of_a_compiled_model_warn_once_naming_the_fix():
    """CoMERA shrinks physically at every scheduled prune: compiled, a recompile each (checked here: a graph per
    prune). The hook says so once, naming BudgetConfig and prune_every=None; not for an eager model, and not for
    the one ``prune()`` after training that the message recommends."""
    model = mlp()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    messages = comera_run(compiled, compiled, prune_every=1)
    assert counter.frame_count >= 3  # a graph per prune: what the warning is about
    assert len(messages) == 1 and "BudgetConfig" in messages[0] and "prune_every=None" in messages[0]
    assert "CUDA graphs" not in messages[0]  # aot_eager, on the CPU
    eager = mlp()
    assert comera_run(eager, eager, prune_every=1) == []
    torch._dynamo.reset()
    once = mlp()
    compiled_once = torch.compile(once, backend="aot_eager")
    assert comera_run(compiled_once, compiled_once, prune_every=None) == []
