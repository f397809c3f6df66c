"""Batched sampling: target distributions per tree node, random coins, first-token sampling.

Random numbers are drawn on the host from each request's own ``torch.Generator`` (seeded from
``SamplingParams.seed``, else from the engine's seed), so a seeded request samples the same
tokens on every device for a given speculation setting, whatever else is in its batch.
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
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if self.use_top_k:
            rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
            k = torch.where(self.top_k > 0, self.top_k, logits.shape[1]).unsqueeze(1)
            drop |= rank >= k
        if self.use_top_p:
            p = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            before = p.cumsum(-1) - p
            drop |= before >= self.top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw_uniforms(generators: Sequence[torch.Generator | None], count: int) -> torch.Tensor:
    """Host float32[B, count] uniforms in [0, 1): row b from ``generators[b]``, zeros where it is None."""
    rows = [torch.rand(count, generator=g, dtype=torch.float32) if g is not None
            else torch.zeros(count, dtype=torch.float32) for g in generators]
    return torch.stack(rows) if rows else torch.empty((0, count), dtype=torch.float32)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64[B]: the token of each row of ``probs`` [B, V] found by inverse CDF at ``uniforms`` [B]."""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token.clamp_(max=probs.shape[1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32[N]: ``log_softmax(logits[i])[tokens[i]]`` under the raw model distribution."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
