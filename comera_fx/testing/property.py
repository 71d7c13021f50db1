"""``check_pass``: one call that property-tests a graph pass (or model rewrite) on random models."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .equivalence import RewriteMismatch, assert_rewrite_equivalent

__all__ = ["check_pass"]


def _resolve_settings(settings):
    """The user's settings (a ``hypothesis.settings`` or a registered profile name), or the loaded profile with no
    deadline (the first example pays for tracing and, optionally, compiling)."""
    from hypothesis import HealthCheck
    from hypothesis import settings as Settings

    if settings is None:
        base = Settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    elif isinstance(settings, str):
        base = Settings.get_profile(settings)
    elif isinstance(settings, Settings):
        base = settings
    else:
        raise TypeError(f"settings must be a hypothesis.settings or a profile name, got {type(settings).__name__}")
    # One error to raise: check_pass promises an AssertionError, never an ExceptionGroup of several bugs.
    return Settings(base, report_multiple_bugs=False)


def _is_final_run() -> bool:
    """True when Hypothesis replays the shrunk example it will report: only that run needs the located report."""
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:  # not under Hypothesis, or its internals moved: always locate
        return True


def check_pass(
    pass_fn: Callable[[nn.Module], nn.Module],
    *,
    settings=None,
    graph: bool | None = True,
    models=None,
    batch_sizes=None,
    rtol: float | None = None,
    atol: float | None = None,
    norm_rtol: float | None = None,
    grads: bool = True,
    dtype: torch.dtype = torch.float64,
    compile_backend=None,
    num_inputs: int = 1,
) -> None:
    """Property: ``pass_fn`` preserves the function of random models. Runs now; raises on the first failure.

    Each example is a model from ``strategies.models()`` (or the ``models`` strategy given, which must draw
    ``(model, example_inputs)``, or a ``ModelCase``) checked with ``assert_rewrite_equivalent``.
    ``graph=True`` (default): ``pass_fn`` is a ``GraphModule -> GraphModule`` FX pass and receives the traced model;
    ``False``: an ``nn.Module``
    rewrite; ``None``: decided from its annotation. ``batch_sizes`` (a strategy, e.g.
    ``strategies.batch_sizes((8, 16))``) replaces the default batch sizes 0..3.

    On failure Hypothesis shrinks the model to a minimal one and re-raises ``RewriteMismatch`` (an
    AssertionError) whose report starts with that shrunk example and names the first diverging node.
    ``settings``: a ``hypothesis.settings`` object or profile name; by default the currently loaded profile
    without a deadline. Needs Hypothesis (``pip install comera_fx[test]``).
    """
    from hypothesis import given

    from . import strategies

    if models is not None and batch_sizes is not None:
        raise ValueError("give batch_sizes to your models strategy instead: models(batch_sizes=...)")
    if models is not None and num_inputs != 1:
        raise ValueError("give num_inputs to your models strategy instead: models(num_inputs=...)")
    cases = (
        models if models is not None else strategies.models(dtype=dtype, batch_sizes=batch_sizes, num_inputs=num_inputs)
    )

    def rewrite_preserves_function(case) -> None:
        model, example_inputs = case
        try:
            assert_rewrite_equivalent(
                model,
                pass_fn,
                example_inputs,
                rtol=rtol,
                atol=atol,
                norm_rtol=norm_rtol,
                grads=grads,
                dtype=dtype,
                compile_backend=compile_backend,
                graph=graph,
                locate=_is_final_run(),
                extra_inputs=getattr(case, "more_inputs", ()),
            )
        except RewriteMismatch as exc:
            raise exc.with_case(case)

    # Keep each pass's saved failures (Hypothesis' example database) apart from other passes'.
    module = getattr(pass_fn, "__module__", None) or ""
    name = getattr(pass_fn, "__qualname__", None) or type(pass_fn).__qualname__
    rewrite_preserves_function._hypothesis_internal_add_digest = f"{module}.{name}".encode()
    property_test = _resolve_settings(settings)(given(case=cases)(rewrite_preserves_function))
    property_test()
