"""Contract tier for the allocation, cache-location and KV ops: wrong dtype, rank, length,
layout or device of an index argument raises ContractError naming the op and the argument before
anything is written; outputs are int64, contiguous, on the device; strict mode catches bad values."""

from __future__ import annotations

import pytest
import torch

from . import cases
from .checks import (assert_index_output, assert_unchanged, non_contiguous, other_device, raises_contract,
                     snapshot)

conformance = pytest.mark.conformance

INDEX_ARGS = [pytest.param(op, arg, marks=conformance(op=op), id=f"{op}-{arg}")
              for op, args in cases.INDEX_ARGS.items() for arg in args]
TIED_ARGS = [pytest.param(op, arg, marks=conformance(op=op), id=f"{op}-{arg}")
             for op, args in cases.TIED_ARGS.items() for arg in args]
BAD_DTYPES = [torch.int32, torch.float32]


def _rejects(backend, call: cases.Call, arg: str, why: str) -> None:
    """``call`` raises ContractError naming its op and ``arg`` and leaves the state as it was."""
    before = snapshot(call.state())
    with raises_contract(call.op, arg):
        call.run(backend)
    kv = call.args.get("kv")
    assert_unchanged(before, call.state(), f"{call.op} with {why}", kv.num_slots if kv is not None else None)


@conformance(tier="contract")
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,arg", INDEX_ARGS)
def test_index_dtype_rejected(backend, device, op, arg, dtype):
    """An index argument of int32 or float32 is refused, never cast."""
    call = cases.minimal(op, device, backend)
    _rejects(backend, call.replace(**{arg: call.args[arg].to(dtype)}), arg, f"{arg} as {dtype}")


@conformance(tier="contract")
@pytest.mark.parametrize("op,arg", INDEX_ARGS)
def test_index_rank_rejected(backend, device, op, arg):
    """An index argument with one axis too many is refused."""
    call = cases.minimal(op, device, backend)
    _rejects(backend, call.replace(**{arg: call.args[arg].unsqueeze(0)}), arg, f"{arg} of rank +1")


@conformance(tier="contract")
@pytest.mark.parametrize("op,arg", TIED_ARGS)
def test_tied_length_rejected(backend, device, op, arg):
    """An argument whose length must match another's is refused when one entry short."""
    call = cases.minimal(op, device, backend)
    value = call.args[arg]
    _rejects(backend, call.replace(**{arg: value[:-1].contiguous()}), arg, f"{arg} one entry short")


@conformance(tier="contract")
@pytest.mark.parametrize("op,arg", INDEX_ARGS)
def test_index_layout_rejected(backend, device, op, arg):
    """A non-contiguous index argument is refused."""
    call = cases.minimal(op, device, backend)
    _rejects(backend, call.replace(**{arg: non_contiguous(call.args[arg])}), arg, f"non-contiguous {arg}")


@conformance(tier="contract")
@pytest.mark.parametrize("op,arg", INDEX_ARGS)
def test_index_device_rejected(backend, device, op, arg):
    """An index argument on another device type is refused."""
    call = cases.minimal(op, device, backend)
    moved = call.args[arg].to(other_device(device))
    _rejects(backend, call.replace(**{arg: moved}), arg, f"{arg} on {moved.device}")


@conformance(tier="contract", op="store_kv")
@pytest.mark.parametrize("name", ["k", "v"])
def test_store_kv_rows_dtype_rejected(backend, device, name):
    """K/V rows of another float dtype than the cache's are refused, never cast."""
    call = cases.minimal("store_kv", device, backend)
    other = torch.float16 if call.args["kv"].dtype != torch.float16 else torch.float32
    _rejects(backend, call.replace(**{name: call.args[name].to(other)}), name, f"{name} as {other}")


@conformance(tier="contract")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op))
                                for op in ("alloc_extend", "gather_cache_locs", "accepted_kv_moves")])
def test_index_outputs(backend, device, op):
    """Index outputs are int64, contiguous, on the backend's device, of the documented length."""
    call = cases.minimal(op, device, backend)
    out = call.run(backend)
    if op == "alloc_extend":
        assert_index_output(out, device, (call.args["num_new_tokens"],), "alloc_extend output")
    elif op == "gather_cache_locs":
        assert_index_output(out, device, (call.args["num_tokens"],), "gather_cache_locs output")
    else:
        assert isinstance(out, tuple) and len(out) == 2, "accepted_kv_moves returns (src, dst)"
        size = call.args["accept_index"].numel()
        assert_index_output(out[0], device, (size,), "accepted_kv_moves src")
        assert_index_output(out[1], device, (size,), "accepted_kv_moves dst")


@conformance(tier="contract", op="gather_cache_locs")
def test_gather_cache_locs_without_count(backend, device):
    """num_tokens may be omitted (the op then derives it, a host sync)."""
    call = cases.minimal("gather_cache_locs", device, backend)
    n = call.args["num_tokens"]
    out = call.replace(num_tokens=None).run(backend)
    assert_index_output(out, device, (n,), "gather_cache_locs output")


# ---------------------------------------------------------------- strict mode: value checks

def _strict_only(backend):
    if not backend.strict:
        pytest.skip("value checks run only with strict=True")


@conformance(tier="contract", op="store_kv")
@pytest.mark.parametrize("where", ["past_end", "below_sentinel"])
def test_strict_store_kv_out_of_range(backend, device, where):
    _strict_only(backend)
    call = cases.minimal("store_kv", device, backend)
    locs = call.args["locs"].clone()
    locs[0] = call.args["kv"].num_slots if where == "past_end" else -2
    _rejects(backend, call.replace(locs=locs), "locs", f"loc {locs[0].item()}")


@conformance(tier="contract", op="store_kv")
def test_strict_store_kv_duplicate(backend, device):
    _strict_only(backend)
    call = cases.minimal("store_kv", device, backend)
    locs = call.args["locs"].clone()
    live = (locs != -1).nonzero().reshape(-1).tolist()
    locs[live[1]] = locs[live[0]]
    _rejects(backend, call.replace(locs=locs), "locs", "a repeated loc")


@conformance(tier="contract", op="move_kv")
@pytest.mark.parametrize("arg", ["src", "dst"])
def test_strict_move_kv_out_of_range(backend, device, arg):
    _strict_only(backend)
    call = cases.minimal("move_kv", device, backend)
    bad = call.args[arg].clone()
    bad[0] = call.args["kv"].num_slots + 3
    _rejects(backend, call.replace(**{arg: bad}), arg, f"{arg} past the last slot")


@conformance(tier="contract", op="move_kv")
def test_strict_move_kv_duplicate_dst(backend, device):
    _strict_only(backend)
    kv = cases.minimal("move_kv", device, backend).args["kv"]
    call = cases.Call("move_kv", {"kv": kv, "src": cases.index([1, 2, 3], device),
                                  "dst": cases.index([5, 6, 5], device)})
    _rejects(backend, call, "dst", "two moves into one slot")


@conformance(tier="contract", op="assign_req_to_token")
def test_strict_assign_wrong_locs_count(backend, device):
    _strict_only(backend)
    call = cases.minimal("assign_req_to_token", device, backend)
    _rejects(backend, call.replace(locs=call.args["locs"][:-1].contiguous()), "locs", "one loc short")


@conformance(tier="contract")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op))
                                for op in ("assign_req_to_token", "gather_cache_locs")])
@pytest.mark.parametrize("arg", ["req_pool_indices", "end"])
def test_strict_req_rows_out_of_range(backend, device, op, arg):
    _strict_only(backend)
    call = cases.minimal(op, device, backend)
    bad = call.args[arg].clone()
    R, M = call.args["req_to_token"].shape
    bad[0] = R if arg == "req_pool_indices" else M + 1
    _rejects(backend, call.replace(**{arg: bad}), arg, f"{arg} out of range")


@conformance(tier="contract", op="gather_cache_locs")
def test_strict_gather_wrong_count(backend, device):
    _strict_only(backend)
    call = cases.minimal("gather_cache_locs", device, backend)
    with raises_contract("gather_cache_locs", "num_tokens"):
        call.replace(num_tokens=call.args["num_tokens"] + 1).run(backend)


@conformance(tier="contract", op="alloc_extend")
def test_strict_alloc_extend_bad_lengths(backend, device):
    _strict_only(backend)
    call = cases.minimal("alloc_extend", device, backend)
    with raises_contract("alloc_extend", "num_new_tokens"):
        call.replace(num_new_tokens=call.args["num_new_tokens"] + 1).run(backend)
    prefix = call.args["prefix_lens"].clone()
    prefix[0] = call.args["seq_lens"][0] + 1
    with raises_contract("alloc_extend", "seq_lens"):
        call.replace(prefix_lens=prefix).run(backend)


@conformance(tier="contract", op="accepted_kv_moves")
def test_strict_accepted_kv_moves_bad_index(backend, device):
    _strict_only(backend)
    call = cases.minimal("accepted_kv_moves", device, backend)
    bad = call.args["accept_index"].clone()
    bad[0, 0] = bad.numel()
    with raises_contract("accepted_kv_moves", "accept_index"):
        call.replace(accept_index=bad).run(backend)
