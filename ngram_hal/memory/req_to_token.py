"""The request-to-token table: one row of slot locations per live request."""

from __future__ import annotations

from collections import deque

import torch

from ..contract import INDEX_DTYPE, SENTINEL, ContractError


class OutOfRowsError(RuntimeError):
    """Every row of a :class:`ReqToTokenPool` is in use."""


class ReqToTokenPool:
    """``size`` rows of ``max_context_len`` slot locations, handed out one per request.

    ``req_to_token[r, p]`` is the slot holding position ``p`` of the request owning row ``r``, or
    -1. Rows are handed out and taken back on the host; no call reads device data.

    Args:
        size: number of rows R (the most requests alive at once).
        max_context_len: M, the most positions a request may hold.
        device: torch device of the table.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        for name, value in (("size", size), ("max_context_len", max_context_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContractError("ReqToTokenPool", name, f"expected a positive int, got {value!r}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.full((size, max_context_len), SENTINEL, dtype=INDEX_DTYPE, device=self.device)
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    def available(self) -> int:
        """Rows free now."""
        return len(self._free)

    def alloc(self) -> int:
        """Take a free row; :class:`OutOfRowsError` when none is left."""
        if not self._free:
            raise OutOfRowsError(f"ReqToTokenPool: all {self.size} rows are in use")
        row = self._free.popleft()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        """Give ``row`` back and reset it to -1. Freeing a row that is not in use raises."""
        if isinstance(row, bool) or not isinstance(row, int):
            raise ContractError("ReqToTokenPool.free", "row", f"expected a Python int, got {type(row).__name__}")
        if row not in self._used:
            state = f"outside [0, {self.size})" if not 0 <= row < self.size else "not in use (double free?)"
            raise ContractError("ReqToTokenPool.free", "row", f"row {row} is {state}")
        self._used.remove(row)
        self.req_to_token[row].fill_(SENTINEL)
        self._free.append(row)

    def __repr__(self) -> str:
        return (f"ReqToTokenPool(size={self.size}, max_context_len={self.max_context_len}, "
                f"device={self.device}, free={self.available()})")
