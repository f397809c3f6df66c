"""Launch configuration of the portable Triton kernels, chosen by the backend that runs them."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """How the HAL's Triton kernels are launched on one device family.

    Attributes:
        warp_size: threads that run in lockstep (32 on NVIDIA, 64 on AMD CDNA).
        num_warps: warps per program of the small index kernels.
        max_num_warps: the most warps one program may have (1024 threads: 32 on NVIDIA, 16 on AMD).
        index_block: entries one program handles in the 1-D index kernels.
        tile: most elements in the per-program tile of the request-blocked kernels (tree and
            verify): a program takes as many requests as fit, at least one.
        interpreted_tile: the same bound under Triton's interpreter, where each program costs
            a fixed Python overhead per operation whatever its size, so fewer, larger programs
            run faster.
        vocab_block: probabilities of one request read per block of a pass over the vocabulary
            (a row's sum, the bonus token's scan).
    """

    warp_size: int = 32
    num_warps: int = 4
    max_num_warps: int = 32
    index_block: int = 1024
    tile: int = 256
    interpreted_tile: int = 1 << 18
    vocab_block: int = 4096

    def warps(self, threads: int) -> int:
        """Warps for a program of about ``threads`` threads: a power of two in [1, max_num_warps]."""
        want = max(1, -(-threads // self.warp_size))
        n = 1
        while n < want and n < self.max_num_warps:
            n *= 2
        return n

    def rows_per_program(self, rows: int, elements_per_row: int) -> int:
        """Rows (requests) one program takes when each brings ``elements_per_row`` tile elements:
        a power of two, at least 1, at most the next power of two of ``rows``, within
        :attr:`tile` (:attr:`interpreted_tile` under the interpreter)."""
        budget = self.interpreted_tile if interpreting() else self.tile
        fit = max(1, budget // max(1, elements_per_row))
        n = 1
        while n * 2 <= fit and n < rows:
            n *= 2
        return n


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def triton_available() -> bool:
    """True when the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def pow2_block(n: int) -> int:
    """The smallest power of two >= ``n``, at least 2: the size of a Triton tile axis holding ``n`` entries."""
    size = 2
    while size < n:
        size *= 2
    return size


def require_contiguous(op: str, **tensors) -> None:
    """``ValueError`` naming ``op`` and the argument unless every tensor is contiguous (the
    kernels index them as flat row-major arrays)."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{op}: argument '{name}' must be contiguous, got strides {t.stride()}")
