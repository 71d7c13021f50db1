"""The fp32 buffers packed layers rebuild weights into: one per thread, (dtype, device) and use, kept between calls."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

#: Rebuild each layer's fp32 weight in one buffer per thread (dtype, device) that all ``PackedLinear`` s share,
#: grown to the largest layer, in eager calls that record no gradient. Why: a fresh 2.4 MB allocation per call
#: came back as fresh pages, and the GEMM reading them ran 2.3x slower than from a reused buffer at 18 tokens
#: (1.59 against 0.65 ms, fp32 weight 0.70 ms; benchmarks/history/2026-12-05-issue-46-session2.md). The buffer is
#: the same peak memory a call needs anyway, kept between calls: ``workspace_bytes()`` reports it.
REUSE_WORKSPACE = True
_WORKSPACE = threading.local()

#: The most bytes a ``PackedLinear`` rebuilds at once (None: the whole weight). A larger weight is rebuilt and
#: multiplied a block of output rows at a time, so the workspace a thread keeps is at most this (or one row, or
#: a ``PackedTTLinear``'s cores, if larger). Why: the workspace counts in the memory a packed model holds; with
#: MiniLM's 384 x 1536 layers it was 2.4 MB on 5.3 MB of codes.
MAX_BYTES: int | None = 5 << 18


def eager_inference(x: Tensor) -> bool:
    """Whether a packed layer's call on ``x`` is eager (not traced), on a plain tensor, recording no gradient of x:
    where it may reuse shared buffers or call ``cpu_kernel``."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def reusable(x: Tensor) -> bool:
    """Whether a packed layer's call on ``x`` may rebuild into the shared workspace: ``REUSE_WORKSPACE`` and
    ``eager_inference`` (the next packed layer's call overwrites the buffer)."""
    return REUSE_WORKSPACE and eager_inference(x)


def chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows of a weight of ``rows`` rows of ``row_bytes`` to rebuild at once: the fewest equal blocks under
    ``MAX_BYTES`` (each block is a GEMM call of its own)."""
    if MAX_BYTES is None or rows * row_bytes <= MAX_BYTES:
        return rows
    most = max(1, MAX_BYTES // row_bytes)
    return -(-rows // -(-rows // most))  # rows over the fewest blocks of at most ``most`` rows


def shared(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    held = buffers.get((dtype, device))
    if held is None or held.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in place both inside and outside inference mode
            held = buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return held[:numel]


def workspace_bytes() -> int:
    """Bytes of this thread's shared ``PackedLinear`` workspaces (0 before any eager call)."""
    return sum(t.numel() * t.element_size() for t in _WORKSPACE.__dict__.get("buffers", {}).values())
