"""passes.contract_reconstructed_tt on random models: every linear of a weight rebuilt from TT cores becomes the
planned contraction, and the model still computes what the dense model it came from computes.

Reference: the dense random model (float64); the TT model is made from it at full rank, so it is exact. The pass
runs on the graphs Dynamo captures (parameters as inputs), as the backend runs it, and the graphs run eagerly.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from torch import nn

import comera_fx
from comera_fx import TensorizeConfig
from comera_fx.passes import contract_reconstructed_tt
from comera_fx.passes.holders import PROPERTY_MATRICES
from comera_fx.testing import assert_rewrite_equivalent, strategies

EXACT = TensorizeConfig(min_numel=1, min_dim=1, max_rank=None)  # every weight converted, full rank: exact


def functional_linear_calls(spec) -> int:
    """F.linear calls on raw parameters per forward: the FunctionalLinear blocks, and again for each reuse."""
    kinds = [b.kind for b in spec.blocks]
    return sum(
        kind == "functional_linear" or (kind == "shared" and kinds[b.source] == "functional_linear")
        for kind, b in zip(kinds, spec.blocks)
    )


# Small models with F.linear blocks: each example captures the model and compiles it (Dynamo, no AOTAutograd);
# measured ~20 s per example on the loaded 2-core machine (396 s for 20), so 5 here and 50 in the slow suite.
MODELS = strategies.models(
    block_kinds=("functional_linear", "linear", "mlp", "residual", "layernorm", "shared"), max_blocks=3, max_features=24
)


def check_contraction(case) -> None:
    model, example_inputs = case
    rewrites: list[int] = []

    def contract(gm, inputs):
        gm = contract_reconstructed_tt(gm, inputs)
        rewrites.append(gm.meta["comera_fx_reconstructed"])
        return gm.forward

    def tensorize(m: nn.Module) -> None:
        comera_fx.tensorize_(m, EXACT, example_inputs=example_inputs)

    rewritten = assert_rewrite_equivalent(
        model, tensorize, example_inputs, graph=False, extra_inputs=case.more_inputs, compile_backend=contract
    )
    expected = functional_linear_calls(model.spec)
    assert len([m for m in rewritten.modules() if m in PROPERTY_MATRICES]) == (expected > 0) * len(
        {id(b) for b in model.blocks if type(b).__name__ == "FunctionalLinear"}
    )
    assert rewrites and all(count == expected for count in rewrites), (rewrites, expected)


@settings(max_examples=5)
@given(case=MODELS)
def test_contracting_reconstructed_weights_keeps_random_models_exact(case):
    check_contraction(case)


@pytest.mark.slow
@settings(max_examples=50)  # each example compiles: 200 would take CI's slow-suite time alone
@given(case=MODELS)
def test_contracting_reconstructed_weights_keeps_random_models_exact_thoroughly(case):
    check_contraction(case)
