"""Model tier: the per-layer kernels the engine runs on the backend (its fused norm, rotary with
the K/V store, SwiGLU, the products for few rows, the device drafter's prompt lookup) against the
plain-torch implementation on the same device, which is their oracle.

The kernels are the ones the backend gives the model (:meth:`Backend.layer_kernels
<ngram_hal.backend.Backend.layer_kernels>`), in the dtype the engine runs on its device (float32
on a CPU, bfloat16 on an accelerator); on a backend that keeps the default (plain torch) the
tier compares torch with itself and passes by construction. Results agree within :data:`TOLERANCE` of the dtype; the K/V a
rotary kernel stores equals, within the same tolerance, what the oracle stores through the
backend's ``store_kv``, and it writes no other slot or layer; the lookup's chains and token table
are exact.
"""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.kv_cache import KVCache
from ngram_hal.model_kernels import TorchLayerKernels, default_dtype
from ngram_hal.speculative.lookup import DeviceDrafter, active_nodes, record_and_draft
from ngram_hal.speculative.relay import OverlapRelay

from .checks import host

conformance = pytest.mark.conformance(op=None, tier="model")
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None,
                     max_position_embeddings=512)
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
"""(atol, rtol) by dtype: the kernels may sum in another order than torch, never differently."""
ROWS = [1, 3, 40]
"""Rows per call: one decode row, a few, and more than a fused product takes."""


def _pair(backend):
    """(the backend's kernels, the torch oracle on the same backend, dtype)."""
    dtype = default_dtype(backend.device)
    return backend.layer_kernels(CONFIG, dtype), TorchLayerKernels(CONFIG, backend, dtype), dtype


def _linear(kernels, weight: torch.Tensor):
    """The linear layer the model would build for ``weight`` beside ``kernels``."""
    return kernels.linear(weight)


def _randn(gen: torch.Generator, *shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    atol, rtol = TOLERANCE[dtype]
    a, b = host(got).double(), host(want).double()
    bad = ~torch.isclose(a, b, atol=atol, rtol=rtol)
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} values off the torch oracle, first at "
                             f"{at}: {a[at].item():.6g} against {b[at].item():.6g}")


@conformance
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "residual"])
def test_norm_matches_torch(backend, rows, with_delta):
    """``norm(x, weight, delta)``: ``x += delta`` in place, then RMSNorm times the weight."""
    kernels, oracle, dtype = _pair(backend)
    gen = torch.Generator().manual_seed(rows)
    dev, H = backend.device, CONFIG.hidden_size
    x = _randn(gen, rows, H, dtype=dtype, device=dev)
    weight = _randn(gen, H, dtype=dtype, device=dev, scale=0.1) + 1
    delta = _randn(gen, rows, H, dtype=dtype, device=dev) if with_delta else None
    x_got, x_want = x.clone(), x.clone()
    _close(kernels.norm(x_got, weight, delta), oracle.norm(x_want, weight, delta), dtype, "norm")
    _close(x_got, x_want, dtype, "the residual stream after norm (x += delta)")


@conformance
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_and_kv_store_match_torch(backend, rows):
    """``rope_store``: the rotated queries, and K/V written to exactly the listed slots of the
    layer (-1 skipped), as the oracle writes them through ``store_kv``."""
    kernels, oracle, dtype = _pair(backend)
    gen = torch.Generator().manual_seed(100 + rows)
    dev, cfg = backend.device, CONFIG
    Hq, H, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    num_slots = 64
    positions = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen).to(dev)
    qkv = _randn(gen, rows, (Hq + 2 * H) * d, dtype=dtype, device=dev)
    locs = torch.randperm(num_slots, generator=gen)[:rows]
    locs[rows // 2] = -1  # a padding row stores nothing
    locs = locs.to(dev)
    caches = [KVCache(cfg.num_layers, num_slots, H, d, dtype=dtype, device=dev) for _ in range(2)]
    q_got = kernels.rope_store(kernels.rope(positions), qkv, caches[0], 1, locs)
    q_want = oracle.rope_store(oracle.rope(positions), qkv, caches[1], 1, locs)
    _close(q_got, q_want, dtype, "rotated queries")
    for name in ("k", "v"):
        _close(getattr(caches[0], name), getattr(caches[1], name), dtype, f"the {name.upper()} cache after rope_store")


@conformance
@pytest.mark.parametrize("rows", ROWS)
def test_qkv_step_matches_torch(backend, rows):
    """``norm_rope_store``, a layer's QKV step as the model runs it (the norm weight kept the way
    the kernels keep it, ``fold_norm``): the rotated queries, and K/V written to exactly the listed
    slots of the layer (-1 skipped), as the oracle's ``norm_linear`` then
    ``rope_store`` give them."""
    kernels, oracle, dtype = _pair(backend)
    gen = torch.Generator().manual_seed(150 + rows)
    dev, cfg = backend.device, CONFIG
    Hq, H, d, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    num_slots = 64
    norm = _randn(gen, Hd, dtype=dtype, device=dev, scale=0.1) + 1
    weight = _randn(gen, (Hq + 2 * H) * d, Hd, dtype=dtype, device=dev, scale=Hd ** -0.5)
    x = _randn(gen, rows, Hd, dtype=dtype, device=dev)
    positions = torch.randint(0, cfg.max_position_embeddings, (rows,), generator=gen).to(dev)
    locs = torch.randperm(num_slots, generator=gen)[:rows]
    locs[rows // 2] = -1  # a padding row stores nothing
    locs = locs.to(dev)
    caches = [KVCache(cfg.num_layers, num_slots, H, d, dtype=dtype, device=dev) for _ in range(2)]
    mine_norm, mine_weight = kernels.fold_norm(norm, weight)
    q_got = kernels.norm_rope_store(x.clone(), mine_norm, _linear(kernels, mine_weight), kernels.rope(positions),
                                    caches[0], 1, locs)
    q_want = oracle.norm_rope_store(x.clone(), norm, _linear(oracle, weight), oracle.rope(positions), caches[1], 1,
                                    locs)
    _close(q_got, q_want, dtype, "rotated queries")
    for name in ("k", "v"):
        _close(getattr(caches[0], name), getattr(caches[1], name), dtype,
               f"the {name.upper()} cache after norm_rope_store")


@conformance
@pytest.mark.parametrize("rows", ROWS)
def test_swiglu_matches_torch(backend, rows):
    kernels, oracle, dtype = _pair(backend)
    gen = torch.Generator().manual_seed(200 + rows)
    gate_up = _randn(gen, rows, 2 * CONFIG.intermediate_size, dtype=dtype, device=backend.device)
    _close(kernels.swiglu(gate_up), oracle.swiglu(gate_up), dtype, "swiglu")


@conformance
@pytest.mark.parametrize("rows", ROWS)
def test_products_match_torch(backend, rows):
    """The products around the norms as a layer runs them, each norm weight kept the way the
    kernels keep it (``fold_norm``): ``norm_linear`` (QKV), ``norm_swiglu`` (gate/up), and
    ``linear_add`` (down: added to the residual stream, at once or as the next norm's delta)."""
    kernels, oracle, dtype = _pair(backend)
    gen = torch.Generator().manual_seed(300 + rows)
    dev, cfg = backend.device, CONFIG
    Hd, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    norm = _randn(gen, Hd, dtype=dtype, device=dev, scale=0.1) + 1
    x = _randn(gen, rows, Hd, dtype=dtype, device=dev)
    for what, out, call in (("norm_linear", qkv_out, "norm_linear"), ("norm_swiglu", 2 * inter, "norm_swiglu")):
        weight = _randn(gen, out, Hd, dtype=dtype, device=dev, scale=Hd ** -0.5)
        mine_norm, mine_weight = kernels.fold_norm(norm, weight)
        got = getattr(kernels, call)(x.clone(), mine_norm, _linear(kernels, mine_weight))
        want = getattr(oracle, call)(x.clone(), norm, _linear(oracle, weight))
        _close(got, want, dtype, what)
    down = _randn(gen, Hd, inter, dtype=dtype, device=dev, scale=inter ** -0.5)
    y = _randn(gen, rows, inter, dtype=dtype, device=dev)
    stream_got, stream_want = x.clone(), x.clone()
    pending = kernels.linear_add(y, _linear(kernels, down), stream_got)
    if pending is not None:
        stream_got += pending
    stream_want += oracle.linear_add(y, _linear(oracle, down), stream_want)
    _close(stream_got, stream_want, dtype, "the residual stream after linear_add")


@conformance
@pytest.mark.parametrize("tree_size", [1, 8])
def test_device_lookup_matches_torch(backend, tree_size):
    """The device drafter on the backend records a step's tokens and drafts the chains that
    :func:`ngram_hal.speculative.lookup.record_and_draft` (plain torch) gives: table and chains exact."""
    dev = backend.device
    gen = torch.Generator().manual_seed(400 + tree_size)
    R, W, B = 4, 96, 3
    drafter = DeviceDrafter(backend, R, W, tree_size=max(tree_size, 1))
    base = torch.randint(0, 20, (9,), generator=gen).tolist()
    prompts = [base * 4, base[:4] * 5, torch.randint(0, 20, (30,), generator=gen).tolist()]
    rows = torch.tensor([2, 0, 3], dtype=torch.int64, device=dev)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
    drafter.add_prompts(rows, lens, torch.tensor(sum(prompts, []), dtype=torch.int64, device=dev))
    table = drafter.table.clone()
    D = 4  # the step that committed these tokens ran trees of 4 nodes
    accept_lens = torch.tensor([3, 1, 4], dtype=torch.int64, device=dev)
    accept_tokens = torch.tensor([base[0], base[1], base[2], -1, 7, -1, -1, -1, 1, 2, 3, 4], dtype=torch.int64,
                                 device=dev)
    relay = OverlapRelay(accept_tokens, accept_lens, lens + accept_lens, D)
    got, active = drafter.draft(rows, relay, tree_size)
    match = torch.empty(B, dtype=torch.int64, device=dev)
    want = record_and_draft(table, rows, accept_tokens, accept_lens, lens + accept_lens, tree_size, drafter.max_ngram,
                            drafter.min_ngram, match=match)
    assert host(drafter.table).equal(host(table)), "the token table after recording differs from torch's"
    assert host(got).equal(host(want)), (f"chains {host(got).view(B, tree_size).tolist()}, "
                                         f"torch {host(want).view(B, tree_size).tolist()}")
    assert host(active).equal(host(active_nodes(match, tree_size))), (
        f"active nodes {host(active).tolist()}, torch {host(active_nodes(match, tree_size)).tolist()}")
