"""The engine-side GPU kernels (``ngram_hal.kernels.gpu``) against the model's torch operations.

Under Triton's interpreter (no CUDA device here) float32 results are compared tightly; bfloat16
ones loosely, since the interpreter rounds float32 to bfloat16 by truncation where a GPU rounds
to nearest. Batch invariance of the product is exact in every dtype on a GPU (see ``numerics``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_invariant

pytest.importorskip("triton")
from ngram_hal.engine.config import LlamaConfig  # noqa: E402
from ngram_hal.model_kernels import apply_rotary, rms_norm as torch_rms_norm, rope_frequencies, rotary  # noqa: E402
from ngram_hal.kernels.gpu.argmax import BLOCK, argmax  # noqa: E402
from ngram_hal.kernels.gpu.matmul import INVARIANT, Tiling, fold_norm, fused_linear, invariant_linear  # noqa: E402
from ngram_hal.kernels.triton.counters import TILE_COUNTERS, tile_counters  # noqa: E402
from ngram_hal.kernels.gpu.norm import rms_norm  # noqa: E402
from ngram_hal.kernels.gpu.rotary import RopeStore, rope_table, rotary_store  # noqa: E402
from ngram_hal.kernels.gpu.swiglu import swiglu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_residual(dtype):
    x, delta, w = _randn(7, 96, dtype=dtype, seed=1), _randn(7, 96, dtype=dtype, seed=2), _randn(96, dtype=dtype, seed=3)
    summed = (x.float() + delta.float()).to(dtype)
    out = rms_norm(x, w, 1e-5, delta)
    torch.testing.assert_close(x.float(), summed.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), torch_rms_norm(summed, w, 1e-5).float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(rms_norm(summed, w, 1e-5).float(), out.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_store(dtype):
    Hq, H, d, S = 6, 2, 16, 9
    qkv = _randn(4, (Hq + 2 * H) * d, dtype=dtype, seed=4)
    positions = torch.tensor([0, 5, 17, 200], device=DEVICE)
    locs = torch.tensor([2, -1, 7, S], device=DEVICE)
    k_cache = torch.zeros(S + 1, H, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Scaled frequencies (Llama 3.1's per-frequency factors), as a GGUF file may state them.
    config = LlamaConfig(vocab_size=8, hidden_size=Hq * d, intermediate_size=8, num_layers=1, num_heads=Hq,
                         num_kv_heads=H, head_dim=d, rope_freq_factors=tuple(1.0 + j for j in range(d // 2)))
    inv_freq = rope_frequencies(config, DEVICE)
    table = rope_table(inv_freq, 64)
    q = rotary_store(qkv, positions, table, k_cache, v_cache, locs, Hq, H)
    clamped = positions.clamp(max=63)
    cos, sin = rotary(clamped, inv_freq, torch.float32)
    want = apply_rotary(qkv[:, :(Hq + H) * d].float().reshape(4, Hq + H, d), cos, sin)
    tol = TOL[dtype]
    torch.testing.assert_close(q.float(), want[:, :Hq], atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache[2].float(), want[0, Hq:], atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache[7].float(), want[2, Hq:], atol=tol, rtol=tol)
    v = qkv[:, (Hq + H) * d:].reshape(4, H, d)
    assert torch.equal(v_cache[2], v[0]) and torch.equal(v_cache[7], v[2])
    untouched = [i for i in range(S + 1) if i not in (2, 7)]
    assert not k_cache[untouched].any() and not v_cache[untouched].any(), "a -1 or out-of-range loc was stored"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype):
    gate_up = _randn(3, 2 * 40, dtype=dtype, seed=5)
    want = F.silu(gate_up[:, :40].float()) * gate_up[:, 40:].float()
    torch.testing.assert_close(swiglu(gate_up).float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_linear(dtype):
    x, w = _randn(37, 100, dtype=dtype, seed=6), _randn(70, 100, dtype=dtype, seed=7)
    out = invariant_linear(x, w)
    want = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    for rows in ([0], [5, 6], list(range(16, 37))):
        sub = invariant_linear(x[rows].contiguous(), w)
        assert_invariant(sub, out[rows], f"rows {rows} computed in a smaller batch")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiling", [INVARIANT, Tiling(16, 16, 64), Tiling(16, 16, 32, split_k=4)],
                         ids=["invariant", "16x16x64", "16x16x32-split4"])
def test_fused_linear_norm_glu_and_residual(dtype, tiling):
    """RMSNorm (its weight folded into the product's) before the product, SwiGLU after a gate/up
    product, the residual add: the values of the separate kernels around the product."""
    M, K, N = 5, 200, 40
    x, w, g = _randn(M, K, dtype=dtype, seed=8), _randn(N, K, dtype=dtype, seed=9), _randn(K, dtype=dtype, seed=10)
    tol = TOL[dtype] * 10
    want = rms_norm(x, g, 1e-5).double() @ w.double().T
    got = fused_linear(x, fold_norm(w, g), norm_eps=1e-5, tiling=tiling)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    gate_up = _randn(2 * N, K, dtype=dtype, seed=11)
    want = swiglu((rms_norm(x, g, 1e-5).double() @ gate_up.double().T).to(dtype)).double()
    got = fused_linear(x, fold_norm(gate_up, g), norm_eps=1e-5, glu=True, tiling=tiling)
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)
    residual = _randn(M, N, dtype=dtype, seed=12)
    before = residual.clone()
    out = fused_linear(x, w, residual=residual, tiling=tiling)
    assert out.data_ptr() == residual.data_ptr(), "the residual is not updated in place"
    torch.testing.assert_close(residual.double(), before.double() + x.double() @ w.double().T, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("glu", [False, True], ids=["norm", "norm-glu"])
def test_fused_norm_rows_are_the_same_in_every_batch_and_unsplit_tiling(glu):
    """The norm's sums of squares come from the product's own walk (the diagonal of x @ x.T): a row
    gives the same bits alone as in a batch, and in every tiling that does not split K whatever its
    tile, steps and warps (what lets the batch-invariant mode take each row count's fastest tiling)."""
    dtype = torch.bfloat16
    x, w, g = _randn(40, 256, dtype=dtype, seed=15), _randn(64, 256, dtype=dtype, seed=16), _randn(256, dtype=dtype,
                                                                                                    seed=17)
    weight = fold_norm(w, g)
    first = Tiling(16, 32, 64)
    out = fused_linear(x, weight, norm_eps=1e-5, glu=glu, tiling=first)
    want = rms_norm(x, g, 1e-5).double() @ w.double().T
    if not glu:
        torch.testing.assert_close(out.double(), want, atol=0.4, rtol=TOL[dtype])
    for rows in ([0], [3, 4], list(range(16, 40))):
        assert_invariant(fused_linear(x[rows].contiguous(), weight, norm_eps=1e-5, glu=glu, tiling=first), out[rows],
                         f"rows {rows} computed in a smaller batch")
    for tiling in (Tiling(16, 16, 256), Tiling(32, 64, 128, 4, 2), Tiling(64, 32, 64, 8, 3)):
        assert_invariant(fused_linear(x, weight, norm_eps=1e-5, glu=glu, tiling=tiling), out, f"tiling {tiling}")


@pytest.mark.parametrize("split_k", [2, 3, 64], ids=lambda s: f"split{s}")
def test_split_k_product_is_deterministic_and_row_invariant(split_k):
    """A split reduction (K = 200 in runs of 32-step blocks: 4 runs of 64, 3 of 96 with the last
    short, and as many runs as blocks where more splits are asked for than there are blocks): the
    product's values, the same bits on a second call, each row's value alone as in the batch, and
    every tile's counter back at zero."""
    dtype = torch.bfloat16
    x, w = _randn(21, 200, dtype=dtype, seed=13), _randn(70, 200, dtype=dtype, seed=14)
    tiling = Tiling(16, 16, 32, split_k=split_k)
    out = fused_linear(x, w, tiling=tiling)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, atol=0.4, rtol=TOL[dtype])
    assert torch.equal(fused_linear(x, w, tiling=tiling), out), "a second call gave other bits"
    for rows in ([0], [3, 4], list(range(16, 21))):
        assert_invariant(fused_linear(x[rows].contiguous(), w, tiling=tiling), out[rows],
                         f"rows {rows} computed in a smaller batch")
    assert not tile_counters(out.device, 1, "test").any(), "a tile's split counter was left set"
    with pytest.raises(ValueError, match=f"test: {TILE_COUNTERS + 1} tiles counted in one launch"):
        tile_counters(out.device, TILE_COUNTERS + 1, "test")


def test_split_tilings_of_the_same_runs_of_k_give_every_row_the_same_bits():
    """Tilings that walk K = 256 in the same four runs of 64 (other tiles, steps, warps and stages):
    each row's result, with the residual add, is the same in every tiling and batch, as the
    batch-invariant mode takes them by row count; one walk over all of K is another sum."""
    dtype = torch.bfloat16
    x, w, res = _randn(40, 256, dtype=dtype, seed=21), _randn(48, 256, dtype=dtype, seed=22), _randn(40, 48, dtype=dtype,
                                                                                                     seed=23)
    first, *others = Tiling(16, 16, 32, split_k=4), Tiling(32, 64, 64, 8, 2, 4), Tiling(16, 32, 64, 4, 9, 4)
    assert {t.k_split(256) for t in (first, *others)} == {64}
    out = fused_linear(x, w, residual=res.clone(), tiling=first)
    torch.testing.assert_close(out.double(), res.double() + x.double() @ w.double().T, atol=0.4, rtol=TOL[dtype])
    for tiling in others:
        for rows in ([0], [3, 4], list(range(16, 40))):
            got = fused_linear(x[rows].contiguous(), w, residual=res[rows].clone(), tiling=tiling)
            assert_invariant(got, out[rows], f"rows {rows} in tiling {tiling.label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 5, 49152], ids=lambda v: f"V{v}")
def test_argmax_is_torchs(dtype, vocab):
    """The lowest index of each row's largest logit, as ``torch.argmax``: ties within and across
    blocks, a row of -inf, a NaN (larger than any number), the maximum in the last partial block."""
    logits = _randn(6, vocab, dtype=dtype, seed=4)
    logits[1, : vocab // 2] = logits[1].max() + 1
    logits[2, [0, vocab - 1]] = torch.inf
    logits[3] = -torch.inf
    logits[4, vocab // 3] = torch.nan
    logits[5, -1] = logits[5].max() + 1
    assert torch.equal(argmax(logits).cpu(), logits.argmax(-1).cpu())
    assert argmax(logits[:0]).shape == (0,)


def test_wrappers_refuse_bad_shapes():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(x, torch.zeros(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="fused_linear: need contiguous x"):
        invariant_linear(x, torch.zeros(3, 9, device=DEVICE))
    w = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="fused_linear: need contiguous x"):
        fused_linear(x, w, glu=True)
    with pytest.raises(ValueError, match="fused_linear: residual must be"):
        fused_linear(x, w, residual=torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="argmax: need contiguous float logits"):
        argmax(x.t())
    with pytest.raises(ValueError, match="argmax: the vocabulary must hold"):
        argmax(torch.zeros(2, 0, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiling", [INVARIANT, Tiling(16, 16, 64), Tiling(16, 64, 32), Tiling(16, 32, 32, split_k=3)],
                         ids=["invariant", "16x16x64", "16x64x32", "16x32x32-split3"])
def test_fused_qkv_product_rotates_and_stores_as_the_rotary_kernel(dtype, tiling):
    """The QKV product with ``rope``: the queries it returns and the K/V it writes are what the
    rotary kernel makes of the product's output in the tiling of the same program shape (a program
    of the rotating product takes ``max(16, block_n / 2)`` column pairs): bit for bit where the
    kernels compile (``numerics``); rows with a slot of -1 or outside the cache store nothing, and
    no other slot is touched."""
    Hq, H, d, S, K = 6, 2, 16, 9, 80
    M = 5
    x = _randn(M, K, dtype=dtype, seed=15)
    w = fold_norm(_randn((Hq + 2 * H) * d, K, dtype=dtype, seed=16), _randn(K, dtype=dtype, seed=17))
    positions = torch.tensor([0, 5, 17, 200, 3], device=DEVICE)
    locs = torch.tensor([2, -1, 7, S, 0], device=DEVICE)
    config = LlamaConfig(vocab_size=8, hidden_size=K, intermediate_size=8, num_layers=1, num_heads=Hq,
                         num_kv_heads=H, head_dim=d)
    table = rope_table(rope_frequencies(config, DEVICE), 64)
    caches = [tuple(torch.zeros(S + 1, H, d, dtype=dtype, device=DEVICE) for _ in "KV") for _ in range(2)]
    qkv = fused_linear(x, w, norm_eps=1e-5, tiling=Tiling(tiling.block_m, max(16, tiling.block_n // 2), *tiling[2:]))
    want = rotary_store(qkv, positions, table, *caches[0], locs, Hq, H)
    got = fused_linear(x, w, norm_eps=1e-5, tiling=tiling,
                       rope=RopeStore(positions, table, *caches[1], locs, Hq, H))
    assert got.shape == (M, Hq, d) and got.dtype == dtype
    assert_invariant(got, want, "the rotated queries against the rotary kernel's")
    for name, mine, theirs in zip("KV", caches[1], caches[0]):
        assert_invariant(mine, theirs, f"the {name} cache against the rotary kernel's")
    untouched = [i for i in range(S + 1) if i not in (0, 2, 7)]
    assert not any(c[untouched].any() for c in caches[1]), "a -1 or out-of-range slot was stored"


def test_fused_qkv_product_refuses_a_layout_that_does_not_fit():
    Hq, H, d = 6, 2, 16
    x, w = _randn(3, 32, dtype=torch.float32, seed=18), _randn((Hq + 2 * H) * d - 2, 32, dtype=torch.float32, seed=19)
    cache = torch.zeros(4, H, d, device=DEVICE)
    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=Hq,
                         num_kv_heads=H, head_dim=d)
    rope = RopeStore(torch.zeros(3, dtype=torch.int64, device=DEVICE), rope_table(rope_frequencies(config, DEVICE), 8),
                     cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE), Hq, H)
    wrong_width = r"fused_linear: qkv must have 160 columns \(6 \+ 2 x 2 heads of 16\), got 158"
    with pytest.raises(ValueError, match=wrong_width):
        fused_linear(x, w, rope=rope)
    with pytest.raises(ValueError, match=r"fused_linear: positions must be int64\[2\]"):
        fused_linear(x[:2].contiguous(), _randn(160, 32, dtype=torch.float32, seed=20), rope=rope)
