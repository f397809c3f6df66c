"""Collectives through ``torch.distributed``: the process-group backend of a device, a process
group per rank, and N ranks started on one machine.

The HAL has no collective of its own. :meth:`Backend.collective_backend
<ngram_hal.backend.Backend.collective_backend>` names the ``torch.distributed`` backend for the
backend's device (by default torch's own map from device type: ``gloo`` for the CPU, ``nccl`` for
CUDA and ROCm, whose RCCL answers to that name, ``hccl`` for Ascend once torch_npu has registered
it), and ``Backend.all_reduce`` / ``all_gather`` / ``broadcast`` call ``torch.distributed`` on the
group :func:`init_group` made. :func:`launch` starts N ranks as processes of their own and
returns what each returned; when one rank raises, every other is stopped and one error names the
rank and its exception.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of :func:`launch` raised; the message names the rank and its exception."""


def device_group_backend(device: torch.device) -> str | None:
    """The ``torch.distributed`` backend torch maps ``device``'s type to (``"gloo"`` for the CPU,
    ``"nccl"`` for CUDA), or None where torch has none or was built without ``torch.distributed``."""
    if not dist.is_available():
        return None
    return dist.Backend.default_device_backend_map.get(device.type)


def init_group(group_backend: str, rank: int, world_size: int, rendezvous: str | os.PathLike) -> None:
    """Join this process to the default process group of ``world_size`` ranks as ``rank``, meeting
    the others through the file ``rendezvous`` (every rank names the same path)."""
    if dist.is_initialized():
        raise RuntimeError("init_group: this process already belongs to a process group")
    dist.init_process_group(group_backend, init_method=Path(rendezvous).resolve().as_uri(), rank=rank,
                            world_size=world_size)


def _run_rank(rank: int, fn: Callable[..., Any], world_size: int, group_backend: str, rendezvous: str,
              results: str, args: tuple) -> None:
    init_group(group_backend, rank, world_size, rendezvous)
    try:
        value = fn(rank, world_size, *args)
        Path(results, f"{rank}.pkl").write_bytes(pickle.dumps(value))
    except BaseException as exc:
        # When and why, so that launch names the rank that failed first, not one that lost its peer.
        Path(results, f"{rank}.err").write_bytes(pickle.dumps((time.time(), f"{type(exc).__name__}: {exc}")))
        raise
    finally:
        dist.destroy_process_group()


def _first_failure(results: str) -> tuple[int, str] | None:
    """``(rank, "Type: message")`` of the rank whose error came first, or None."""
    failures = [(*pickle.loads(path.read_bytes()), int(path.stem)) for path in Path(results).glob("*.err")]
    if not failures:
        return None
    _, message, rank = min(failures)
    return rank, message


def launch(fn: Callable[..., Any], world_size: int, group_backend: str, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes, each in a process group
    of ``group_backend``, and return the ranks' results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function): the ranks are spawned,
    not forked, so that no rank inherits a device context. A rank that raises ends the others and
    raises :class:`RankFailed` here naming it.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="ngram-hal-ranks-") as scratch:
        rendezvous = os.path.join(scratch, "rendezvous")
        try:
            mp.start_processes(_run_rank, args=(fn, world_size, group_backend, rendezvous, scratch, args),
                               nprocs=world_size, join=True, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            rank, message = _first_failure(scratch) or (exc.error_index, str(exc).strip().splitlines()[-1])
            raise RankFailed(f"rank {rank} of {world_size} failed: {message}") from exc
        except mp.ProcessExitedException as exc:
            raise RankFailed(f"rank {exc.error_index} of {world_size} exited with code {exc.exit_code}") from exc
        return [pickle.loads(Path(scratch, f"{rank}.pkl").read_bytes()) for rank in range(world_size)]
