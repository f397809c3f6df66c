"""Prompt lookup on the device: each request's tokens kept in a device table, chains drafted there.

The host drafters need a step's committed tokens on the host before the next step can be
drafted, so a speculative step waits for the one before it. :class:`DeviceDrafter` drafts from
the :class:`~ngram_hal.speculative.relay.OverlapRelay` instead: it records the relay's committed
tokens in a token table (``table[row, position]``, one row per request-pool row, like the
request table) and drafts the next chains from it, without a host sync. The engine can then
enqueue a speculative step before the previous one has finished, as it does a plain one.

The drafts are those of :class:`~ngram_hal.speculative.drafter.LinearDrafter`: the longest suffix
of the context (up to ``max_ngram`` tokens, at least ``min_ngram``) that occurred earlier, its
latest earlier occurrence, and the tokens that followed it, continued periodically where the
copy reaches the end of the context; with no match the chain repeats the root (the padding rule).
It sees only its own request's tokens, not a corpus shared across requests.

Each chain also says how many of its nodes are worth verifying, its *active* nodes
(:func:`active_nodes`, from the length of the match it continues): the root alone with no match
(the chain only repeats the root), every node after a match. On the workload's check half 31 % of
positions follow no match and none of their drafts was accepted; a one-token match (41 %) was
followed by 0.67 accepted drafts on average, and cutting its chain to five nodes costs 1.5 % of the
tokens per verify step (``bench/bench_active_replay.py``, ``docs/bench/h100-active/``). A verify
step skips the attention of the other nodes (:meth:`ngram_hal.Backend.attention_layout`'s
``q_active``) and never accepts them.

:func:`record_and_draft` is the plain-torch implementation (any device; the oracle of the Triton
kernel in :mod:`ngram_hal.kernels.gpu.lookup`, which GPU backends with Triton model kernels use).
"""

from __future__ import annotations

import torch

from .. import contract as c
from ..backend import Backend
from ..contract import check_record_and_draft
from .relay import OverlapRelay

def record_and_draft(table: torch.Tensor, rows: torch.Tensor, accept_tokens: torch.Tensor,
                     accept_lens: torch.Tensor, new_seq_lens: torch.Tensor, tree_size: int, max_ngram: int,
                     min_ngram: int, live: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     match: torch.Tensor | None = None) -> torch.Tensor:
    """Record a step's committed tokens in ``table``, then draft a chain of ``tree_size`` nodes per request.

    Every tensor is int64 and contiguous on one device (checked by :func:`check_record_and_draft`);
    ``rows`` are distinct.

    Args:
        table: int64[R, W], token ids by request row and position; changed in place.
        rows: int64[B], each request's row of ``table``.
        accept_tokens: int64[B*S], request b's committed tokens at ``b*S + j`` for
            ``j < accept_lens[b]`` (S the relay's stride).
        accept_lens: int64[B]; new_seq_lens: int64[B], lengths after the step. The committed
            tokens sit at positions ``new_seq_lens - accept_lens + 1 ...``; the last one, at
            ``new_seq_lens`` (below W), is the root of the next draft.
        tree_size: D, nodes per chain (the root included).
        live: int64[1] or None: only the first ``live[0]`` requests are real; the others are
            padding (a captured step's), which records nothing and whose chains are unspecified.
            None: all B are real.
        out: int64[B*n] or None: where the chains go (None: a new tensor).
        match: int64[B] or None: where the length of the suffix each chain continues goes (0: no
            match).
    Returns:
        int64[B*n]: request b's chain at ``b*n``, its root first (``out`` where given).
    """
    B, W, stride, tree_size = check_record_and_draft("lookup.record_and_draft", table, rows, accept_tokens,
                                                     accept_lens, new_seq_lens, tree_size, live, out, match)
    j = torch.arange(stride, dtype=torch.int64, device=table.device)
    last = new_seq_lens.clamp(max=W - 1).unsqueeze(1)
    committed = accept_tokens.view(B, stride)
    # Slots past a request's count rewrite its root (same position, same value): no host sync.
    keep = j < accept_lens.unsqueeze(1)
    pos = torch.where(keep, last - accept_lens.unsqueeze(1) + 1 + j, last)
    values = torch.where(keep, committed, committed.gather(1, (accept_lens - 1).clamp(min=0).unsqueeze(1)))
    if live is not None:
        # Padding rewrites position 0 of its row with what is there; a real request's committed
        # tokens never reach position 0 (its prompt holds it), so no two writes collide.
        real = (torch.arange(B, device=table.device) < live).unsqueeze(1)
        pos = torch.where(real, pos, 0)
        values = torch.where(real, values, table[:, 0].index_select(0, rows).unsqueeze(1))
    table.view(-1).scatter_(0, (rows.unsqueeze(1) * W + pos).view(-1), values.view(-1))
    ctx = table.index_select(0, rows)
    root = ctx.gather(1, last)
    p = torch.arange(W, dtype=torch.int64, device=table.device).unsqueeze(0)
    run = p < last
    length = torch.zeros((B, W), dtype=torch.int64, device=table.device)
    for k in range(max_ngram):
        back = p - k
        mine = ctx.gather(1, back.clamp(min=0).expand(B, W))
        theirs = ctx.gather(1, (last - k).clamp(min=0))
        run = run & (back >= 0) & (last - k >= 0) & (mine == theirs)
        length += run
    score = torch.where(length >= min_ngram, length * W + p, -1)
    best = score.max(dim=1, keepdim=True).values
    found = best >= 0
    end = best % W
    period = (last - end).clamp(min=1)
    i = torch.arange(tree_size - 1, dtype=torch.int64, device=table.device).unsqueeze(0)
    copied = ctx.gather(1, (end + 1 + i % period).clamp(max=W - 1))
    chain = torch.where(found, copied, root)
    chains = torch.cat([root, chain], dim=1).view(-1)
    if match is not None:
        match.copy_(torch.where(found, best // W, 0).view(-1))
    return chains if out is None else out.copy_(chains)


def active_nodes(match: torch.Tensor, tree_size: int) -> torch.Tensor:
    """int64[B]: the active nodes of chains of ``tree_size`` (n) nodes continuing matches of
    ``match`` int64[B] tokens: 1 with no match, n after a match of any length."""
    return torch.where(match > 0, tree_size, 1)


def chain_masks(batch_size: int, tree_size: int, device) -> torch.Tensor:
    """bool[B, n, n], contiguous: the tree masks of B chains (node i the child of node i-1)."""
    chain = torch.ones((tree_size, tree_size), dtype=torch.bool, device=device).tril()
    return chain.expand(batch_size, tree_size, tree_size).contiguous()


class DeviceDrafter:
    """Chains of prompt lookup drafted on the device (see the module docstring).

    Two ways to draft. :meth:`draft` records a relay and drafts the chains of the step about to
    run. :meth:`draft_next` records a step's relay as part of that step (a captured step's graph
    includes it) and drafts the *next* step's chains of ``tree_size`` into :attr:`next_chains`
    (their active nodes into :attr:`next_active`); if the next step runs the same requests in the
    same order, it takes the first n nodes of each (the first n nodes of a chain are the chain of
    n) with no launch of its own (:meth:`chains_ahead`).

    Args:
        backend: runs the drafting (with its :meth:`~ngram_hal.backend.Backend.lookup_kernel`, or
            :func:`record_and_draft` where it has none).
        num_rows, width: the token table's shape, the request table's: R request-pool rows of W
            positions.
        tree_size: D, the longest chain a step takes from :attr:`next_chains`.
        max_ngram, min_ngram: the longest and shortest suffix matched.

    Attributes:
        kernel: the record-and-draft implementation it runs (the backend's, or :func:`record_and_draft`).
    """

    def __init__(self, backend: Backend, num_rows: int, width: int, tree_size: int = 1, max_ngram: int = 8,
                 min_ngram: int = 1):
        op = "DeviceDrafter"
        c.check_int(op, "num_rows", num_rows, minimum=1)
        c.check_int(op, "width", width, minimum=2)
        self.tree_size = c.check_int(op, "tree_size", tree_size, minimum=1)
        self.max_ngram = c.check_int(op, "max_ngram", max_ngram, minimum=1)
        self.min_ngram = c.check_int(op, "min_ngram", min_ngram, minimum=1)
        if min_ngram > max_ngram:
            raise c.ContractError(op, "min_ngram", f"expected <= max_ngram ({max_ngram}), got {min_ngram}")
        self.device = backend.device
        self.table = torch.zeros((num_rows, width), dtype=torch.int64, device=self.device)
        self.next_chains = torch.zeros((num_rows, tree_size), dtype=torch.int64, device=self.device)
        self.next_active = torch.full((num_rows,), tree_size, dtype=torch.int64, device=self.device)
        self._match = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        self.kernel = backend.lookup_kernel() or record_and_draft
        self._chains: dict[int, torch.Tensor] = {}

    def add_prompts(self, rows: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record prompts, each from position 0 of its row: request b's ``lens[b]`` tokens follow
        the tokens of the requests before it in ``tokens``.

        Args:
            rows: int64[B], the requests' rows; lens: int64[B], their prompt lengths, which must
                sum to N (not read on the host).
            tokens: int64[N], the prompts one after another.
        """
        op = "DeviceDrafter.add_prompts"
        B = c.check_index(op, "rows", rows, self.device, ndim=1).shape[0]
        c.check_index(op, "lens", lens, self.device, shape=(B,))
        N = c.check_index(op, "tokens", tokens, self.device, ndim=1).shape[0]
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(N, dtype=torch.int64, device=self.device) - starts.repeat_interleave(
            lens, output_size=N)
        index = rows.repeat_interleave(lens, output_size=N) * self.table.shape[1] + positions
        self.table.view(-1).index_copy_(0, index, tokens)

    def draft(self, rows: torch.Tensor, relay: OverlapRelay, tree_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``relay``'s committed tokens and draft a chain of ``tree_size`` per request.

        Args:
            rows: int64[B], the relay's requests' rows, in relay order.
            relay: the last step's results of those requests (after a prefill: the first token).
            tree_size: n >= 1 (1 records only and returns the roots).
        Returns:
            ``(chains, active)`` on the device: int64[B*n], each request's root, then n-1 drafted
            tokens; int64[B], each chain's active nodes (:func:`active_nodes`).

        The implementation checks the other arguments (:func:`check_record_and_draft`).
        """
        c.check_int("DeviceDrafter.draft", "tree_size", tree_size, minimum=1)
        match = torch.empty(rows.shape[0], dtype=torch.int64, device=self.device)
        chains = self.kernel(self.table, rows, relay.accept_tokens, relay.accept_lens, relay.new_seq_lens, tree_size,
                             self.max_ngram, self.min_ngram, match=match)
        return chains, active_nodes(match, tree_size)

    def draft_next(self, rows: torch.Tensor, relay: OverlapRelay, live: torch.Tensor | None = None) -> None:
        """Record ``relay``'s committed tokens and draft each request's next chain of D nodes into
        ``next_chains[:B]``; launches only, no host sync (a captured step may include it).

        Args:
            rows: int64[B], the relay's requests' rows, in relay order (B <= num_rows).
            relay: the results of the step that just ran.
            live: int64[1] or None: in a padded step, the number of real requests (the first
                ones; the padding records nothing). None: all B are real.
        """
        B = rows.shape[0]
        if B > self.next_chains.shape[0]:
            raise c.ContractError("DeviceDrafter.draft_next", "rows",
                                  f"{B} requests exceed the {self.next_chains.shape[0]} rows of next_chains")
        self.kernel(self.table, rows, relay.accept_tokens, relay.accept_lens, relay.new_seq_lens, self.tree_size,
                    self.max_ngram, self.min_ngram, live, self.next_chains[:B].view(-1), self._match[:B])
        self.next_active[:B].copy_(active_nodes(self._match[:B], self.tree_size))

    def chains_ahead(self, batch_size: int, tree_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chains, active)``, views: int64[B, n], the first n nodes of the chains :meth:`draft_next`
        drafted for the first B requests, and int64[B], their active nodes (those of the chains of D:
        n or more means all n); valid while the next step runs the requests that step ran, in order."""
        if not 1 <= tree_size <= self.tree_size:
            raise c.ContractError("DeviceDrafter.chains_ahead", "tree_size",
                                  f"expected 1 to {self.tree_size}, got {tree_size}")
        return self.next_chains[:batch_size, :tree_size], self.next_active[:batch_size]

    def chain_masks(self, batch_size: int, tree_size: int) -> torch.Tensor:
        """bool[B, n, n]: the tree masks of B chains (node i the child of node i-1); cached."""
        masks = self._chains.get(tree_size)
        if masks is None or masks.shape[0] < batch_size:
            masks = self._chains[tree_size] = chain_masks(max(batch_size, 1), tree_size, self.device)
        return masks[:batch_size]
