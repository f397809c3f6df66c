"""Memory: the request-to-token table, the KV slot allocator and the paged KV cache."""

from .allocator import OutOfSlotsError, SlotAllocator
from .kv_cache import KVCache, free_device_bytes
from .req_to_token import OutOfRowsError, ReqToTokenPool

__all__ = ["KVCache", "OutOfRowsError", "OutOfSlotsError", "ReqToTokenPool", "SlotAllocator",
           "free_device_bytes"]
