"""The contraction planner: which pairwise order to multiply an activation with a TT matrix, for every batch size.

``x @ M`` with M in TT or TTM form is a small tensor network: the activation x (a batch index ``b`` plus one index
per input mode), the cores (mode indices and bonds) and the output (``b`` plus the output modes). Every index other
than ``b`` joins exactly two places (two tensors, or a tensor and the output), so every pairwise contraction is one
GEMM and nothing else. The planner

1. builds that network from a ``TTLayout`` (``build_network``; padded sizes, gates folded into the cores),
2. searches all contraction trees exactly — dynamic programming over subsets of tensors, outer products included,
   so it is never worse than opt_einsum's ``optimal`` — under a cost model that counts the forward *and* the
   backward that autograd runs for a pairwise tree (``CostModel``),
3. returns the lower envelope over the batch size: which tree is cheapest on which interval of ``b``, with exact
   breakpoints (``plan``, ``PlanEnvelope``),
4. runs a chosen tree with reshape / permute / mm only, reading every size from the layout (``execute``), so the
   same code runs eagerly and on ``torch.fx`` proxies; or through a custom autograd.Function whose backward runs
   the planned gradient GEMMs (``execute_function``).

Why an envelope and not one plan: every intermediate either carries the batch index (it contains x) or not, so
every cost is linear in b, ``c0 + c1·b``. Merging cores first (CoMERA's (x·L)·R) pays a b-independent price to make
the b-dependent part small; at small b, pushing x through the cores one at a time wins. Keeping, per subset of
tensors, the lower envelope of its candidate sub-plans (a handful of lines) instead of a single best makes the
subset DP exact for every b at once. The DP runs on integer pairs; sympy only builds the final expressions.

The planning half (``network`` … ``envelope`` below) reads no tensor, imports no torch module itself and never
the two runner modules: a plan is a description. Running it is a layer above: ``execution`` and ``autograd`` take a
``Plan`` and derive what they need from it (its program, runner and autograd.Function, made once per plan).

Where things live (each module imports only modules listed above it, plus ``..layout`` for ``TTLayout``, a
description in ints, and ``..ops`` in the runners)::

    network.py    TTNetwork, build_network, Tree, OPS; tree helpers (_canonical, _leaves)
    cost.py       CostModel, CostTerms, DEFAULT_ALPHA / BETA / GAMMA; per-step and copy counts, subset sizes
    views.py      how a step sees its stored operands (views or permute copies): what the costs count as copies
    plans.py      Step, Plan, BATCH
    subset_dp.py  lower envelopes of lines and the exact subset DP (search, _search)
    envelope.py   EnvelopePiece, PlanEnvelope, plan()
    -- running a plan (torch) --
    execution.py  plan_program, execute
    autograd.py   PlanRunner, plan_runner, plan_function, prepare_plan, execute_function (the custom
                  autograd.Function)

This package only re-exports them: ``from comera_fx.tt import plan as planner; planner.plan(...)`` as before.
"""

from .autograd import PlanRunner, execute_function, folds_bias, plan_function, plan_runner, prepare_plan
from .cost import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_GAMMA,
    DEVICE_LAUNCH,
    CostModel,
    CostTerms,
    device_launch,
    device_type,
)
from .envelope import EnvelopePiece, PlanEnvelope, plan
from .execution import execute, plan_program
from .network import OPS, Tree, TTNetwork, build_network
from .plans import BATCH, Plan, Step
from .subset_dp import _search as _search, search  # _search: tests clear its cache

__all__ = [
    "BATCH",
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
    "DEFAULT_GAMMA",
    "DEVICE_LAUNCH",
    "OPS",
    "CostModel",
    "CostTerms",
    "EnvelopePiece",
    "Plan",
    "PlanEnvelope",
    "PlanRunner",
    "Step",
    "TTNetwork",
    "Tree",
    "build_network",
    "device_launch",
    "device_type",
    "execute",
    "execute_function",
    "folds_bias",
    "plan",
    "plan_function",
    "plan_program",
    "plan_runner",
    "prepare_plan",
    "search",
]
