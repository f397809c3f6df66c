"""Attention of decode queries over the paged cache, compiled for float32 on the CPU (numba).

A decode step has one query a request. Through torch, the reference gathers each block's keys and
values into a copy (``index_select``) and runs a masked ``scaled_dot_product_attention`` on it:
for one query over a few hundred keys the copies and the dispatches cost more than the
arithmetic. :func:`attend` takes the same blocks (see :mod:`ngram_hal.reference.attention`) and
reads each key and value where it lies in the cache.

For each block and KV head: the scores of every query head of the group (grouped-query attention)
and every query of the block against each key a query of the block sees, in column order; per
query head, the largest score it sees, the exponentials (:func:`_exp`) and their sum; the values
weighted by them, in column order; the sum divided out. A query that sees no key gives zeros.
Each query is computed alone, in the same order whatever else shares the call, so its result does
not depend on the batch. The serial build (one thread) and the parallel one are compiled apart:
their vectorized dot products may sum in another order, so bits are the same across batches at
one thread count, not promised across thread counts.

Measured on the 2-core CPU, one thread, 9 query heads over 3 KV heads of 64 (``python
bench/bench_cpu_attention.py``): the kernel wins for one query a block and loses from three or
four, where torch's products over the gathered keys share each key's load among the queries; so
the reference runs blocks of :data:`KERNEL_QUERIES` query through it (decode steps, and every
block of a batch-invariant layout, which torch's batched products may round otherwise from one
block count to another), and verify and prefill blocks through torch.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .panel_linear import on_torch_threads

KERNEL_QUERIES = 1
"""The most queries a block may have to run through :func:`attend` (see the module docstring)."""

_LOWEST = np.float32(-3.4e38)


@njit(inline="always", fastmath=True, boundscheck=False)
def _exp(x):
    """``exp(x)`` of a float32 ``x <= 0`` (0 below -87): ``2**n * p(r)``, ``r = x - n*ln 2`` in two
    parts and p the degree-7 polynomial of Cephes' ``expf`` (within about 2 ulp); plain arithmetic,
    so the compiler vectorizes a loop of them."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.float32(2.0) ** n


@njit(inline="always", fastmath=True, boundscheck=False)
def _seen(mask, g, t):
    """Whether a query of block g sees key column t."""
    for i in range(mask.shape[1]):
        if mask[g, i, t]:
            return True
    return False


@njit(inline="always", fastmath=True, boundscheck=False)
def _attend_head(q, k, v, rows, mask, scale, out, g, h, qh, scores, acc):
    """Block g, KV head h: ``out[g, i, hq]`` for every query i and query head hq of the group.
    Scratch: qh float32[A, d], scores float32[A, T], acc float32[A, d] (A = queries x group)."""
    Bq, Hq, d = q.shape[1], q.shape[2], q.shape[3]
    T = rows.shape[1]
    group = Hq // k.shape[1]
    A = Bq * group
    for a in range(A):
        for x in range(d):
            qh[a, x] = q[g, a // group, h * group + a % group, x] * scale
            acc[a, x] = 0.0
    for t in range(T):
        if _seen(mask, g, t):
            key = k[rows[g, t], h]
            for a in range(A):
                s = np.float32(0.0)
                for x in range(d):
                    s += qh[a, x] * key[x]
                scores[a, t] = s
        else:
            for a in range(A):
                scores[a, t] = 0.0
    for a in range(A):
        i = a // group
        top = _LOWEST
        for t in range(T):
            if mask[g, i, t]:
                top = max(top, scores[a, t])
        for t in range(T):
            scores[a, t] = _exp(scores[a, t] - top) if mask[g, i, t] else np.float32(0.0)
    for t in range(T):
        if _seen(mask, g, t):
            value = v[rows[g, t], h]
            for a in range(A):
                p = scores[a, t]
                for x in range(d):
                    acc[a, x] += p * value[x]
    for a in range(A):
        total = np.float32(0.0)
        for t in range(T):
            total += scores[a, t]
        o = out[g, a // group, h * group + a % group]
        for x in range(d):
            o[x] = acc[a, x] / total if total > 0 else np.float32(0.0)


@njit(cache=True, fastmath=True, boundscheck=False)
def _attend(q, k, v, rows, mask, scale, out):
    """Every block and KV head on the calling thread."""
    G, Bq, Hq, d = q.shape
    H, T = k.shape[1], rows.shape[1]
    A = Bq * (Hq // H)
    qh, scores, acc = np.empty((A, d), np.float32), np.empty((A, T), np.float32), np.empty((A, d), np.float32)
    for g in range(G):
        for h in range(H):
            _attend_head(q, k, v, rows, mask, scale, out, g, h, qh, scores, acc)


@njit(cache=True, fastmath=True, boundscheck=False, parallel=True)
def _attend_parallel(q, k, v, rows, mask, scale, out):
    """:func:`_attend` with the (block, KV head) pairs split among numba's threads."""
    G, Bq, Hq, d = q.shape
    H, T = k.shape[1], rows.shape[1]
    A = Bq * (Hq // H)
    for w in prange(G * H):
        qh, scores, acc = np.empty((A, d), np.float32), np.empty((A, T), np.float32), np.empty((A, d), np.float32)
        _attend_head(q, k, v, rows, mask, scale, out, w // H, w % H, qh, scores, acc)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
           sm_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Masked grouped-query attention of G blocks of Bq queries over keys read in place.

    Args:
        q: float32[G, Bq, Hq, d]. k, v: float32[S, H, d], one layer of the cache (contiguous).
        rows: int64[G, T], the cache row of each block's key column (any value where no query of
            the block sees that column; one a query sees must lie in [0, S)).
        mask: bool[G, Bq, T], which key columns each query sees.
        out: where to write (contiguous float32[G, Bq, Hq, d]); a new tensor when None.
    Returns:
        ``out``: float32[G, Bq, Hq, d]; zeros for a query that sees no key.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    on_torch_threads(_attend, _attend_parallel)(q.contiguous().numpy(), k.numpy(), v.numpy(), rows.contiguous().numpy(),
                                                mask.contiguous().numpy(), np.float32(sm_scale), out.numpy())
    return out
