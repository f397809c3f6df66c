"""The row-wise layer kernels of a CPU decode step, compiled for float32 (numba).

A decode step has one row a request (a few per request in a verify step), and each layer runs a
norm with the residual add twice, and the rotary embedding with the K/V store once. As torch ops
on so few rows each costs a few dispatches of several microseconds, far more than its arithmetic;
here each is one call:

* :func:`add_rms_norm`: ``x += delta`` and ``weight * x / sqrt(mean(x * x) + eps)``, one pass a row;
* :func:`rope_store`: the rotary embedding of the new queries and keys ("rotate half": pairs ``i``
  and ``i + d/2``) and the keys and values written to their cache rows, one pass a row, with the
  products and sums of :func:`~ngram_hal.model_kernels.apply_rotary` (no fused multiply-adds), so
  its outputs are torch's bit for bit.

Each row is computed alone, in the same order whatever the other rows, so its result does not
depend on the batch.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit


@njit(cache=True, fastmath=True, boundscheck=False)
def _add_norm(x, delta, weight, eps, out, add, scale):
    """Row by row: ``x += delta`` when ``add``, then ``out = x * rsqrt(mean(x * x) + eps)``, times
    ``weight`` when ``scale``."""
    N, K = x.shape
    for n in range(N):
        row = x[n]
        if add:
            d = delta[n]
            for j in range(K):
                row[j] += d[j]
        total = np.float32(0.0)
        for j in range(K):
            total += row[j] * row[j]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(K) + eps)
        o = out[n]
        if scale:
            for j in range(K):
                o[j] = weight[j] * (row[j] * inv)
        else:
            for j in range(K):
                o[j] = row[j] * inv


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    """``x += delta`` in place (when given), then ``weight * rmsnorm(x)`` (``rmsnorm(x)`` for a weight
    of None). x, delta: contiguous float32[N, K] on the CPU; weight float32[K]. Returns float32[N, K]."""
    out = torch.empty_like(x)
    _add_norm(x.numpy(), _NO_ROWS if delta is None else delta.contiguous().numpy(),
              _NO_ROWS[0:0, 0] if weight is None else weight.contiguous().numpy(), np.float32(eps), out.numpy(),
              delta is not None, weight is not None)
    return out


_NO_ROWS = np.empty((0, 1), np.float32)
"""What the kernel gets for a delta or weight it does not read (its types need an array)."""


@njit(cache=True, boundscheck=False)
def _rope_store(qkv, cos, sin, k_cache, v_cache, locs, num_heads, num_kv_heads, q):
    """Row by row: the query heads of ``qkv`` rotated into ``q``, the key heads rotated into
    ``k_cache[row]`` and the value heads copied into ``v_cache[row]``, ``row = locs[n]`` where it
    lies in ``[0, S)``, else the scratch row ``S``."""
    N, d = qkv.shape[0], q.shape[2]
    half = d // 2
    S = k_cache.shape[0] - 1
    for n in range(N):
        row = locs[n]
        if row < 0 or row >= S:
            row = S
        c, s = cos[n], sin[n]
        for h in range(num_heads + num_kv_heads):
            x = qkv[n, h * d:(h + 1) * d]
            out = q[n, h] if h < num_heads else k_cache[row, h - num_heads]
            for j in range(half):
                out[j] = x[j] * c[j] + (-x[j + half]) * s[j]
            for j in range(half, d):
                out[j] = x[j] * c[j] + x[j - half] * s[j]
        base = (num_heads + num_kv_heads) * d
        for h in range(num_kv_heads):
            for j in range(d):
                v_cache[row, h, j] = qkv[n, base + h * d + j]


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, locs: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate the new tokens' queries and keys and store their keys and values; returns q.

    Args:
        qkv: float32[N, (Hq + 2H) * d], the fused projection's output (queries, keys, values).
        cos, sin: float32[N, 1, d] (:func:`~ngram_hal.model_kernels.rotary`).
        k_cache, v_cache: float32[S + 1, H, d], one layer of the cache (row S: the scratch row).
        locs: int64[N], each token's cache row; -1 (or any row outside ``[0, S)``) writes the
            scratch row.
    Returns:
        float32[N, Hq, d], the rotated queries.
    """
    N = qkv.shape[0]
    d = k_cache.shape[2]
    q = torch.empty(N, num_heads, d, dtype=torch.float32)
    _rope_store(qkv.contiguous().numpy(), cos.reshape(N, d).contiguous().numpy(),
                sin.reshape(N, d).contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), locs.numpy(),
                num_heads, num_kv_heads, q.numpy())
    return q
