"""Backends that break the contract on purpose, each in one realistic way.

``tests/test_conformance_catches.py`` runs the conformance suite against each (``--backend
broken_backends:<Class>``) and checks that named tests fail.
"""

from __future__ import annotations

import torch

from ngram_hal.backend import OPS
from ngram_hal.reference import CpuBackend


class Int32AllocBackend(CpuBackend):
    """alloc_extend hands out int32 slot ids (a kernel written for 32-bit indices)."""

    name = "broken-int32-alloc"

    def _alloc_extend(self, *args):
        return super()._alloc_extend(*args).to(torch.int32)


class SequentialMoveBackend(CpuBackend):
    """move_kv copies pair by pair, so a move may read a row an earlier move already overwrote."""

    name = "broken-sequential-move"

    def _move_kv(self, kv, src, dst):
        for s, d in zip(src.tolist(), dst.tolist()):
            if s != -1 and d != -1:
                kv.k[:, d] = kv.k[:, s]
                kv.v[:, d] = kv.v[:, s]


class DroppedMoveBackend(CpuBackend):
    """move_kv is missing, yet capabilities() still lists every op (a hand-written list)."""

    name = "broken-dropped-move"
    _move_kv = None

    def capabilities(self):
        return super().capabilities().model_copy(update={"ops": list(OPS)})


class CastingStoreBackend(CpuBackend):
    """store_kv quietly casts int32 locs to int64 instead of refusing them."""

    name = "broken-casting-store"

    def store_kv(self, kv, layer, locs, k, v):
        if isinstance(locs, torch.Tensor) and locs.dtype == torch.int32:
            locs = locs.long()
        super().store_kv(kv, layer, locs, k, v)


class PartialBackend(CpuBackend):
    """An honest partial backend: no move_kv, and capabilities() says so."""

    name = "partial-no-move"
    _move_kv = None
