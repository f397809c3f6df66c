"""int32 index operands for Ascend's gather and scatter operators, and ragged batch helpers.

The contract keeps every index int64 in and out. Inside an op, the index operand of a gather
(``index_select``) or a scatter (``index_put_``) is narrowed to int32, the index type Ascend's
AI Core kernels are built for, right before the operator; nothing int32 is ever returned.

Narrowing is safe when every valid index is below the number of rows addressed, a host int known
from shapes. A table with more rows than int32 can address is refused with ``ContractError``
before anything is read or written. An index outside ``[0, rows)`` (a contract violation that only
strict mode checks, since finding it reads data) is replaced by ``rows``, which the operator
rejects as out of range: it never wraps around onto another row.
"""

from __future__ import annotations

import torch

from ngram_hal.contract import ContractError

INT32_MAX = 2**31 - 1


def fits_int32(op: str, arg: str, rows: int) -> None:
    """``ContractError`` naming ``op`` and ``arg`` unless indices below ``rows`` fit in int32."""
    if rows > INT32_MAX:
        raise ContractError(op, arg, f"addresses {rows} rows; Ascend's index operators take int32 indices "
                                     f"(at most {INT32_MAX + 1} rows)")


def narrow(op: str, arg: str, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``index`` (int64) as the int32 index operand of a gather or scatter over ``rows`` rows.

    Args:
        op, arg: named in the error when ``rows`` does not fit in int32.
        index: int64 tensor of any shape; entries in ``[0, rows)`` are kept, others become ``rows``.
        rows: host int, the size of the indexed dimension.
    Returns:
        int32 tensor of ``index``'s shape.
    """
    fits_int32(op, arg, rows)
    valid = (index >= 0) & (index < rows)
    return torch.where(valid, index, rows).to(torch.int32)


def take(op: str, arg: str, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along dim 0 by ``index_select`` with an int32 index; ``index``'s shape
    followed by ``values.shape[1:]``."""
    flat = narrow(op, arg, index.reshape(-1), values.shape[0])
    return values.index_select(0, flat).view(*index.shape, *values.shape[1:])


def runs(op: str, lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items of B consecutive runs of ``lengths[b]`` items, ``total`` in all, with static shapes.

    Each item finds its run by a binary search of the runs' ends (``searchsorted``), so the output
    size is the host int ``total`` and no data-dependent shape is built.

    Args:
        lengths: int64[B], non-negative. total: host int, ``sum(lengths)``.
    Returns:
        ``(run, offset)``: int64[total], the run of each item and its place inside the run.
    """
    ends = torch.cumsum(lengths, 0)
    item = torch.arange(total, dtype=torch.int64, device=lengths.device)
    run = torch.searchsorted(ends, item, right=True)
    return run, item - take(op, "lengths", ends - lengths, run)
