"""Offline replay of decoding: drafters propose, a known token stream plays the target model.

Each request's stream is split into a prompt and the "model output" that follows it. A step
gives every drafter the tokens committed at the previous step, asks for draft trees, then walks
each tree greedily with the true next tokens (what greedy verification does when the target's
argmax is the true token): the accepted drafts plus one bonus token are committed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ngram_hal.speculative.drafter import DraftBatch, Drafter


def parents_of(tree_mask: np.ndarray) -> np.ndarray:
    """int64[B, D] parents from bool[B, D, D]: each node's deepest (highest-index) ancestor."""
    B, D, _ = tree_mask.shape
    strict = np.tril(tree_mask, k=-1)
    idx = np.where(strict, np.arange(D), -1)
    return idx.max(axis=2)


def accepted_drafts(batch: DraftBatch, truth: np.ndarray) -> np.ndarray:
    """int64[B]: drafts accepted walking each tree from its root with ``truth`` int64[B, D-1]."""
    B, D = batch.batch_size, batch.tree_size
    tokens = batch.tokens.numpy().reshape(B, D)
    parents = parents_of(batch.tree_mask.numpy())
    cur = np.zeros(B, np.int64)
    alive = np.ones(B, bool)
    accepted = np.zeros(B, np.int64)
    for level in range(D - 1):
        hit = (parents == cur[:, None]) & (tokens == truth[:, level, None])
        found = hit.any(axis=1) & alive
        cur = np.where(found, hit.argmax(axis=1), cur)
        accepted += found
        alive = found
        if not alive.any():
            break
    return accepted


class Replay:
    """Decode ``streams`` with ``drafter``, trees of ``tree_size``.

    ``prompt_len``: the prompt's length, one for all streams or one per stream; the rest of each
    stream is the output to replay.
    """

    def __init__(self, drafter: Drafter, streams: Sequence[np.ndarray], prompt_len: int | Sequence[int],
                 tree_size: int):
        self.drafter = drafter
        self.streams = [np.asarray(s, np.int64) for s in streams]
        self.rids = list(range(len(self.streams)))
        self.tree_size = tree_size
        self.prompt_lens = np.broadcast_to(np.asarray(prompt_len, np.int64), (len(self.streams),)).copy()
        self.cursor = self.prompt_lens.copy()
        self.pending: list[list[int]] = [[] for _ in self.streams]

    def prefill(self) -> float:
        """Seconds to add every prompt and draft the first trees (which records the prompts)."""
        start = time.perf_counter()
        for rid, stream, n in zip(self.rids, self.streams, self.prompt_lens):
            self.drafter.add_request(rid, stream[:n])
        self.drafter.draft(self.rids, self.tree_size)
        return time.perf_counter() - start

    def done(self) -> np.ndarray:
        """bool[B]: streams whose output has been replayed to the end."""
        return self.cursor >= np.array([s.size for s in self.streams])

    def step(self) -> tuple[float, float, np.ndarray]:
        """One decode step: ``(wall seconds, CPU seconds, committed tokens int64[B])``, the times
        spent in extend + draft. CPU time leaves out the time the process was preempted.

        Past the end of a stream nothing more is accepted (one token per step is still counted).
        """
        D = self.tree_size
        start, start_cpu = time.perf_counter(), time.process_time()
        for rid, tokens in zip(self.rids, self.pending):
            if tokens:
                self.drafter.extend(rid, tokens)
        batch = self.drafter.draft(self.rids, D)
        seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        truth = np.full((len(self.rids), D - 1), -1, np.int64)
        for b, (s, c) in enumerate(zip(self.streams, self.cursor)):
            tail = s[c:c + D - 1]
            truth[b, : tail.size] = tail
        committed = accepted_drafts(batch, truth) + 1
        for b, (stream, c, n) in enumerate(zip(self.streams, self.cursor, committed)):
            self.pending[b] = stream[c:c + n].tolist()
        self.cursor += committed
        return seconds, cpu, committed
