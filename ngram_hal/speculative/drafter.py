"""Drafters: the interface, the draft batch, the trie drafter and the prompt-lookup baseline.

A drafter sees each request's context exactly once, token by token: the prompt at
:meth:`Drafter.add_request`, then every newly committed token through :meth:`Drafter.extend`,
including tokens accepted but not yet written to the request (pending under overlap
scheduling). It never sees a token twice and never a -1 pad; -1 or a non-integer is refused.

Draft trees (:class:`DraftBatch`) have exactly D nodes: node 0 is the request's last context
token (the root), nodes are in BFS order (a parent's index is below its children's), and
``tree_mask[b, i, j]`` is true when node j is node i or one of its ancestors.

Padding rule: when a drafter has fewer than D - 1 candidates, the remaining nodes form a chain
hanging from the root that repeats the root's token (the guess that the last token repeats, as in
runs of spaces or punctuation). Padding never uses -1, and a padded tree is a valid tree; where a
padding node duplicates a real sibling's token, verification takes the real one (it comes first).
"""

from __future__ import annotations

import abc
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..contract import ContractError, check_int
from .corpus import Corpus, as_tokens, token_list


@dataclass(frozen=True)
class DraftBatch:
    """Draft trees for B requests, D nodes each, on the CPU.

    Attributes:
        tokens: int64[B*D], the token of node i of request b at ``b*D + i``.
        tree_mask: bool[B, D, D], ``tree_mask[b, i, j]`` when node j is node i or its ancestor.
        drafted: int64[B], how many of each tree's nodes were drafted (the root included); the
            rest is padding. 1 means the drafter found nothing for that request.
    """

    tokens: torch.Tensor
    tree_mask: torch.Tensor
    drafted: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tree_mask.shape[0]

    @property
    def tree_size(self) -> int:
        return self.tree_mask.shape[1]


def pack_chains(tokens: np.ndarray, drafted: np.ndarray) -> DraftBatch:
    """A :class:`DraftBatch` of chains (node i the child of node i-1) from tokens int64[B, D] and
    the drafted node counts int64[B]."""
    B, D = tokens.shape
    mask = np.repeat(np.tri(D, dtype=bool)[None], B, axis=0)
    return DraftBatch(torch.from_numpy(tokens.reshape(-1)), torch.from_numpy(mask), torch.from_numpy(drafted))


class Drafter(abc.ABC):
    """Proposes draft trees from each request's context.

    Errors: an unknown request id raises ``KeyError`` naming it; a context with -1 or a
    non-integer raises ``ValueError`` naming the argument; ``tree_size < 1`` raises ``ValueError``.
    An error leaves the drafter as it was.
    """

    @abc.abstractmethod
    def add_request(self, rid: Hashable, prompt: Sequence[int]) -> None:
        """Start request ``rid`` with its prompt (at least one token)."""

    @abc.abstractmethod
    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Append newly committed tokens of ``rid`` (pending ones under overlap included)."""

    @abc.abstractmethod
    def draft(self, rids: Sequence[Hashable], tree_size: int) -> DraftBatch:
        """Draft trees of exactly ``tree_size`` nodes for ``rids``, in that order."""

    @abc.abstractmethod
    def erase(self, rid: Hashable) -> None:
        """Forget request ``rid``."""

    def match_lengths(self, rids: Sequence[Hashable]) -> list[int] | None:
        """For each of ``rids``, the length of the context suffix its next draft continues (0: it
        matches nothing, the draft would be padding); None where the drafter does not say. The
        default: None."""
        return None

    def prepare(self) -> None:
        """Do now the work that the contexts given so far leave for the next :meth:`draft`.

        A hint from a caller that has host time to spare (the device is busy, or the engine is
        starting): a drafter that records contexts lazily records them here, off the path of the
        next draft (a large batch in a background thread, see :attr:`busy`), and one that maps
        memory lazily maps it at the first call. Drafting gives the same trees with or without
        it. The default does nothing.
        """

    @property
    def busy(self) -> bool:
        """True while a large piece of work :meth:`prepare` started (recording a batch of
        prompts) still runs in the background: a draft now would wait for it. The default: False."""
        return False


class CorpusDrafter(Drafter):
    """A drafter over a :class:`~ngram_hal.speculative.corpus.Corpus` (``self.corpus``): it
    prepares by mapping the corpus's memory and recording pending tokens in the background, and
    is busy while a background recording of ``BUSY_TOKENS`` or more (a batch of prompts) runs."""

    BUSY_TOKENS = 1024
    corpus: Corpus

    def prepare(self) -> None:
        self.corpus.map_memory()
        self.corpus.flush(wait=False)

    @property
    def busy(self) -> bool:
        return self.corpus.backlog >= self.BUSY_TOKENS


def _prompt(op: str, prompt) -> np.ndarray:
    arr = as_tokens(op, "prompt", prompt)
    if arr.size == 0:
        raise ContractError(op, "prompt", "expected at least one token (the root of the first tree)")
    return arr


class TrieDrafterConfig(BaseModel):
    """Settings of :class:`TrieDrafter`.

    ``max_depth``: longest n-gram recorded; ``max_match``/``min_match``: suffix lengths matched
    (``max_match`` defaults to ``max_depth - 1``); ``mode``: ``"bfs"`` (recency, breadth schedule
    from ``max_breadth`` for the shortest match down to ``min_breadth`` for the longest) or
    ``"frequency"`` (path probability); ``capacity``: most trie nodes held; ``shared``: one
    corpus for all requests or one per request.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_depth: int = Field(18, ge=2)
    max_match: int | None = Field(None, ge=1)
    min_match: int = Field(1, ge=1)
    mode: Literal["bfs", "frequency"] = "bfs"
    max_breadth: float = Field(10.0, ge=1.0)
    min_breadth: float = Field(1.0, ge=1.0)
    capacity: int = Field(1 << 22, ge=64)
    shared: bool = True

    @model_validator(mode="after")
    def _consistent(self):
        top = self.max_depth - 1
        max_match = top if self.max_match is None else self.max_match
        if not self.min_match <= max_match <= top:
            raise ValueError(f"need min_match <= max_match <= max_depth - 1 = {top}, "
                             f"got {self.min_match} and {max_match}")
        if self.min_breadth > self.max_breadth:
            raise ValueError(f"need min_breadth <= max_breadth, got {self.min_breadth} and {self.max_breadth}")
        return self


class TrieDrafter(CorpusDrafter):
    """Draft trees from the n-gram :class:`~ngram_hal.speculative.corpus.Corpus`.

    Keyword arguments are the fields of :class:`TrieDrafterConfig`. Tokens given to
    :meth:`extend` are recorded at the next :meth:`draft`, for the whole batch in one call.
    """

    def __init__(self, **settings):
        self.config = TrieDrafterConfig(**settings)
        cfg = self.config
        self.corpus = Corpus(max_depth=cfg.max_depth, capacity=cfg.capacity, shared=cfg.shared)
        self._max_match = cfg.max_depth - 1 if cfg.max_match is None else cfg.max_match

    def add_request(self, rid: Hashable, prompt: Sequence[int]) -> None:
        arr = _prompt("TrieDrafter.add_request", prompt)
        self.corpus.open(rid, arr)

    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        self.corpus.extend(rid, tokens)

    def draft(self, rids: Sequence[Hashable], tree_size: int) -> DraftBatch:
        cfg = self.config
        D = check_int("TrieDrafter.draft", "tree_size", tree_size, minimum=1)
        drafted = np.empty(len(rids), np.int64)
        tokens, _, mask = self.corpus.draft(rids, D, mode=cfg.mode, min_match=cfg.min_match,
                                            max_match=self._max_match, max_breadth=cfg.max_breadth,
                                            min_breadth=cfg.min_breadth, drafted=drafted)
        return DraftBatch(torch.from_numpy(tokens.reshape(-1)), torch.from_numpy(mask), torch.from_numpy(drafted))

    def match_lengths(self, rids: Sequence[Hashable]) -> list[int]:
        cfg = self.config
        return self.corpus.match_lengths(rids, cfg.min_match, self._max_match).tolist()

    def erase(self, rid: Hashable) -> None:
        self.corpus.erase(rid)


class LinearDrafter(CorpusDrafter):
    """Prompt lookup: one chain of D-1 tokens after the longest earlier match of the context's suffix.

    The suffixes of up to ``max_ngram`` tokens are matched against the request's own history
    (the latest earlier occurrence of the longest one, at least ``min_ngram`` tokens); the draft
    is the tokens that followed it. Where the copy reaches the end of the context it continues
    periodically (the text after the match is predicted to repeat). Matching is incremental, on a
    per-request :class:`~ngram_hal.speculative.corpus.Corpus` that remembers where each n-gram last
    ended; ``capacity`` bounds its nodes over all requests. With no match the chain pads.
    """

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, capacity: int = 1 << 22):
        self.max_ngram = check_int("LinearDrafter", "max_ngram", max_ngram, minimum=2)
        self.min_ngram = check_int("LinearDrafter", "min_ngram", min_ngram, minimum=1)
        if min_ngram > max_ngram:
            raise ContractError("LinearDrafter", "min_ngram", f"expected <= max_ngram ({max_ngram}), got {min_ngram}")
        self.corpus = Corpus(max_depth=max_ngram, capacity=capacity, shared=False)
        self._context: dict[Hashable, array] = {}

    def add_request(self, rid: Hashable, prompt: Sequence[int]) -> None:
        arr = _prompt("LinearDrafter.add_request", prompt)
        self.corpus.open(rid, arr)
        self._context[rid] = array("q", arr.tobytes())

    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        context = self._context_of(rid)
        toks = token_list("LinearDrafter.extend", "tokens", tokens)
        self.corpus.extend(rid, toks)
        context.extend(toks)

    def draft(self, rids: Sequence[Hashable], tree_size: int) -> DraftBatch:
        D = check_int("LinearDrafter.draft", "tree_size", tree_size, minimum=1)
        contexts = [self._context_of(rid) for rid in rids]
        tokens = np.empty((len(rids), D), np.int64)
        drafted = np.ones(len(rids), np.int64)
        for b, (rid, context) in enumerate(zip(rids, contexts)):
            tokens[b, 0] = context[-1]
            if D == 1:
                continue
            length, end = self.corpus.last_match(rid)
            if length < self.min_ngram:
                tokens[b, 1:] = context[-1]
                continue
            start, period = end + 1, len(context) - 1 - end
            chain = context[start:start + D - 1]
            while len(chain) < D - 1:
                chain.extend(context[start:start + min(period, D - 1 - len(chain))])
            tokens[b, 1:] = np.frombuffer(chain, np.int64)
            drafted[b] = D
        return pack_chains(tokens, drafted)

    def match_lengths(self, rids: Sequence[Hashable]) -> list[int]:
        lengths = []
        for rid in rids:
            self._context_of(rid)  # an unknown id raises KeyError naming it
            length = self.corpus.last_match(rid)[0]
            lengths.append(length if length >= self.min_ngram else 0)
        return lengths

    def erase(self, rid: Hashable) -> None:
        self.corpus.erase(rid)
        del self._context[rid]

    def _context_of(self, rid: Hashable) -> array:
        try:
            return self._context[rid]
        except (KeyError, TypeError):
            raise KeyError(f"unknown request {rid!r}") from None


def make_drafter(kind: str) -> Drafter:
    """The host drafter named ``kind`` (``"trie"`` or ``"linear"``) with its default settings."""
    drafters = {"trie": TrieDrafter, "linear": LinearDrafter}
    if kind not in drafters:
        raise ValueError(f"drafter: expected one of {', '.join(drafters)}, got {kind!r}")
    return drafters[kind]()
