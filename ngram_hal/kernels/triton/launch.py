"""Launch configuration of the portable Triton kernels, chosen by the backend that runs them."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """How the HAL's Triton kernels are launched on one device family.

    Attributes:
        warp_size: threads that run in lockstep (32 on NVIDIA, 64 on AMD CDNA).
        num_warps: warps per program of the small index kernels.
        max_num_warps: the most warps one program may have (1024 threads: 32 on NVIDIA, 16 on AMD).
        attn_block_m: most rows (queries x query heads of one KV head) of an attention program.
        attn_programs: attention programs that fill the device; fewer tiles x heads than this
            split the keys. None: twice the device's multiprocessors (1 on the CPU).
        attn_min_split: fewest keys a split of the keys may hold.
        attn_num_stages: software-pipelining stages of the attention key loop.
        attn_key_bytes: bytes of K one step of the attention key loop reads per KV head (sets the
            keys per step, ``BLOCK_N``).
        attn_warps: warps of an attention program (None: 4, or 8 for the largest tiles).
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
    attn_block_m: int = 64
    attn_programs: int | None = None
    attn_min_split: int = 256
    attn_num_stages: int = 2
    attn_key_bytes: int = 8192
    attn_warps: int | None = None

    def attn_block_n(self, head_dim: int, elt_bytes: int) -> int:
        """Keys per step of the attention loop: ``attn_key_bytes`` of K, 16 to 128 keys."""
        return max(16, min(128, _pow2_floor(self.attn_key_bytes // max(1, head_dim * elt_bytes))))

    def attn_num_warps(self, block_m: int, block_d: int) -> int:
        """Warps of an attention program: ``attn_warps``, or 4 (8 for the largest tiles)."""
        if self.attn_warps is not None:
            return min(self.max_num_warps, self.attn_warps)
        return min(self.max_num_warps, 8 if block_m * block_d >= 128 * 128 else 4)

    def __post_init__(self):
        powers_of_two = ("index_block", "kv_segment_bytes", "move_pair_tile", "kv_tile_bytes", "attn_block_m")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("attn_programs", "attn_warps"):
                continue
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
