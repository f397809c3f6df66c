"""Launch configuration of the portable Triton kernels, chosen by the backend that runs them."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LaunchConfig:
    """How the HAL's Triton kernels are launched on one device family.

    Attributes:
        warp_size: threads that run in lockstep (32 on NVIDIA, 64 on AMD CDNA).
        num_warps: warps per program of the small index kernels.
        max_num_warps: the most warps one program may have (1024 threads: 32 on NVIDIA, 16 on AMD).
        index_block: the most entries one program handles at once in the index kernels
            (``alloc_extend``, ``assign_req_to_token``, ``gather_cache_locs``,
            ``accepted_kv_moves``); a power of two.
        kv_segment_bytes: bytes of each K/V row that one ``move_kv`` program owns, read and
            written as one contiguous segment (128: a full cache line of every row).
        move_pair_tile: move pairs one ``move_kv`` program holds in registers at once; up to this
            many pairs move straight through registers, more go through a scratch buffer.
            A power of two.
        kv_tile_bytes: bytes of K (and as many of V) one ``store_kv`` program copies.
        tile_bytes_per_thread: bytes of a data tile each thread holds in the KV kernels; sets
            their warps.
    """

    warp_size: int = 32
    num_warps: int = 4
    max_num_warps: int = 32
    index_block: int = 1024
    kv_segment_bytes: int = 128
    move_pair_tile: int = 512
    kv_tile_bytes: int = 16384
    tile_bytes_per_thread: int = 128

    def __post_init__(self):
        powers_of_two = ("index_block", "kv_segment_bytes", "move_pair_tile", "kv_tile_bytes")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchConfig.{f.name}: expected a positive int, got {value!r}")
            if f.name in powers_of_two and value & (value - 1):
                raise ValueError(f"LaunchConfig.{f.name}: expected a power of two, got {value}")

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
