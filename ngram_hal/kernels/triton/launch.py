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
    """

    warp_size: int = 32
    num_warps: int = 4
    max_num_warps: int = 32
    index_block: int = 1024

    def warps(self, threads: int) -> int:
        """Warps for a program of about ``threads`` threads: a power of two in [1, max_num_warps]."""
        want = max(1, -(-threads // self.warp_size))
        n = 1
        while n < want and n < self.max_num_warps:
            n *= 2
        return n


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def triton_available() -> bool:
    """True when the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None
