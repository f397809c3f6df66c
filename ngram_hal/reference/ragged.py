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
    ``index``: int64[total], ``0 .. total-1``.
    ``first``: int64[B+1], the index of each run's first item (the extra run's last).
    ``lengths``: int64[B], each run's length after the cut (``>= 0``, summing to at most ``total``).
    """

    run: torch.Tensor
    index: torch.Tensor
    first: torch.Tensor
    lengths: torch.Tensor

    @property
    def inside(self) -> torch.Tensor:
        """bool[total]: the item belongs to one of the ``B`` runs."""
        return self.run < self.lengths.shape[0]

    @property
    def offset(self) -> torch.Tensor:
        """int64[total]: the item's index inside its run."""
        return self.index - self.first.index_select(0, self.run)

    def per_run(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``values[run[i]]`` for every item (``values``: [B, ...]), ``fill`` for items of no run."""
        padded = torch.cat([values, values.new_full((1, *values.shape[1:]), fill)])
        return padded.index_select(0, self.run)


def flatten(lengths: torch.Tensor, total: int) -> Flat:
    """Flatten runs of ``lengths`` (int64[B], any values) into ``total`` items, in run order."""
    B, dev = lengths.shape[0], lengths.device
    ends = torch.cumsum(lengths.clamp(0, total), 0).clamp(max=total)
    bounds = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), total)])
    sizes = bounds[1:] - bounds[:-1]
    run = torch.repeat_interleave(torch.arange(B + 1, dtype=torch.int64, device=dev), sizes, output_size=total)
    return Flat(run, torch.arange(total, dtype=torch.int64, device=dev), bounds[:-1], sizes[:B])


def within(values: torch.Tensor, high: int) -> torch.Tensor:
    """bool mask of the entries of ``values`` in ``[0, high)``."""
    return (values >= 0) & (values < high)
