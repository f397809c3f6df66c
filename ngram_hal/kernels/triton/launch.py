"""Launch configuration of the portable Triton kernels, chosen by the backend that runs them."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """How the HAL's Triton kernels are launched on one device family.

    Attributes:
        warp_size: threads that run in lockstep (32 on NVIDIA, 64 on AMD CDNA).
        num_warps: warps per program of the small index kernels.
        max_num_warps: the most warps one program may have (1024 threads: 32 on NVIDIA, 16 on AMD).
        index_block: entries one program handles in the 1-D index kernels.
        attn_block_m: most rows (queries x query heads of one KV head) of an attention program.
        attn_programs: attention programs that fill the device; fewer tiles x heads than this
            split the keys. None: twice the device's multiprocessors (1 on the CPU).
        attn_min_split: fewest keys a split of the keys may hold.
        attn_num_stages: software-pipelining stages of the attention key loop.
        kernel_options: extra keyword options of every kernel launch that only one Triton target
            knows, as ``(name, value)`` pairs (AMD: ``waves_per_eu``, ``matrix_instr_nonkdim``).
            Triton refuses another target's options, so a backend sets them only where that
            target compiles the kernels; launches pass ``**dict(cfg.kernel_options)``.
    """

    warp_size: int = 32
    num_warps: int = 4
    max_num_warps: int = 32
    index_block: int = 1024
    attn_block_m: int = 64
    attn_programs: int | None = None
    attn_min_split: int = 256
    attn_num_stages: int = 2
    kernel_options: tuple[tuple[str, int], ...] = ()

    def attn_block_n(self, head_dim: int, elt_bytes: int) -> int:
        """Keys per step of the attention loop: about 8 KiB of K per step."""
        return max(16, min(128, _pow2_floor(8192 // max(1, head_dim * elt_bytes))))

    def attn_num_warps(self, block_m: int, block_d: int) -> int:
        """Warps of an attention program: 4, or 8 for the largest tiles."""
        return min(self.max_num_warps, 8 if block_m * block_d >= 128 * 128 else 4)

    def warps(self, threads: int) -> int:
        """Warps for a program of about ``threads`` threads: a power of two in [1, max_num_warps]."""
        want = max(1, -(-threads // self.warp_size))
        n = 1
        while n < want and n < self.max_num_warps:
            n *= 2
        return n


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.get_device_module(device.type).get_device_properties(device).multi_processor_count


def num_programs_to_fill(device: torch.device) -> int:
    """Programs that keep ``device`` busy: twice its multiprocessors; 1 on the CPU (interpreter)."""
    if device.type == "cpu":
        return 1
    return 2 * _multiprocessors(torch.device(device.type, device.index if device.index is not None
                                             else torch.get_device_module(device.type).current_device()))


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def triton_available() -> bool:
    """True when the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None
