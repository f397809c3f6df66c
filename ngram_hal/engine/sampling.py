"""Batched sampling: target distributions per tree node, random numbers by position, inverse CDF.

The random number behind the token a request commits at position ``p`` is
:func:`positional_uniforms` of the request's seed (``SamplingParams.seed``, else one drawn from
the engine's seed) and ``p``, computed on the device by a counter-based hash. A seeded request
therefore commits the same tokens whatever the tree sizes, drafts, batch or timing of its steps:
a verify step samples the target's token after every tree node with the number of the position
that token would take, and accepts a draft exactly when it equals that sample (verify against the
sampled tokens), which is the same token plain decoding draws there. The committed tokens are
distributed as the target (each is an inverse-CDF draw with its own uniform).

A row's draw does not depend on the other rows of its call: the distributions come from a
row-wise softmax, and the cumulative sums (of the draw, and of top-p's filter) are integer sums
of fixed-point probabilities (:func:`fixed_point`), exact in any order. (A float
``torch.cumsum`` on CUDA adds in an order that depends on the tensor's shape, so a plain decoding
step of one request and a verify step of many would round the same row differently.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import SamplingParams


class SamplingBatch:
    """The sampling parameters of B requests as device tensors, each repeated for its ``rows`` rows.

    Args:
        params: one :class:`SamplingParams` per request.
        rows: logits rows per request (D for a verify step, 1 for a prefill).
        upload: turns a host tensor into a device tensor without a host sync.
    """

    def __init__(self, params: Sequence[SamplingParams], rows: int, upload):
        self.all_greedy = all(p.greedy for p in params)
        self.use_top_k = any(p.top_k > 0 and not p.greedy for p in params)
        self.use_top_p = any(p.top_p < 1.0 and not p.greedy for p in params)
        if self.all_greedy:
            return

        def expand(values, dtype):
            return upload(torch.tensor(values, dtype=dtype).repeat_interleave(rows))

        self.greedy = expand([p.greedy for p in params], torch.bool)
        self.temperature = expand([p.temperature if not p.greedy else 1.0 for p in params], torch.float32)
        if self.use_top_k:
            self.top_k = expand([p.top_k for p in params], torch.int64)
        if self.use_top_p:
            self.top_p = expand([p.top_p for p in params], torch.float32)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32[N, V] target distributions: temperature, top-k, top-p; one-hot argmax for greedy rows."""
        logits = logits.float() / self.temperature.unsqueeze(1)
        if self.use_top_k or self.use_top_p:
            logits = self._filter(logits)
        probs = torch.softmax(logits, dim=-1)
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(self.greedy.unsqueeze(1), onehot, probs)

    def _filter(self, logits: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if self.use_top_k:
            rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
            k = torch.where(self.top_k > 0, self.top_k, logits.shape[1]).unsqueeze(1)
            drop |= rank >= k
        if self.use_top_p:
            weights = fixed_point(torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1))
            cdf = weights.cumsum(-1)
            drop |= (cdf - weights).double() >= self.top_p.double().unsqueeze(1) * cdf[:, -1:].double()
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX = (_int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical (unsigned) right shift of int64 ``x``."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (products wrap modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX[0]
    z = (z ^ _shift_right(z, 27)) * _MIX[1]
    return z ^ _shift_right(z, 31)


def seed_bits(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 :func:`positional_uniforms` takes."""
    return _int64(seed % (1 << 64))


UNIFORM_BITS = 24
"""Random bits of each uniform: every one is a whole multiple of ``2**-UNIFORM_BITS``, exact in float32."""


def positional_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float32[N] in [0, 1) with :data:`UNIFORM_BITS` random bits: a hash of ``seeds`` (int64[N],
    from :func:`seed_bits`) and ``positions`` (int64[N]), the same on every device and in every batch."""
    z = _mix(_mix(seeds + _GOLDEN) + positions * _GOLDEN)
    return _shift_right(z, 64 - UNIFORM_BITS).to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


FIXED_BITS = 38
"""Probabilities are summed in units of ``2**-FIXED_BITS``: a row's total stays below ``2**39``, so a
total times a uniform's ``UNIFORM_BITS`` bits fits in an int64."""


def fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """int64[N, V]: ``probs`` (float32[N, V], rows summing to about 1) as whole numbers of
    ``2**-FIXED_BITS`` units. Their running sums (``cumsum``) are exact in any order, so a row's
    sums are the same whatever else shares the call, on any device; a float ``cumsum`` is not (on
    CUDA its order of additions depends on the tensor's shape)."""
    return torch.round(probs * float(1 << FIXED_BITS)).long()


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64[B]: the token of each row of ``probs`` [B, V] found by inverse CDF at ``uniforms`` [B]
    (from :func:`positional_uniforms`): the first token whose running weight exceeds
    ``floor(u * total)``. A token of weight 0 is never drawn."""
    cdf = fixed_point(probs).cumsum(-1)
    target = ((uniforms * float(1 << UNIFORM_BITS)).long() * cdf[:, -1]) >> UNIFORM_BITS
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32[N]: ``log_softmax(logits[i])[tokens[i]]`` under the raw model distribution."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
