"""Property-test an FX pass with comera_fx.testing: a correct pass passes, a buggy one is caught and reported.

The pass here turns every ``nn.Linear`` call into ``F.linear`` on the module's parameters (a typical
normalisation step). The buggy variant forgets the bias. ``check_pass`` runs each on random small models,
shrinks the failing model to a minimal one and reports the first node whose value changed.

    pip install comera_fx[test]
    python examples/property_test_your_pass.py     # exits 0 once the bug has been caught and shown
"""

from __future__ import annotations

import sys

import torch.nn.functional as F
from hypothesis import settings
from torch import fx, nn

from comera_fx.testing import RewriteMismatch, check_pass


def linear_modules_to_functional(gm: fx.GraphModule, *, keep_bias: bool = True) -> fx.GraphModule:
    """Replace each call_module on an nn.Linear by F.linear(x, weight, bias) on get_attr nodes."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.Linear):
            continue
        module = gm.get_submodule(node.target)
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None and keep_bias else None
            functional = gm.graph.call_function(F.linear, (node.args[0], weight, bias))
        node.replace_all_uses_with(functional)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def buggy_linear_modules_to_functional(gm: fx.GraphModule) -> fx.GraphModule:
    """The same pass with a planted bug: the bias is dropped."""
    return linear_modules_to_functional(gm, keep_bias=False)


def main() -> int:
    # Reproducible output for the example; in your own test suite pass your Hypothesis profile instead.
    quick = settings(max_examples=30, deadline=None, derandomize=True, database=None)

    check_pass(linear_modules_to_functional, settings=quick)
    print("linear_modules_to_functional: preserved the function of 30 random models\n")

    try:
        check_pass(buggy_linear_modules_to_functional, settings=quick)
    except RewriteMismatch as report:
        print("buggy_linear_modules_to_functional: caught. The toolkit's report:\n")
        print(report)
        return 0
    print("buggy_linear_modules_to_functional: the bug was NOT caught")
    return 1


if __name__ == "__main__":
    sys.exit(main())
