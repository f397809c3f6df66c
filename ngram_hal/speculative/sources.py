"""Where a verify step's draft trees come from, behind one protocol: :class:`DraftSource`.

The engine drafts through a draft source and never asks which kind it has:

* :class:`DraftSource` itself drafts nothing: without speculation every step is a plain decode
  step (its tree is the root alone).
* :class:`HostDrafts`: a host :class:`~ngram_hal.speculative.drafter.Drafter` (the trie or the
  linear drafter). It learns the committed tokens on the host, so a speculative step waits for
  the previous step's tokens; a step runs only as many nodes as the fullest tree of its batch.
* :class:`DeviceDrafts`: chains of prompt lookup drafted on the device
  (:class:`~ngram_hal.speculative.lookup.DeviceDrafter`). Every verify step drafts the next
  step's chains (inside the graph of a captured step), so the next step needs nothing from the
  host (:attr:`DraftSource.ahead`).

A step asks :meth:`DraftSource.plan` on the host before its first device op (a host drafter
drafts there: host time the device may spend idle), then :meth:`DraftSource.trees` for the
device tensors, and :meth:`DraftSource.stepped` once its verify step is enqueued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .drafter import DraftBatch, Drafter
from .lookup import DeviceDrafter
from .relay import OverlapRelay


@dataclass
class Trees:
    """The draft trees of one verify step of B requests, of tree size ``tree_size`` (n), on the device.

    Attributes:
        tokens: int64[B*n] or int64[B, n] (a view will do): node 0 of each tree is the request's
            last committed token.
        mask: bool[B, n, n], ``mask[b, i, j]`` when node j is node i or one of its ancestors.
        tree_size: n, the nodes of each tree (the root included).
        offered: host ints[B], the drafts each request was offered (its tree's drafted nodes
            past the root, within n).
        guess: int64[B] or None: for a plain step, each request's first draft (drafted anyway,
            not run), to be scored against the token the step commits.
        chains: every tree is a chain (node i the child of node i - 1).
        active: int64[B] or None: each tree's nodes worth verifying, its first ``active[b]`` (n or
            more: all); the verify step skips the attention of the others and never accepts them.
            None: every node.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    tree_size: int
    offered: list[int]
    guess: torch.Tensor | None = None
    chains: bool = False
    active: torch.Tensor | None = None


class DraftSource:
    """The drafter protocol of the engine; this base drafts nothing (plain decode steps).

    Attributes:
        ahead: the next step's trees need no tokens on the host (they are drafted on the device).
        graph_drafter: the device drafter a captured greedy step drafts the next chains with, or None.
    """

    ahead: ClassVar[bool] = False
    graph_drafter: DeviceDrafter | None = None
    _ones: torch.Tensor | None = None  # the plain steps' masks, bool[R, 1, 1], read only

    @property
    def busy(self) -> bool:
        """True while the source still records in the background (a batch of prompts): a draft
        now would wait for it."""
        return False

    def add_prompts(self, rids: Sequence[str], prompts: Sequence[Sequence[int]], rows: torch.Tensor,
                    lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """New requests after their prefill was enqueued: ids and prompts on the host, and on the
        device rows int64[B], prompt lengths int64[B] and the prompts one after another int64[N]."""

    def extend(self, runs: Sequence[tuple[str, list[int]]], spare: bool) -> None:
        """The tokens each request (id, tokens) committed in a step; ``spare``: the device is busy
        with the next step, so the host has time to record them now."""

    def erase(self, rids: Sequence[str]) -> None:
        """Forget finished requests."""

    def forget(self) -> None:
        """Forget everything learned from text, as a new source would be."""

    def plan(self, rids: Sequence[str], tree_size: int, padded: bool) -> int:
        """On the host, before the step's first device op: the tree size the step will
        run, given the ``tree_size`` the policy chose (``padded``: captured shapes, powers of two)."""
        return tree_size

    def trees(self, relay: OverlapRelay, rows: torch.Tensor, tree_size: int, score_plain: bool) -> Trees:
        """The trees of size ``tree_size`` (as :meth:`plan` returned) for the relay's requests, whose
        request-pool rows are ``rows`` int64[B]; ``score_plain``: a plain step also wants each
        request's first draft (:attr:`Trees.guess`) where the source has it for free."""
        return self.roots(relay)

    def roots(self, relay: OverlapRelay) -> Trees:
        """Plain trees: each request's last committed token alone (masks sliced from one kept
        tensor, not made every step)."""
        B = relay.batch_size
        if self._ones is None or self._ones.shape[0] < B or self._ones.device != relay.device:
            self._ones = torch.ones((max(B, 1), 1, 1), dtype=torch.bool, device=relay.device)
        return Trees(relay.last_tokens().contiguous(), self._ones[:B], 1, [0] * B)

    def stepped(self, rows: torch.Tensor, relay: OverlapRelay, captured: bool) -> None:
        """The verify step of the requests in ``rows`` was enqueued and gave ``relay``;
        ``captured``: it was a captured greedy step (which drafts with :attr:`graph_drafter`)."""

    def match_lengths(self, rids: Sequence[str]) -> list[int] | None:
        """On the host: the length of the context suffix each request's next draft would continue
        (0: none, it would draft nothing), or None where the source does not know it on the host
        (it drafts on the device, or nothing)."""
        return None

    def first_drafts(self, rids: Sequence[str]) -> list[int] | None:
        """On the host, before a plain step's tokens are recorded: each request's first draft for
        the position that step committed (-1 where it has none), to score against the committed
        token; None where the source scores plain steps itself (:attr:`Trees.guess`) or drafts
        nothing."""
        return None


class HostDrafts(DraftSource):
    """Draft trees from a host drafter, uploaded for each step.

    Args:
        make: makes the drafter (called again by :meth:`forget`).
        upload: copies a host tensor to the device without waiting for queued device work.
    """

    def __init__(self, make: Callable[[], Drafter], upload: Callable[[torch.Tensor], torch.Tensor]):
        self._make, self._upload = make, upload
        self._draft: DraftBatch | None = None
        self.forget()

    @property
    def busy(self) -> bool:
        return self.drafter.busy

    def add_prompts(self, rids, prompts, rows, lens, tokens) -> None:
        for rid, prompt in zip(rids, prompts):
            self.drafter.add_request(rid, prompt)
        self.drafter.prepare()

    def extend(self, runs, spare: bool) -> None:
        for rid, run in runs:
            self.drafter.extend(rid, run)
        if spare:
            self.drafter.prepare()

    def erase(self, rids) -> None:
        for rid in rids:
            self.drafter.erase(rid)

    def forget(self) -> None:
        self.drafter = self._make()
        self.drafter.prepare()  # memory the drafter maps lazily is mapped now, not at the first requests

    def plan(self, rids, tree_size: int, padded: bool) -> int:
        self._draft = None
        if tree_size == 1:
            return 1
        self._draft = self.drafter.draft(rids, tree_size)
        # Nodes past every tree's drafted count are padding: run the first n of them (BFS order
        # keeps each parent before its children), 1 when nothing was drafted.
        n = int(self._draft.drafted.max())
        if padded and n > 1:
            n = min(tree_size, 1 << (n - 1).bit_length())  # more padding nodes, fewer shapes
        return n

    def match_lengths(self, rids) -> list[int] | None:
        return self.drafter.match_lengths(rids)

    def first_drafts(self, rids) -> list[int]:
        # The drafter has recorded every token before the plain step's: its first draft is its
        # guess of the token that step committed.
        draft = self.drafter.draft(rids, 2)
        firsts = draft.tokens.view(len(rids), 2)[:, 1].tolist()
        return [t if d > 1 else -1 for t, d in zip(firsts, draft.drafted.tolist())]

    def trees(self, relay, rows, tree_size: int, score_plain: bool) -> Trees:
        draft, self._draft = self._draft, None
        if tree_size == 1:
            return self.roots(relay)
        B = relay.batch_size
        drafts = self._upload(draft.tokens.view(B, -1)[:, 1:tree_size].contiguous())
        tokens = torch.cat([relay.last_tokens().unsqueeze(1), drafts], dim=1).view(-1)
        mask = self._upload(draft.tree_mask[:, :tree_size, :tree_size].contiguous())
        return Trees(tokens, mask, tree_size, [min(tree_size, d) - 1 for d in draft.drafted.tolist()])


class DeviceDrafts(DraftSource):
    """Chains drafted on the device by a :class:`~ngram_hal.speculative.lookup.DeviceDrafter`.

    Each verify step records its committed tokens and drafts the next step's chains; where the
    next step runs the same requests in the same order it takes them with no launch of its own,
    else (a prefill joined, a request left) it records and drafts in a launch of its own first
    (counted in :attr:`launches`).
    """

    ahead = True

    def __init__(self, lookup: DeviceDrafter):
        self.lookup = self.graph_drafter = lookup
        self.launches = 0
        # The relay whose requests the next chains were drafted for (in its order).
        self._chains_for: OverlapRelay | None = None

    def add_prompts(self, rids, prompts, rows, lens, tokens) -> None:
        self.lookup.add_prompts(rows, lens, tokens)

    def trees(self, relay, rows, tree_size: int, score_plain: bool) -> Trees:
        # A plain step under a scoring policy keeps each chain's first draft, to score it against
        # the token the step commits: acceptance keeps following the text.
        B = relay.batch_size
        width = 2 if tree_size == 1 and score_plain else tree_size
        if self._chains_for is relay:
            chains, active = self.lookup.chains_ahead(B, width)
        else:
            chains, active = self.lookup.draft(rows, relay, width)
            chains = chains.view(B, width)
            self.launches += 1
        guess = chains[:, 1].clone() if width > tree_size else None
        return Trees(chains[:, :tree_size], self.lookup.chain_masks(B, tree_size), tree_size,
                     [1 if guess is not None else tree_size - 1] * B, guess, chains=True,
                     active=active if tree_size > 1 else None)

    def stepped(self, rows, relay, captured: bool) -> None:
        if not captured:
            self.lookup.draft_next(rows, relay)
        self._chains_for = relay
