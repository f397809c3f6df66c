"""How the tests compare floats that the code computes in two different calls.

A Triton kernel built for batch invariance sums every output in one fixed order, whatever else
shares its call: compiled for a GPU, two calls agree bit for bit, and that is what the tests
assert there. Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU runs of these tests)
``tl.dot`` is numpy's matrix product, whose BLAS may sum a row in another order by the row's
place in its tile, by the CPU model and by the thread count: there the same comparison holds
within the dtype's tolerance.
"""

from __future__ import annotations

import torch

COMPILED = torch.cuda.is_available()
"""True where the Triton kernels compile for a GPU; False where they run in the interpreter."""


def assert_invariant(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` equals ``want`` bit for bit where the kernels are compiled, and within the dtype's
    tolerance (``torch.testing.assert_close``'s defaults) under the interpreter."""
    if COMPILED:
        assert torch.equal(got, want), f"{what}: not bit for bit equal"
    else:
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
