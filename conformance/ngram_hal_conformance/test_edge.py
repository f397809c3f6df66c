"""Edge-value tier, for every KV dtype the backend lists: values at the ends of the dtype's range.

* ``store_kv`` and ``move_kv`` copy rows that hold the dtype's smallest and largest subnormals,
  signed zeros, its smallest normal and largest finite values, infinities and NaN, bit for bit.
* ``attention``, against dense attention in float64:

  - scores of several hundred (``exp`` overflows float32 past 88.7, and half types far
    sooner): a softmax that does not subtract the running maximum gives inf or NaN;
  - queries and keys so large that their dot products pass the input dtype's largest value where
    that dtype is narrower than float32 (float16), and of magnitude ``2**40`` otherwise: a kernel that
    accumulates scores in the input dtype overflows;
  - values of magnitude ``min(max / 2, 2**64)``, with a tolerance relative to that magnitude;
  - float16 values in float16's subnormal range (about 6e-8 to 6e-5), with a tolerance relative
    to the largest value: a kernel that flushes them to zero is off by 100 % of them. Subnormals
    of bfloat16 and float32 (below 1.2e-38) are not checked in attention: flushing them changes
    an output by less than that.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ngram_hal.kv_cache import KVCache

from . import cases, oracle
from . import test_kv as kv_cases
from .checks import assert_bitwise, host, slots
from .test_attention import attention_call
from .test_scale import check_attention

conformance = pytest.mark.conformance
FLOAT32_MAX = torch.finfo(torch.float32).max


each_dtype = pytest.mark.parametrize(
    "kv_dtype", [pytest.param(d, id=str(d).removeprefix("torch.")) for d in KVCache.DTYPES])
"""Parametrizes a test by every KV dtype of the contract; :func:`_listed` skips those the backend
does not list."""


def _listed(backend, dtype: torch.dtype) -> torch.dtype:
    listed = backend.capabilities().kv_dtypes
    if str(dtype).removeprefix("torch.") not in listed:
        pytest.skip(f"the backend lists KV dtypes {listed}")
    return dtype


def special_values(dtype: torch.dtype) -> list[float]:
    """The dtype's range ends, each exactly representable in it: smallest and largest subnormal,
    smallest normal and largest finite values (both signs), signed zeros, infinities, NaN, 1."""
    info = torch.finfo(dtype)
    smallest = info.tiny * info.eps
    ends = [smallest, info.tiny - smallest, info.tiny, info.max, 0.0, math.inf]
    return [*ends, *(-x for x in ends), math.nan, 1.0]


def special_rows(rng: random.Random, device, n: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """float[n, heads, head_dim] of ``dtype`` whose entries are the special values in random order."""
    values = special_values(dtype)
    flat = [values[rng.randrange(len(values))] for _ in range(n * heads * head_dim)]
    return torch.tensor(flat, dtype=torch.float64).view(n, heads, head_dim).to(dtype).to(device)


@conformance(op="store_kv", tier="edge")
@each_dtype
def test_store_kv_keeps_special_values(backend, device, kv_dtype):
    _listed(backend, kv_dtype)
    rng = random.Random(f"store-{kv_dtype}")
    kv = cases.random_kv(rng, device, 2, 24, 2, 8, kv_dtype)
    locs = rng.sample(range(24), 16)
    k, v = (special_rows(rng, device, 16, 2, 8, kv_dtype) for _ in range(2))
    want_k = oracle.store_kv(host(kv.k), 1, locs, host(k))
    want_v = oracle.store_kv(host(kv.v), 1, locs, host(v))
    backend.store_kv(kv, 1, cases.index(locs, device), k, v)
    assert_bitwise(slots(kv.k, 24), slots(want_k, 24), f"K rows of special {kv_dtype} values")
    assert_bitwise(slots(kv.v, 24), slots(want_v, 24), f"V rows of special {kv_dtype} values")


@conformance(op="move_kv", tier="edge")
@each_dtype
def test_move_kv_keeps_special_values(backend, device, kv_dtype):
    _listed(backend, kv_dtype)
    rng = random.Random(f"move-{kv_dtype}")
    kv = cases.random_kv(rng, device, 2, 24, 2, 8, kv_dtype)
    kv.k[:, :24] = special_rows(rng, device, 48, 2, 8, kv_dtype).view(2, 24, 2, 8)
    kv.v[:, :24] = special_rows(rng, device, 48, 2, 8, kv_dtype).view(2, 24, 2, 8)
    call = kv_cases.move_kv_call(rng, device, kv, 16, "cycle")
    src, dst = call.args["src"].tolist(), call.args["dst"].tolist()
    want_k, want_v = oracle.move_kv(host(kv.k), src, dst), oracle.move_kv(host(kv.v), src, dst)
    backend.move_kv(**call.args)
    assert_bitwise(slots(kv.k, 24), slots(want_k, 24), f"K after moving special {kv_dtype} values")
    assert_bitwise(slots(kv.v, 24), slots(want_v, 24), f"V after moving special {kv_dtype} values")


# ---------------------------------------------------------------- attention

def _call(seed: str, device, dtype: torch.dtype, tree: bool = False) -> cases.Call:
    """A decode, an extend and (``tree``) a tree-verify batch over a few dozen keys, d = 16."""
    rng = random.Random(seed)
    if tree:
        return attention_call(rng, device, dtype, kv_lens=[30, 9], q_lens=[4, 4], heads=(4, 2), head_dim=16,
                              trees=[[-1, 0, 0, 1], [-1, 0, 1, 2]])
    return attention_call(rng, device, dtype, kv_lens=[40, 7, 23], q_lens=[1, 7, 5], heads=(4, 2), head_dim=16)


def _scaled(call: cases.Call, q: float = 1.0, k: float = 1.0, v: float = 1.0, sm_scale: float | None = None,
            positive: bool = False) -> cases.Call:
    """``call`` with q, K and V multiplied by the given factors (computed in float64, then rounded
    to the dtype once; ``positive``: q and K made positive first, so that dot products add up)
    and another ``sm_scale``."""
    a = call.args
    sign = torch.abs if positive else (lambda t: t)
    kv = cases.clone_kv(a["kv"])
    kv.k.copy_((sign(a["kv"].k.double()) * k).to(kv.dtype))
    kv.v.copy_((a["kv"].v.double() * v).to(kv.dtype))
    new_q = (sign(a["q"].double()) * q).to(a["q"].dtype)
    return call.replace(q=new_q, kv=kv, sm_scale=a["sm_scale"] if sm_scale is None else sm_scale)


@conformance(op="attention", tier="edge")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@each_dtype
def test_attention_scores_past_exp_overflow(backend, device, kv_dtype, tree):
    """Query and key entries of about 14 and sm_scale 1/4 give scores of several hundred."""
    _listed(backend, kv_dtype)
    call = _scaled(_call("overflow", device, kv_dtype, tree), q=14.0, k=14.0, sm_scale=0.25)
    check_attention(backend, call, f"scores of several hundred, {kv_dtype}")


@conformance(op="attention", tier="edge")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@each_dtype
def test_attention_dot_products_past_the_dtype(backend, device, kv_dtype, tree):
    """Positive query and key entries of magnitude about a, with a**2 * d four times the dtype's
    largest value where that fits in float32 (float16: most dot products pass 65504), else
    a = 2**40; sm_scale brings the scores back to a few hundred."""
    _listed(backend, kv_dtype)
    d = 16
    info = torch.finfo(kv_dtype)
    a = math.sqrt(4 * info.max / d) if info.max < FLOAT32_MAX / 2 ** 64 else 2.0 ** 40
    call = _scaled(_call("magnitude", device, kv_dtype, tree), q=a, k=a, sm_scale=300 / (a * a * d), positive=True)
    check_attention(backend, call, f"dot products of magnitude {a * a * d:.3g}, {kv_dtype}")


@conformance(op="attention", tier="edge")
@each_dtype
def test_attention_large_values(backend, device, kv_dtype):
    """V entries of random sign and magnitude up to about min(max / 2, 2**64)."""
    _listed(backend, kv_dtype)
    big = min(torch.finfo(kv_dtype).max / 2, 2.0 ** 64)
    call = _scaled(_call("large-v", device, kv_dtype), v=big / 4)
    check_attention(backend, call, f"values of magnitude {big:.3g}, {kv_dtype}",
                    magnitude=float(call.args["kv"].v.abs().max()))


@conformance(op="attention", tier="edge")
def test_attention_float16_subnormal_values(backend, device):
    """V entries between float16's smallest subnormal and its smallest normal value."""
    if "float16" not in backend.capabilities().kv_dtypes:
        pytest.skip("the backend does not list float16")
    call = _call("subnormal-v", device, torch.float16)
    tiny = torch.finfo(torch.float16).tiny
    call = _scaled(call, v=tiny / 4)
    v = call.args["kv"].v
    assert bool(((v.abs() < tiny) & (v != 0)).any()), "the case holds no subnormal value"
    check_attention(backend, call, "float16 subnormal values", magnitude=float(v.abs().max()))
