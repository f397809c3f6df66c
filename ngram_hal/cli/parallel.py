"""``--tp N``: ``ngram-hal run`` or ``bench`` as N ranks of one tensor-parallel process group.

The command checks what it can before any process starts: that the model splits evenly over N
ranks, that the backend names a ``torch.distributed`` backend (gloo on the CPU, nccl on CUDA and
ROCm) and has N devices, and the speculation policy (``always``: under ``auto`` each rank would
choose tree sizes from its own timings and the ranks would part). Then
:func:`ngram_hal.collectives.launch` starts N ranks; rank r runs the same command on device r (all
on the CPU there) with its shard of the model, loaded by
:func:`~ngram_hal.engine.tensor_parallel.load_shard`. Every rank decodes the same tokens; rank 0
prints and writes the report, the others print nothing. Engines compared side by side take whole
runs in turn rather than time slices, so that every rank launches the same steps in the same
order (the steps' collectives pair up). A rank that fails ends the others, and the command exits
with one line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from ..collectives import RankFailed, launch
from ..engine.config import LlamaConfig
from ..engine.tensor_parallel import check_divisible
from ..options import POSITIVE_INT
from .common import CommandError


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    """``--tp N``."""
    parser.add_argument("--tp", type=POSITIVE_INT, default=1, metavar="N",
                        help="split the model over N ranks (tensor parallelism): N processes on the backend's "
                             "devices 0..N-1, or on the CPU; rank 0 prints (default 1: one process)")


def spec_policy(args: argparse.Namespace) -> str:
    """``--spec-policy``, resolved: ``auto`` by default on one rank, ``always`` under ``--tp``; a
    :class:`CommandError` for ``auto`` asked for under ``--tp``."""
    policy = getattr(args, "spec_policy", None)
    if args.tp == 1:
        return policy or "auto"
    if policy == "auto":
        raise CommandError(f"--spec-policy auto with --tp {args.tp}: each rank would choose tree sizes from its own "
                           "timings and the ranks would part; use --spec-policy always (the default under --tp)")
    return "always"


def check_split(args: argparse.Namespace, backend, config: LlamaConfig) -> tuple[str, list[str] | None]:
    """``(group backend, devices)`` for ``--tp N`` on ``backend``: the ``torch.distributed``
    backend of its device and each rank's device (None on the host, where every rank computes on
    the CPU); a :class:`CommandError` naming what stops the split."""
    world = args.tp
    try:
        check_divisible(config, world)
    except ValueError as exc:
        raise CommandError(f"--tp {world}: {exc}") from exc
    group = backend.collective_backend()
    if group is None:
        raise CommandError(f"--tp {world}: the '{backend.name}' backend names no torch.distributed backend for "
                           f"{backend.device}")
    if backend.runtime.is_host:
        return group, None
    kind = backend.device.type
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if count < world:
        raise CommandError(f"--tp {world}: needs {world} {kind} devices, this machine has {count}")
    return group, [f"{kind}:{rank}" for rank in range(world)]


def run_ranks(command: Callable[[argparse.Namespace], int], args: argparse.Namespace, group: str,
              devices: list[str] | None) -> int:
    """Run ``command(args)`` as ``args.tp`` ranks over ``group``, rank r on ``devices[r]``; rank
    0's exit code."""
    try:
        codes = launch(_rank, args.tp, group, command, args, devices)
    except RankFailed as exc:
        raise CommandError(str(exc), code=1) from exc
    return codes[0]


def _rank(rank: int, world: int, command: Callable[[argparse.Namespace], int], args: argparse.Namespace,
          devices: list[str] | None) -> int:
    args.tp_rank = rank
    if devices is not None:
        args.device = devices[rank]
        torch.accelerator.set_device_index(rank)
    if rank:
        args.json = None
        sys.stdout = sys.stderr = open(os.devnull, "w")
    return command(args)
