"""Collectives tier: two ranks, each a process of its own with the backend under test, move
tensors through the backend's ``all_reduce``, ``all_gather`` and ``broadcast`` over the
``torch.distributed`` backend it names (``gloo`` on the CPU and for every proxy).

The ranks run once per suite (:func:`ranks`), and each test checks one part of what they
returned: sums exact in float32, bfloat16 and int64 (values past 2**32), gathers in rank order,
a broadcast from the last rank, a strided tensor refused by name. On an accelerator each rank
takes a device of its own; with fewer than two the tier is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ngram_hal.collectives import launch
from ngram_hal.contract import ContractError

conformance = pytest.mark.conformance

WORLD = 2
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
BIG = 2**33
"""Added per rank to the int64 values: a sum that a 32-bit path would wrap."""


def rank_checks(rank: int, world: int, cls: type, device_type: str, host: bool) -> dict:
    """What one rank sees: every collective's result, moved to the host."""
    backend = cls(device=device_type if host else f"{device_type}:{rank}")
    dev = backend.device
    seen = {}
    for dtype in DTYPES:
        t = torch.full((5, 3), rank + 1, dtype=dtype, device=dev)
        if dtype == torch.int64:
            t += BIG * rank
        seen[f"all_reduce {dtype}"] = backend.all_reduce(t).cpu()
    seen["all_gather"] = backend.all_gather(torch.arange(4, dtype=torch.int64, device=dev) + BIG * rank).cpu()
    seen["broadcast"] = backend.broadcast(torch.full((4,), 10 * rank + 7, dtype=torch.int64, device=dev),
                                          world - 1).cpu()
    try:
        backend.all_reduce(torch.zeros(3, 2, device=dev).t())
        seen["strided"] = None
    except ContractError as exc:
        seen["strided"] = str(exc)
    backend.synchronize()
    return seen


@pytest.fixture(scope="module")
def ranks(unchecked_backend) -> list[dict]:
    """Each rank's :func:`rank_checks`, run once in :data:`WORLD` processes."""
    backend = unchecked_backend
    group = backend.collective_backend()
    if group is None:
        pytest.skip(f"backend '{backend.name}' names no torch.distributed backend for {backend.device}")
    host = backend.runtime.is_host
    if not host:
        count = torch.get_device_module(backend.device.type).device_count()
        if count < WORLD:
            pytest.skip(f"the collectives tier needs {WORLD} {backend.device.type} devices, this machine has {count}")
    return launch(rank_checks, WORLD, group, type(backend), backend.device.type, host)


@conformance(tier="collectives")
def test_capability_names_the_group_backend(unchecked_backend):
    """capabilities().collectives is the torch.distributed backend collective_backend() names."""
    backend = unchecked_backend
    name = backend.collective_backend()
    assert backend.capabilities().collectives == name
    assert name is None or name in dist.Backend.backend_list, f"{name!r} is not a torch.distributed backend"


@conformance(tier="collectives")
def test_no_group_is_a_clear_error(unchecked_backend, device):
    """Outside a process group a collective raises, naming itself and what is missing."""
    if dist.is_initialized():
        pytest.skip("this process belongs to a process group")
    with pytest.raises(RuntimeError, match="all_reduce: no process group"):
        unchecked_backend.all_reduce(torch.zeros(2, device=device))


@conformance(tier="collectives")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_all_reduce_sums_on_every_rank(ranks, dtype):
    want = torch.full((5, 3), sum(r + 1 for r in range(WORLD)), dtype=dtype)
    if dtype == torch.int64:
        want += BIG * sum(range(WORLD))
    for rank, seen in enumerate(ranks):
        got = seen[f"all_reduce {dtype}"]
        assert got.dtype == dtype and torch.equal(got, want), f"rank {rank}: {got} != {want}"


@conformance(tier="collectives")
def test_all_gather_in_rank_order(ranks):
    want = torch.cat([torch.arange(4, dtype=torch.int64) + BIG * r for r in range(WORLD)])
    for rank, seen in enumerate(ranks):
        assert torch.equal(seen["all_gather"], want), f"rank {rank}: {seen['all_gather']}"


@conformance(tier="collectives")
def test_broadcast_from_the_last_rank(ranks):
    want = torch.full((4,), 10 * (WORLD - 1) + 7, dtype=torch.int64)
    for rank, seen in enumerate(ranks):
        assert torch.equal(seen["broadcast"], want), f"rank {rank}: {seen['broadcast']}"


@conformance(tier="collectives")
def test_a_strided_tensor_is_refused_by_name(ranks):
    for rank, seen in enumerate(ranks):
        assert seen["strided"] is not None and "all_reduce" in seen["strided"] and "contiguous" in seen["strided"], (
            f"rank {rank}: {seen['strided']!r}")
