"""The paged KV cache: K and V of every layer, one row per slot."""

from __future__ import annotations

import torch

from .contract import ContractError


class KVCache:
    """K and V buffers of L layers, S slots, H kv heads, head dim d.

    ``k`` and ``v`` are ``[L, S + 1, H, d]``: rows ``0..S-1`` are the slots; row ``S`` is a
    scratch row that writes aimed at the -1 sentinel land in, so backends can skip sentinels
    without a host sync. Nothing reads the scratch row as data.

    Args:
        num_layers, num_slots, num_heads, head_dim: L, S, H, d.
        dtype: float32, float16 or bfloat16.
        device: torch device.
    """

    DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots),
                            ("num_heads", num_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContractError("KVCache", name, f"expected a positive int, got {value!r}")
        if dtype not in self.DTYPES:
            raise ContractError("KVCache", "dtype", f"expected one of {self.DTYPES}, got {dtype}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots + 1, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one slot costs across all layers, K and V."""
        return 2 * num_layers * num_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_memory_fraction(cls, fraction: float, num_layers: int, num_heads: int, head_dim: int,
                             dtype: torch.dtype, device: torch.device | str,
                             free_bytes: int | None = None) -> "KVCache":
        """Size the cache to ``fraction`` of the device's free memory.

        ``free_bytes`` overrides the measurement (on the CPU it defaults to available RAM).
        """
        if not 0.0 < fraction <= 1.0:
            raise ContractError("KVCache", "fraction", f"expected 0 < fraction <= 1, got {fraction}")
        device = torch.device(device)
        if free_bytes is None:
            free_bytes = free_device_bytes(device)
        per_slot = cls.bytes_per_slot(num_layers, num_heads, head_dim, dtype)
        slots = int(free_bytes * fraction) // per_slot - 1
        if slots < 1:
            raise ContractError("KVCache", "fraction", f"{fraction} of {free_bytes} bytes holds no slot")
        return cls(num_layers, slots, num_heads, head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers (the scratch row included)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def __repr__(self) -> str:
        return (f"KVCache(L={self.num_layers}, S={self.num_slots}, H={self.num_heads}, d={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, bytes={self.nbytes})")


def free_device_bytes(device: torch.device) -> int:
    """Free memory of ``device`` in bytes: the accelerator's free memory, or available RAM."""
    if device.type == "cpu":
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
    free, _total = torch.get_device_module(device.type).mem_get_info(device)
    return int(free)
