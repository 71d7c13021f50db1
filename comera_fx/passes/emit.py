"""``emit_traced``: the one way the graph passes write TT contractions into an FX graph (a module of its own so
that the passes which emit, ``tensorize``, ``recognize`` and ``graph_experts``, import it without importing each
other)."""

from __future__ import annotations

from collections.abc import Callable

from torch import fx


def emit_traced(graph: fx.Graph, fn: Callable, *args):
    """Trace ``fn`` on FX proxies of ``args`` into ``graph`` at the current insertion point; returns its node(s).

    The TT contraction code in ``tt/ops.py`` is written once; run on proxies it emits the same pairwise
    reshape / mm / bmm steps that it runs eagerly.
    """
    tracer = fx.proxy.GraphAppendingTracer(graph)

    def wrap(a):
        if isinstance(a, fx.Node):
            return fx.Proxy(a, tracer)
        if isinstance(a, list):
            return [wrap(x) for x in a]
        return a

    out = fn(*[wrap(a) for a in args])
    return [p.node for p in out] if isinstance(out, list) else out.node
