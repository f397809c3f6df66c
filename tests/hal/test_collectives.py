"""ngram_hal.collectives: ranks started on this machine, their results, and one error when a rank fails."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ngram_hal.collectives import RankFailed, device_group_backend, launch
from ngram_hal.reference import CpuBackend


def summed(rank: int, world: int, base: int) -> list:
    t = torch.tensor([base + rank], dtype=torch.int64)
    return [world, CpuBackend().all_reduce(t).item()]


def one_rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up")
    dist.barrier()  # would wait for ever without the failed rank's end


def test_launch_returns_every_rank_result_in_order():
    assert launch(summed, 3, "gloo", 2**40) == [[3, 3 * 2**40 + 3]] * 3


def test_a_failing_rank_ends_every_rank_with_one_error():
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: ValueError: rank 1 gave up"):
        launch(one_rank_fails, 2, "gloo")


def test_group_backend_of_a_device_and_bad_calls():
    assert device_group_backend(torch.device("cpu")) == "gloo" == CpuBackend().capabilities().collectives
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        launch(summed, 0, "gloo", 0)
    with pytest.raises(RuntimeError, match="broadcast: no process group"):
        CpuBackend().broadcast(torch.zeros(1), 0)
