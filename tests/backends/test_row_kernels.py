"""The CPU row kernels: the norm with the residual add, and the rotary embedding with the K/V store."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.contract import ContractError
from ngram_hal.engine.config import LlamaConfig
from ngram_hal.kernels.cpu import CpuLayerKernels
from ngram_hal.kv_cache import KVCache
from ngram_hal.model_kernels import TorchLayerKernels
from ngram_hal.reference import CpuBackend

CONFIG = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=2, num_heads=6,
                     num_kv_heads=2, head_dim=16)


def kernel_pair(strict: bool = False) -> tuple[CpuLayerKernels, TorchLayerKernels]:
    backend = CpuBackend(strict=strict)
    return CpuLayerKernels(CONFIG, backend, torch.float32), TorchLayerKernels(CONFIG, backend, torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_norm_matches_torch_and_adds_the_residual(rows, with_delta, with_weight):
    ours, torch_kernels = kernel_pair()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, CONFIG.hidden_size, generator=gen)
    delta = torch.randn(rows, CONFIG.hidden_size, generator=gen) if with_delta else None
    weight = torch.randn(CONFIG.hidden_size, generator=gen) if with_weight else None
    x_ours, x_torch = x.clone(), x.clone()
    got = ours.norm(x_ours, weight, delta)
    want = torch_kernels.norm(x_torch, weight, delta)
    assert torch.equal(x_ours, x_torch), "x += delta in place"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    alone = ours.norm(x_ours[rows // 2:rows // 2 + 1].clone(), weight)
    assert torch.equal(alone, ours.norm(x_ours.clone(), weight)[rows // 2:rows // 2 + 1]), "a row depends on its batch"


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_rope_store_equals_torch_bit_for_bit(rows):
    """The rotated queries and both caches, the scratch row included (a -1 slot and a slot past the
    cache write it, as the reference store does)."""
    ours, torch_kernels = kernel_pair()
    gen = torch.Generator().manual_seed(10 + rows)
    Hq, H, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    qkv = torch.randn(rows, (Hq + 2 * H) * d, generator=gen)
    positions = torch.randint(0, 500, (rows,), generator=gen)
    locs = torch.randperm(32, generator=gen)[:rows]
    locs[rows // 2] = -1
    caches = [KVCache(CONFIG.num_layers, 32, H, d, dtype=torch.float32) for _ in range(2)]
    got = ours.rope_store(ours.rope(positions), qkv, caches[0], 1, locs)
    want = torch_kernels.rope_store(torch_kernels.rope(positions), qkv, caches[1], 1, locs)
    assert torch.equal(got, want)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_strict_mode_stores_through_the_checked_op():
    """In strict mode a slot outside the cache is an error naming it, and nothing is written."""
    ours, _ = kernel_pair(strict=True)
    Hq, H, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    cache = KVCache(CONFIG.num_layers, 8, H, d, dtype=torch.float32)
    with pytest.raises(ContractError, match="locs"):
        ours.rope_store(ours.rope(torch.tensor([0, 1])), torch.randn(2, (Hq + 2 * H) * d), cache, 0,
                        torch.tensor([3, 8]))
    assert not cache.k.any() and not cache.v.any()
