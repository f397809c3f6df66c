"""Per-device tile counters: how a kernel's programs learn which of them finishes a tile last.

A kernel that spreads one output tile over several programs (a product's K splits) can let the last
of them finish the tile instead of launching a second kernel: each program stores its partial
result, waits for all its threads' stores (``tl.debug_barrier``), then adds one to the tile's
counter with acquire-release order (``tl.atomic_add(..., sem="acq_rel")``); the program that reads
``programs - 1`` reads the partials back (``cache_modifier=".cg"``), sets the counter to zero again
and finishes the tile. Which program comes last changes nothing but who does the finishing, so the
result's bits do not depend on the order the programs run in.

Every such launch on a device shares one buffer, all zero between launches. Launches on one
stream never run at once (a kernel launched early waits for the one before it before any memory
access), and an engine runs its forwards on one stream.
"""

from __future__ import annotations

import torch

TILE_COUNTERS = 1 << 16
"""Tiles one launch may count: the size of each device's counter buffer."""
_buffers: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int, what: str) -> torch.Tensor:
    """int32[TILE_COUNTERS] of ``device``, all zero between launches; ``tiles`` (of the launch of
    ``what``, named in the error) must fit. Made at the device's first such launch, which must not
    be under graph capture (a capture would not run the zeroing; an engine runs each forward
    eagerly before capturing it)."""
    if tiles > TILE_COUNTERS:
        raise ValueError(f"{what}: {tiles} tiles counted in one launch, at most {TILE_COUNTERS}")
    counters = _buffers.get(device)
    if counters is None:
        capturing = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            raise RuntimeError(f"{what}: the first launch with tile counters on {device} ran under graph "
                               "capture; run it once outside the capture first")
        counters = _buffers[device] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return counters
