"""Programmatic dependent launch (NVIDIA sm_90 and later): a kernel's launch overlaps the end of
the kernel before it on the stream.

A decode step at batch 1 is a chain of a few hundred short kernels, and each one's launch (its
programs placed on the multiprocessors, their set-up) otherwise starts only once the one before has
finished. A kernel launched with Triton's ``launch_pdl`` option may start while its predecessor
still runs; it must then wait for that predecessor (its completion and its memory) before its
first memory access: :func:`await_previous` does that first thing, and lets the kernel after it
launch at once in turn. Both are constexpr-gated, so a kernel compiled without them (another
target, the interpreter) holds no such instruction. A kernel's results are the same either way.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import interpreting


@triton.jit
def await_previous(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one on the stream has completed and its
    writes are visible, then let the next kernel launch. Call it before any memory access."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_keywords(enabled: bool) -> dict:
    """Keywords of a launch of a kernel that takes the ``PDL`` constexpr: the constexpr and, where
    ``enabled`` (and not interpreted), Triton's ``launch_pdl`` option. One flag sets both, so a
    kernel launched early always waits."""
    on = enabled and not interpreting()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
