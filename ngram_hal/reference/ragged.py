"""Ragged per-request runs flattened into items, safe for any lengths, without reading data.

A kernel that walks ``B`` runs of ``lengths[b]`` items over a grid of ``total`` items masks
what does not fit: a negative length is an empty run, and items past ``total`` are never
written. :func:`flatten` does the same in torch: it cuts the runs so that they end by ``total``
and gives the remaining items to an extra run ``B`` that belongs to no request, so the lengths
handed to ``repeat_interleave`` always sum to exactly ``output_size``. ``total`` is a host int
the caller already knows; nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Flat:
    """``total`` items of ``B`` runs.

    ``run``: int64[total], the run each item belongs to, ``B`` for an item of no run.
    ``offset``: int64[total], the item's index inside its run.
    ``inside``: bool[total], ``run < B``.
    ``lengths``: int64[B], each run's length after the cut (``>= 0``, summing to at most ``total``).
    """

    run: torch.Tensor
    offset: torch.Tensor
    inside: torch.Tensor
    lengths: torch.Tensor

    def per_run(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``values[run[i]]`` for every item (``values``: [B]), ``fill`` for items of no run."""
        padded = torch.cat([values, values.new_full((1,), fill)])
        return padded.index_select(0, self.run)


def flatten(lengths: torch.Tensor, total: int) -> Flat:
    """Flatten runs of ``lengths`` (int64[B], any values) into ``total`` items, in run order."""
    B, dev = lengths.shape[0], lengths.device
    ends = torch.cumsum(lengths.clamp(min=0), 0).clamp(max=total)
    bounds = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), total)])
    sizes = bounds[1:] - bounds[:-1]
    run = torch.repeat_interleave(torch.arange(B + 1, dtype=torch.int64, device=dev), sizes, output_size=total)
    offset = torch.arange(total, dtype=torch.int64, device=dev) - bounds[:-1].index_select(0, run)
    return Flat(run, offset, run < B, sizes[:B])


def within(values: torch.Tensor, high: int) -> torch.Tensor:
    """bool mask of the entries of ``values`` in ``[0, high)``."""
    return (values >= 0) & (values < high)
