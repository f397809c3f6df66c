"""Memory: the request-to-token table and the KV slot allocator (the paged KV cache itself is a
contract type, :class:`ngram_hal.kv_cache.KVCache`)."""

from .allocator import OutOfSlotsError, SlotAllocator
from .req_to_token import OutOfRowsError, ReqToTokenPool

__all__ = ["OutOfRowsError", "OutOfSlotsError", "ReqToTokenPool", "SlotAllocator"]
