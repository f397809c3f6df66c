"""The reference attention's block layouts (one per request, ceil(N/B)-query blocks, tree
blocks) and its chunking against float64 dense attention, and its freedom from host syncs."""

from __future__ import annotations

import random

import pytest
import torch
from ngram_hal_conformance.test_attention import TOLERANCE, attention_call, dense_attention

from ngram_hal import ContractError
from ngram_hal.kv_cache import KVCache
from ngram_hal.reference import CpuBackend
from ngram_hal.reference import attention as ref_attention

CASES = {
    # B * min(N, max_kv_len) <= 2N: one block per request.
    "per-request-prefill": dict(kv_lens=[23], q_lens=[23]),
    "per-request-two-prompts": dict(kv_lens=[9, 12], q_lens=[9, 12]),
    # Otherwise blocks of ceil(N / B) queries.
    "blocks-decode": dict(kv_lens=[5, 31, 2, 17], q_lens=[1, 1, 1, 1]),
    "blocks-mixed-with-empty": dict(kv_lens=[12, 30, 4], q_lens=[12, 1, 0]),
    "blocks-split-requests": dict(kv_lens=[40, 7, 9, 3], q_lens=[17, 1, 9, 3]),
    # One block of D nodes per request.
    "tree": dict(kv_lens=[5, 14], q_lens=[5, 5], trees=[[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]),
}


def _run(call):
    return CpuBackend().attention(**call.args)


def _assert_dense(call, out):
    a = call.args
    want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    atol, rtol = TOLERANCE[a["q"].dtype]
    assert out.dtype == a["q"].dtype
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_layouts_match_dense(name, dtype):
    call = attention_call(random.Random(name), "cpu", dtype, heads=(6, 2), poison=True, **CASES[name])
    _assert_dense(call, _run(call))


@pytest.mark.parametrize("name", ["blocks-split-requests", "tree"])
def test_one_block_per_chunk_matches_dense(monkeypatch, name):
    """The smallest chunk budget runs the blocks one at a time."""
    monkeypatch.setattr(ref_attention, "CHUNK_BYTES", 1)
    call = attention_call(random.Random(name), "cpu", torch.float32, poison=True, **CASES[name])
    _assert_dense(call, _run(call))


def test_empty_batch_returns_empty():
    call = attention_call(random.Random("empty"), "cpu", torch.float32, kv_lens=[], q_lens=[])
    assert _run(call).shape == (0, 4, 8)


@pytest.mark.parametrize("layout", ["per-request", "blocks", "tree"])
def test_no_host_sync(layout):
    """On the meta device no tensor holds data, so any host read of one would raise."""
    dev = torch.device("meta")
    kv = KVCache(2, 64, 2, 8, device=dev)
    B, N, D = {"per-request": (1, 9, None), "blocks": (5, 7, None), "tree": (2, 8, 4)}[layout]

    def idx(*shape):
        return torch.empty(shape, dtype=torch.int64, device=dev)

    tree_mask = torch.empty(B, D, D, dtype=torch.bool, device=dev) if D else None
    out = CpuBackend(device=dev).attention(torch.empty(N, 6, 8, device=dev), kv, 1, idx(4, 16), idx(B), idx(B),
                                           idx(B), 0.3, tree_mask, 16)
    assert out.shape == (N, 6, 8) and out.device.type == "meta"


def test_one_layout_serves_every_layer():
    """A layout built once gives each layer the result of a call that builds its own."""
    call = attention_call(random.Random("reuse"), "cpu", torch.float32, poison=True, num_layers=3,
                          **CASES["blocks-split-requests"])
    backend, a = CpuBackend(), call.args
    layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                      a["q"].shape[0], a["tree_mask"], a["max_kv_len"])
    for layer in range(3):
        shared = backend.attention(**{**a, "layer": layer}, layout=layout)
        own = backend.attention(**{**a, "layer": layer})
        assert torch.equal(shared, own)


def test_layout_refused_for_other_tensors_or_backends():
    call = attention_call(random.Random("refuse"), "cpu", torch.float32, **CASES["blocks-decode"])
    backend, a = CpuBackend(), call.args
    layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                      a["q"].shape[0], a["tree_mask"], a["max_kv_len"])
    for bad in ({"kv_lens": a["kv_lens"].clone()}, {"q": a["q"][:2].contiguous()}):
        with pytest.raises(ContractError, match="argument 'layout'"):
            backend.attention(**{**a, **bad}, layout=layout)
    with pytest.raises(ContractError, match="argument 'layout'"):
        CpuBackend().attention(**a, layout=layout)
    with pytest.raises(ContractError, match="argument 'layout'"):
        backend.attention(**a, layout="layout")
