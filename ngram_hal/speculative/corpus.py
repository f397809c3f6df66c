"""The n-gram corpus: a bounded trie over token streams (prompts and generated tokens).

Every stream (one request) appends tokens to the corpus; each token records the n-grams of
length 1..``max_depth`` that end with it. A stream carries a match state from step to step: the
trie node of each of its suffixes of length 0..max_depth-1. A new token advances that state with
one lookup per depth, so the cost of a step does not grow with the length of the history.

``shared=True``: one trie for all streams; every stream learns from the others (and what a
stream taught stays after it is erased, until it ages out). ``shared=False``: one trie per
stream, rooted apart inside the same node pool, matching only the stream's own history; erasing
the stream frees its trie.

Memory is bounded by ``capacity`` nodes in all. When the pool is full, least recently visited
leaves are evicted in batches of ``evict_fraction * capacity`` (an approximate LRU that reads a
fraction of the pool per batch, see :func:`trie.evict`); the nodes a live stream's match state
holds count as just visited. The arrays are sized for ``capacity`` up front, uninitialized or
zero-filled, so the OS commits their pages only as nodes first use them, and the corpus never
copies or rehashes while it grows.

Recording can run in the background (``flush(wait=False)``): the compiled insert releases the
GIL, so a serving loop hands a step's tokens (or a batch of prompts) to the corpus's worker
thread and goes on launching device work; every call that reads or changes the trie waits for
the worker first.

The compiled kernels and the array layout are in :mod:`ngram_hal.speculative.trie`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ..contract import ContractError, check_int
from . import trie

MAX_TOKEN = 2**31 - 1


def as_tokens(op: str, name: str, tokens) -> np.ndarray:
    """Validate token ids and return them as a fresh int64 numpy array of shape [n].

    Accepts a sequence of Python/numpy ints, a 1-D integer numpy array, or a 1-D int64 tensor.
    Raises :class:`ContractError` (a ``ValueError``) naming ``op`` and ``name`` for a non-integer
    or a negative id (-1 is the pad sentinel and never a token) or one above 2**31-1.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype != torch.int64:
            raise ContractError(op, name, f"expected dtype torch.int64, got {tokens.dtype}")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, (str, bytes)):
        raise ContractError(op, name, f"expected token ids, got {type(tokens).__name__}")
    else:
        if not isinstance(tokens, np.ndarray):
            try:
                tokens = list(tokens)
            except TypeError:
                raise ContractError(op, name, f"expected a sequence of token ids, got "
                                    f"{type(tokens).__name__}") from None
            if any(isinstance(t, bool) for t in tokens):
                raise ContractError(op, name, "expected integer token ids, got a bool")
            if not tokens:
                return np.empty(0, np.int64)
        try:
            arr = np.asarray(tokens)
        except ValueError as e:
            raise ContractError(op, name, f"expected a flat sequence of token ids ({e})") from None
        if arr.dtype.kind not in "iu":
            raise ContractError(op, name, f"expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ContractError(op, name, f"expected a flat sequence of token ids, got shape {arr.shape}")
    arr = arr.astype(np.int64, copy=True)
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < 0:
            what = "the pad sentinel -1" if low == -1 else f"negative id {low}"
            raise ContractError(op, name, f"contains {what}; token ids are >= 0")
        if high > MAX_TOKEN:
            raise ContractError(op, name, f"token id {high} above {MAX_TOKEN}")
    return arr


def token_list(op: str, name: str, tokens) -> list[int]:
    """Like :func:`as_tokens` but returns a list; a list of in-range Python ints passes as is."""
    if type(tokens) is list:
        for t in tokens:
            if type(t) is not int or t < 0 or t > MAX_TOKEN:
                break
        else:
            return tokens
    return as_tokens(op, name, tokens).tolist()


class TrieArrays(NamedTuple):
    """The arrays of a :class:`Corpus`'s trie, in :mod:`.trie`'s layout: ``nodes``
    int32[capacity, NODE_FIELDS], ``table`` int64[T, 2] (the hash of (parent, token) keys to
    nodes), ``meta`` int64[5] (``USED``, ``LIVE``, ``CLOCK``, ...)."""

    nodes: np.ndarray
    table: np.ndarray
    meta: np.ndarray


class Corpus:
    """A bounded n-gram trie over token streams, keyed by any hashable stream id.

    Args:
        max_depth: longest n-gram recorded (>= 2). Suffixes of up to ``max_depth - 1`` tokens
            are matched, and a draft reaches ``max_depth - m`` tokens past a match of length m.
        capacity: most trie nodes held at once, over all streams (>= 64).
        shared: one trie for all streams (True) or one per stream (False).
        evict_fraction: share of ``capacity`` freed by one eviction pass, in (0, 1].
    """

    BACKGROUND_TOKENS = 16

    def __init__(self, max_depth: int = 18, capacity: int = 1 << 22, shared: bool = True,
                 evict_fraction: float = 1 / 64):
        self.max_depth = check_int("Corpus", "max_depth", max_depth, minimum=2)
        self.capacity = check_int("Corpus", "capacity", capacity, minimum=64)
        if not 0.0 < evict_fraction <= 1.0:
            raise ValueError(f"Corpus: argument 'evict_fraction': expected a value in (0, 1], got {evict_fraction}")
        self.shared = bool(shared)
        self._evict_want = max(1, int(self.capacity * evict_fraction))
        self._nodes = np.empty((self.capacity, trie.NODE_FIELDS), np.int32)
        self._table = np.zeros((1 << (2 * self.capacity - 1).bit_length(), 2), np.int64)
        self._meta = np.array([0, 0, -1, 0, 0], np.int64)
        self._state = np.full((0, self.max_depth), -1, np.int32)
        self._sinfo = np.zeros((0, 4), np.int64)
        self._rows: dict[Hashable, int] = {}
        self._free_rows: list[int] = []
        self._pending_rows: list[int] = []
        self._pending_lens: list[int] = []
        self._pending: list[int] = []
        self._mapped = False
        self._executor: ThreadPoolExecutor | None = None
        self._worker: Future | None = None
        self._worker_tokens = 0
        if self.shared:
            self._shared_root = trie.new_root(self._nodes, self._table, self._meta, self._state,
                                              self._evict_want)

    # ------------------------------------------------------------------ streams

    def open(self, key: Hashable, tokens: Sequence[int] = ()) -> None:
        """Start stream ``key`` with ``tokens`` (e.g. the prompt). ``key`` must be new."""
        toks = token_list("Corpus.open", "tokens", tokens)
        if key in self._rows:
            raise ValueError(f"Corpus.open: request {key!r} is already open")
        if not (self.shared and self._free_rows):
            self._settle()  # a new trie or new state rows: arrays the worker may be writing
        if self.shared:
            root = self._shared_root
        else:
            root = trie.new_root(self._nodes, self._table, self._meta, self._state, self._evict_want)
            if root < 0:
                raise MemoryError(f"Corpus.open: no free node for request {key!r}: every node of "
                                  f"the capacity ({self.capacity}) is held by a live match state")
        row = self._free_rows.pop() if self._free_rows else self._grow_rows()
        self._state[row] = -1
        self._state[row, 0] = root
        self._sinfo[row] = (0, -1, 0, -1)
        self._rows[key] = row
        self._queue(row, toks)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to stream ``key``. Recorded lazily, at the next draft or flush."""
        row = self._row(key)
        self._queue(row, token_list("Corpus.extend", "tokens", tokens))

    def erase(self, key: Hashable) -> None:
        """Close stream ``key``. Shared: what it taught stays; per-stream: its trie is freed."""
        row = self._row(key)
        if self.shared:
            self.flush()
        else:
            self._settle()
            rows, lens, flat = self._pending_rows, self._pending_lens, self._pending
            self._pending_rows, self._pending_lens, self._pending = [], [], []
            start = 0
            for r, n in zip(rows, lens):
                if r != row:
                    self._queue(r, flat[start:start + n])
                start += n
            trie.free_tree(self._nodes, self._table, self._meta, int(self._state[row, 0]))
        self._state[row] = -1
        del self._rows[key]
        self._free_rows.append(row)

    def map_memory(self) -> None:
        """Have the hash table's pages mapped now (once; later calls do nothing).

        The table is allocated lazily, zero pages mapped on first touch, and inserts touch it at
        random: until most pages are mapped, each new n-gram costs a page fault. On a virtual
        machine that is tens of milliseconds over a first prompt; a caller with time to spare
        (an engine starting) pays it here instead. One entry of every page is written back
        with its own value, so what the corpus holds is unchanged.
        """
        if not self._mapped:
            self._settle()
            flat = self._table.reshape(-1)
            stride = max(1, 4096 // flat.itemsize)
            flat[::stride] = flat[::stride].copy()  # a copy: numpy skips assigning a view to itself
            self._mapped = True

    def flush(self, wait: bool = True) -> None:
        """Record every pending token, in the order the tokens were given (one compiled call).

        ``wait=False``: when at least :attr:`BACKGROUND_TOKENS` are pending (a step of a batch,
        a batch of prompts), record them in the corpus's worker thread and return at once; fewer
        are recorded here (handing them over would cost more). While the worker records, a further
        ``flush(wait=False)`` leaves the newer tokens pending (they follow in a later flush, so
        each stream's order holds), and every call that reads or changes the trie waits for the
        worker first (an error it met is raised there).
        """
        if not wait and self.recording:
            return
        self._settle()
        if not self._pending_rows:
            return
        wait = wait or len(self._pending) < self.BACKGROUND_TOKENS
        packed = np.array(self._pending_rows + self._pending_lens + self._pending, np.int64)
        chunks = len(self._pending_rows)
        self._pending_rows, self._pending_lens, self._pending = [], [], []
        args = (self._nodes, self._table, self._meta, self._state, self._sinfo, packed, chunks, self._evict_want)
        if wait:
            trie.insert(*args)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corpus")
            self._worker = self._executor.submit(trie.insert, *args)
            self._worker_tokens = packed.size - 2 * chunks

    @property
    def recording(self) -> bool:
        """True while a background :meth:`flush` is still recording."""
        if self._worker is not None and self._worker.done():
            self._settle()
        return self._worker is not None

    @property
    def backlog(self) -> int:
        """Tokens the background :meth:`flush` still recording was given (0 when none runs)."""
        return self._worker_tokens if self.recording else 0

    def _settle(self) -> None:
        """Wait for a background recording; raise what it met, if anything."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            failure = worker.exception()
            if failure is not None:
                raise RuntimeError("Corpus: recording in the background failed") from failure

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------ queries

    def draft(self, keys: Sequence[Hashable], tree_size: int, mode: str = "bfs", min_match: int = 1,
              max_match: int | None = None, max_breadth: float = 10.0, min_breadth: float = 1.0,
              drafted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draft trees of exactly ``tree_size`` nodes for streams ``keys``.

        Node 0 of each tree is the stream's last token. Nodes are in BFS order (a parent's index
        is below its children's). ``mode="bfs"``: by recency with a breadth schedule,
        ``mode="frequency"``: by path probability (see :func:`trie.draft_bfs` and
        :func:`trie.draft_frequency`). Matches of ``min_match..max_match`` tokens are used,
        longest first (``max_match`` defaults to ``max_depth - 1``). A tree the corpus cannot
        fill is padded with a chain under the root repeating the root's token; ``drafted``, when
        given (int64[B]), receives each tree's node count before padding (1: nothing matched).

        Returns:
            ``(tokens, parents, tree_mask)``: int64[B, D], int64[B, D] (``parents[:, 0]`` is -1)
            and bool[B, D, D] (``tree_mask[b, i, j]`` when node j is node i or its ancestor).
        """
        op = "Corpus.draft"
        D = check_int(op, "tree_size", tree_size, minimum=1)
        top = self.max_depth - 1
        max_match = top if max_match is None else check_int(op, "max_match", max_match, minimum=1)
        check_int(op, "min_match", min_match, minimum=1)
        if not min_match <= max_match <= top:
            raise ContractError(op, "max_match", f"expected min_match <= max_match <= {top}, "
                                f"got {min_match} and {max_match}")
        if mode not in ("bfs", "frequency"):
            raise ContractError(op, "mode", f"expected 'bfs' or 'frequency', got {mode!r}")
        if not 1.0 <= min_breadth <= max_breadth:
            raise ContractError(op, "max_breadth", "expected 1 <= min_breadth <= max_breadth, "
                                f"got {min_breadth} and {max_breadth}")
        rows = np.array([self._row(k) for k in keys], np.int64)
        if drafted is None:
            drafted = np.empty(rows.size, np.int64)
        elif drafted.shape != (rows.size,) or drafted.dtype != np.int64:
            raise ContractError(op, "drafted", f"expected an int64 array of shape ({rows.size},)")
        self.flush()
        tokens = np.empty((rows.size, D), np.int64)
        parents = np.empty((rows.size, D), np.int64)
        mask = np.empty((rows.size, D, D), np.bool_)
        if mode == "bfs":
            empty = trie.draft_bfs(self._nodes, self._state, self._sinfo, rows, min_match, max_match,
                                   float(max_breadth), float(min_breadth), tokens, parents, mask, drafted)
        else:
            empty = trie.draft_frequency(self._nodes, self._state, self._sinfo, rows, min_match,
                                         max_match, tokens, parents, mask, drafted)
        if empty >= 0:
            raise ContractError(op, "keys", f"request {keys[empty]!r} has no tokens: a tree needs a root")
        return tokens, parents, mask

    def match_lengths(self, keys: Sequence[Hashable], min_match: int = 1, max_match: int | None = None) -> np.ndarray:
        """int64[B]: for each stream of ``keys``, the length of the longest suffix (``min_match`` to
        ``max_match`` tokens, as :meth:`draft` takes them) that the trie holds with a continuation:
        the match its next tree starts from; 0 where there is none (the tree would be padding)."""
        top = self.max_depth - 1
        max_match = top if max_match is None else max_match
        rows = np.array([self._row(k) for k in keys], np.int64)
        self.flush()
        out = np.empty(rows.size, np.int64)
        trie.match_lengths(self._nodes, self._state, rows, min_match, min(max_match, top), out)
        return out

    def count(self, ngram: Sequence[int], key: Hashable | None = None) -> int:
        """How often ``ngram`` was recorded (0 when it is not held): in the shared trie, or in
        stream ``key``'s own trie when the corpus is per stream."""
        arr = as_tokens("Corpus.count", "ngram", ngram)
        if self.shared:
            root = self._shared_root
        elif key is None:
            raise ContractError("Corpus.count", "key", "a per-stream corpus needs the stream's key")
        else:
            root = int(self._state[self._row(key), 0])
        self.flush()
        if arr.size == 0 or arr.size > self.max_depth:
            return 0
        node = trie.find_path(self._table, root, arr)
        return int(self._nodes[node, trie.CNT]) if node >= 0 else 0

    def last_match(self, key: Hashable) -> tuple[int, int]:
        """``(length, end)`` of the longest suffix of stream ``key`` that occurred earlier in the
        same stream, ``end`` being the position of that occurrence's last token; ``(0, -1)``
        when there is none. Only defined for per-stream corpora (``shared=False``).
        """
        if self.shared:
            raise ValueError("Corpus.last_match: positions are per stream; use shared=False")
        row = self._row(key)
        self.flush()
        return int(self._sinfo[row, trie.MLEN]), int(self._sinfo[row, trie.MEND])

    # ------------------------------------------------------------------ memory

    @property
    def num_nodes(self) -> int:
        """Live trie nodes (roots included)."""
        self._settle()
        return int(self._meta[trie.LIVE])

    @property
    def nbytes(self) -> int:
        """Bytes of the corpus's arrays: what it holds at capacity (pages are committed as used)."""
        return sum(a.nbytes for a in (self._nodes, self._table, self._meta, self._state, self._sinfo))

    @property
    def bytes_per_node(self) -> float:
        """Array bytes per node of capacity (the row and its share of the hash table)."""
        return (self._nodes.nbytes + self._table.nbytes) / self._nodes.shape[0]

    def arrays(self) -> TrieArrays:
        """The trie's arrays once pending insertions have landed: views, not copies, for
        inspecting the trie (its tests, tools); writing them corrupts the corpus."""
        self._settle()
        return TrieArrays(self._nodes, self._table, self._meta)

    def suffix_nodes(self, key: Hashable) -> np.ndarray:
        """int32[max_depth]: entry d is the node of stream ``key``'s last d tokens (-1 where none
        is recorded; entry 0 unused), as of the last :meth:`flush`."""
        return self._state[self._row(key)].copy()

    # ------------------------------------------------------------------ internals

    def _queue(self, row: int, tokens: list[int]) -> None:
        if tokens:
            self._pending_rows.append(row)
            self._pending_lens.append(len(tokens))
            self._pending.extend(tokens)

    def _row(self, key: Hashable) -> int:
        try:
            return self._rows[key]
        except (KeyError, TypeError):
            raise KeyError(f"unknown request {key!r}") from None

    def _grow_rows(self) -> int:
        row = self._state.shape[0]
        grow = max(8, row)
        self._state = np.concatenate([self._state, np.full((grow, self.max_depth), -1, np.int32)])
        self._sinfo = np.concatenate([self._sinfo, np.zeros((grow, 4), np.int64)])
        self._free_rows.extend(range(row + grow - 1, row, -1))
        return row
