"""Property-testing toolkit for model rewrites (graph passes and in-place model rewrites).

    from comera_fx.testing import assert_rewrite_equivalent, check_pass, strategies

* ``assert_rewrite_equivalent(model, rewrite, example_inputs)`` — outputs and gradients agree, or an
  AssertionError naming the first diverging node (no Hypothesis needed).
* ``check_pass(pass_fn)`` — a one-call Hypothesis property over random small models.
* ``strategies`` — Hypothesis strategies: TT layouts / matrices, awkward tensors, batch sizes, random models.

Not imported by ``import comera_fx``. ``check_pass`` and ``strategies`` need Hypothesis: ``pip install
comera_fx[test]``. See docs/testing.md.
"""

from __future__ import annotations

import importlib

from .equivalence import Divergence, RewriteMismatch, assert_rewrite_equivalent, default_tolerances
from .property import check_pass

__all__ = [
    "Divergence",
    "RewriteMismatch",
    "assert_rewrite_equivalent",
    "check_pass",
    "default_tolerances",
    "strategies",
]


def __getattr__(name: str):
    # Imported on first use so that the non-Hypothesis parts work without the test extra installed.
    if name == "strategies":
        try:
            return importlib.import_module(".strategies", __name__)
        except ModuleNotFoundError as exc:
            if exc.name == "hypothesis":
                raise ModuleNotFoundError(
                    "comera_fx.testing.strategies needs Hypothesis: pip install comera_fx[test]", name="hypothesis"
                ) from exc
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
