"""Dropout from bulk random words: a faster dropout mask on CPU, as a graph pass.

On CPU, ``F.dropout`` draws its mask with ``bernoulli_``, one generator call per element (~19 ns per element
forward at 2 threads, against ~0.2 ns for the multiply it feeds): in CoMERA's encoder the three dropout sites
of a layer cost more than its TT linears. ``fast_dropout(gm)`` rewrites each training-mode dropout of a
torch-level graph (what Dynamo captures) into a mask read from 64-bit random words, four 16-bit lanes per word:
an element is kept when its lane is at or above a threshold, so the keep probability is ``1 - p'`` with ``p'`` the
drop rate rounded to a multiple of 2**-16 (|p' - p| <= 2**-17), and kept values are scaled by ``1 / (1 - p')``, so
the output's expectation is the input exactly. The words come from the default generator (``randint`` over the
int64 range), so ``torch.manual_seed`` makes the masks reproducible; they are not eager's masks (as with
Inductor's own RNG). About 4x fewer generator calls, and the compare and the multiply fuse under Inductor
(benchmarks/investigations/bench_cpu_dropout.py).

Left as they are: dropout in eval mode, in-place dropout, a drop rate that is not a Python number or rounds to
0 or 1 (a rate outside [0, 1] keeps its error), the channel-wise / alpha variants, ``scaled_dot_product_attention``'s
``dropout_p``, and ``nn.Dropout`` as an FX ``call_module`` (its training flag is not in the graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

LANE_BITS = 16
_LANES = 64 // LANE_BITS
_LANE_VALUES = 1 << LANE_BITS
_LANE_MIN = -(1 << (LANE_BITS - 1))


def rounded_drop_rate(p: float) -> float:
    """The drop rate the 16-bit lanes realise: ``p`` rounded to a multiple of 2**-16."""
    return round(p * _LANE_VALUES) / _LANE_VALUES


def lane_threshold(p: float) -> int:
    """The signed 16-bit lane value at or above which an element is kept (keep probability 1 - rounded p)."""
    return _LANE_MIN + round(p * _LANE_VALUES)


def dropout_from_words(x: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
    """``x`` with the elements whose random 16-bit lane is below ``threshold`` zeroed, the rest scaled by ``scale``.

    Written in traceable torch ops so AOTAutograd differentiates it (the gradient is the same mask and scale)
    and Inductor fuses the compare with the multiply."""
    count = x.numel()
    # Uniform over [-2**63, 2**63 - 1): 2**64 - 1 of the 2**64 words, all 64 bits uniform to within 2**-64.
    # (``random_(-2**63, None)`` covers all 2**64 and is ~20 % faster, but its aten overload is ``random.from``,
    # which FX cannot print back as Python: ``from`` is a keyword.)
    words = torch.randint(
        -(1 << 63), (1 << 63) - 1, ((count + _LANES - 1) // _LANES,), dtype=torch.int64, device=x.device
    )
    lanes = words.view(torch.int16)[:count].view(x.shape)
    # The mask as uint8, not bool: it is what backward keeps, and Inductor's CPU code generator vectorizes a kernel
    # reading uint8 but not one reading bool or int16 (softmax / layer norm backward fused with the mask: 1.2-1.35x
    # faster, benchmarks/RESULTS.md). Values are the same: x * 0 or x * 1, then the scale.
    keep = (lanes >= threshold).to(torch.uint8)
    return x * keep * scale


_DROPOUT_SIGNATURES = {
    # target: (its parameters in order, the defaults of those that have one)
    F.dropout: (("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}),
    torch.dropout: (("input", "p", "train"), {}),
}


def _bound(node: fx.Node) -> dict | None:
    names, defaults = _DROPOUT_SIGNATURES[node.target]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    values = dict(defaults)
    values.update(zip(names, node.args))
    values.update(node.kwargs)
    return values if set(names) <= set(values) else None


def fast_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """Every training-mode ``F.dropout`` / ``torch.dropout`` of the graph drawn from bulk random words (above).

    GraphModule -> GraphModule, in place; ``gm.meta["comera_fx_dropouts_rewritten"]`` counts the rewrites."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _DROPOUT_SIGNATURES:
            continue
        args = _bound(node)
        if args is None:
            continue
        p, training = args["p"], args.get("training", args.get("train"))
        if (
            training is not True
            or args.get("inplace", False) is not False
            or isinstance(p, bool)
            or not isinstance(p, (int, float))
            or not 0 < rounded_drop_rate(p) < 1
        ):
            continue
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(
                dropout_from_words, (args["input"], lane_threshold(p), 1.0 / (1.0 - rounded_drop_rate(p)))
            )
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    gm.meta["comera_fx_dropouts_rewritten"] = rewritten
    return gm
