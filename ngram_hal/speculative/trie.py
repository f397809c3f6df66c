"""Compiled kernels of the flat-array n-gram trie behind :class:`ngram_hal.speculative.corpus.Corpus`.

The trie lives in a few numpy arrays so that one compiled call (numba) records the tokens of a
whole batch of streams, or builds the draft trees of a whole batch, with no Python object per
node. Plain Python spends about 10 us per token on the same work (a dict per node and one
update per depth), an order of magnitude over the drafting budget; compiled, a token costs a few
cache misses per depth.

Layout (N allocated node rows, S stream rows, K = max depth):

* ``nodes`` int32[N, 8], one 32-byte row per node: the token, the parent (-1 for a root, -2
  for a free row), the occurrence count (saturating), the first child, the next and previous
  sibling, the clock value of the last visit (for LRU eviction) and the position in its stream
  where the n-gram last ended (-1 before any). Each node's children form a doubly linked list
  kept in recency order (the most recently seen child first).
* ``table`` int64[H, 2]: an open-addressing hash table (linear probing, H a power of two) of
  ``((parent << 32 | token) + 1, child)`` pairs; a key of 0 marks an empty slot, so that a
  zero-filled table (which the OS maps lazily) is an empty one.
* ``meta`` int64[5]: the clock (one tick per token), the number of node rows ever used, the head
  of the free list (linked through the next-sibling field), the number of live nodes, and the
  row where the eviction hand stopped.
* ``state`` int32[S, K]: per stream, the node matching the stream's suffix of length k at column
  k (column 0 holds the stream's root; -1 where there is none).
* ``sinfo`` int64[S, 4]: per stream, the number of tokens seen, the last token, and the longest
  suffix match with an earlier occurrence in the same stream (its length and end position).

When the clock reaches 2**31 - 1 the stamps are rebased (:func:`rebase`), which keeps the order
of the last 2**30 ticks and ties everything older.
"""

from __future__ import annotations

import numpy as np
from numba import njit

TOK, PAR, CNT, FIRST, NEXT, PREV, STAMP, LASTPOS = range(8)
NODE_FIELDS = 8
MAX_COUNT = 2**31 - 1
CLOCK_LIMIT = 2**31 - 1
CLOCK_KEEP = 2**30
CLOCK, USED, FREE, LIVE, HAND = range(5)
SAMPLE = 4096
SWEEP = 8
POS, LAST, MLEN, MEND = range(4)
ROOT_PARENT = -1
FREE_PARENT = -2
EMPTY = 0
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(32)


@njit(cache=True)
def _home(key, mask):
    return np.int64((np.uint64(key) * _GOLDEN) >> _SHIFT) & mask


@njit(cache=True)
def _hash_find(table, key):
    mask = table.shape[0] - 1
    i = _home(key, mask)
    while True:
        k = table[i, 0]
        if k == key:
            return table[i, 1]
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _hash_put(table, key, value):
    mask = table.shape[0] - 1
    i = _home(key, mask)
    while table[i, 0] != EMPTY:
        i = (i + 1) & mask
    table[i, 0] = key
    table[i, 1] = value


@njit(cache=True)
def _hash_delete(table, key):
    mask = table.shape[0] - 1
    i = _home(key, mask)
    while table[i, 0] != key:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        k = table[j, 0]
        if k == EMPTY:
            break
        # Backward shift: the entry at j moves into the hole at i unless its home lies in (i, j].
        if ((j - _home(k, mask)) & mask) >= ((j - i) & mask):
            table[i, 0] = k
            table[i, 1] = table[j, 1]
            i = j
    table[i, 0] = EMPTY


@njit(cache=True)
def _key(parent, token):
    return ((np.int64(parent) << 32) | np.int64(token)) + 1


@njit(cache=True)
def rebase(nodes, meta, used):
    """Shift the clock and every stamp down so that the clock becomes ``CLOCK_KEEP``."""
    shift = meta[CLOCK] - CLOCK_KEEP
    for x in range(used):
        nodes[x, STAMP] = max(np.int64(nodes[x, STAMP]) - shift, 0)
    meta[CLOCK] -= shift


@njit(cache=True)
def _unlink(nodes, x):
    p = nodes[x, PAR]
    prv = nodes[x, PREV]
    nxt = nodes[x, NEXT]
    if prv >= 0:
        nodes[prv, NEXT] = nxt
    else:
        nodes[p, FIRST] = nxt
    if nxt >= 0:
        nodes[nxt, PREV] = prv


@njit(cache=True)
def _link_front(nodes, p, x):
    head = nodes[p, FIRST]
    nodes[x, NEXT] = head
    nodes[x, PREV] = -1
    if head >= 0:
        nodes[head, PREV] = x
    nodes[p, FIRST] = x


@njit(cache=True)
def _release(nodes, meta, x):
    nodes[x, PAR] = FREE_PARENT
    nodes[x, FIRST] = -1
    nodes[x, CNT] = 0
    nodes[x, NEXT] = meta[FREE]
    meta[FREE] = x
    meta[LIVE] -= 1


@njit(cache=True)
def _evictable(nodes, x, clock):
    return nodes[x, PAR] >= 0 and nodes[x, FIRST] < 0 and nodes[x, STAMP] < clock


@njit(cache=True)
def evict(nodes, table, meta, state, want):
    """Free about ``want`` of the least recently visited leaves; returns how many were freed.

    Nodes held by a live stream's match state count as visited now (they are stamped with the
    clock), and nodes visited at the current clock and roots are never freed. The pass estimates,
    from a fixed sample of rows, the stamp below which about ``SWEEP * want`` leaves lie; then a
    hand sweeps the rows from where the last pass stopped and frees the leaves below that stamp
    until ``want`` are freed or every row was seen. Like CLOCK, this approximates LRU while one
    pass reads only about 1/SWEEP of the rows. Returns 0 only when no leaf can be freed.
    """
    used = meta[USED]
    clock = meta[CLOCK]
    for r in range(state.shape[0]):
        for k in range(state.shape[1]):
            x = state[r, k]
            if x >= 0:
                nodes[x, STAMP] = clock
    size = min(used, SAMPLE)
    stamps = np.empty(size, np.int64)
    m = 0
    for i in range(size):
        x = (i * 2654435761 + clock) % used
        if _evictable(nodes, x, clock):
            stamps[m] = nodes[x, STAMP]
            m += 1
    threshold = clock - 1
    if m > 0:
        share = min(1.0, SWEEP * want * size / (m * used))
        k = min(m - 1, int(share * m))
        threshold = np.partition(stamps[:m], k)[k]
    freed = 0
    seen = 0
    hand = meta[HAND]
    while freed < want and seen < used:
        if hand >= used:
            hand = 0
        x = hand
        hand += 1
        seen += 1
        if _evictable(nodes, x, clock) and nodes[x, STAMP] <= threshold:
            _unlink(nodes, x)
            _hash_delete(table, _key(nodes[x, PAR], nodes[x, TOK]))
            _release(nodes, meta, x)
            freed += 1
    meta[HAND] = hand
    return freed


@njit(cache=True)
def _alloc(nodes, table, meta, state, evict_want):
    """A free node row, evicting LRU leaves when every row is in use; -1 when none can be had."""
    if meta[FREE] < 0 and meta[USED] == nodes.shape[0]:
        evict(nodes, table, meta, state, evict_want)
    x = meta[FREE]
    if x >= 0:
        meta[FREE] = nodes[x, NEXT]
    elif meta[USED] < nodes.shape[0]:
        x = meta[USED]
        meta[USED] += 1
    else:
        return -1
    meta[LIVE] += 1
    nodes[x, CNT] = 0
    nodes[x, FIRST] = -1
    nodes[x, NEXT] = -1
    nodes[x, PREV] = -1
    nodes[x, STAMP] = meta[CLOCK]
    nodes[x, LASTPOS] = -1
    return x


@njit(cache=True)
def new_root(nodes, table, meta, state, evict_want):
    """A fresh root node (no parent); -1 when the corpus is full and nothing can be evicted."""
    x = _alloc(nodes, table, meta, state, evict_want)
    if x >= 0:
        nodes[x, TOK] = -1
        nodes[x, PAR] = ROOT_PARENT
    return x


@njit(cache=True)
def _child(nodes, table, meta, state, p, t, evict_want):
    key = _key(p, t)
    c = _hash_find(table, key)
    if c >= 0:
        if nodes[c, PREV] >= 0:
            _unlink(nodes, c)
            _link_front(nodes, p, c)
        return c
    c = _alloc(nodes, table, meta, state, evict_want)
    if c < 0:
        return -1
    nodes[c, TOK] = t
    nodes[c, PAR] = p
    _link_front(nodes, p, c)
    _hash_put(table, key, c)
    return c


@njit(cache=True, nogil=True)
def insert(nodes, table, meta, state, sinfo, packed, chunks, evict_want):
    """Append chunks of tokens to streams, in order.

    ``packed`` int64 holds ``chunks`` stream rows, then the ``chunks`` chunk lengths, then the
    tokens of all chunks back to back (one array: one argument to pass from Python).

    Each token t records, for k = 1..K, the n-gram made of the stream's last k-1 tokens then t:
    the child t of the node at ``state[row, k-1]`` is found or created, moved to the front of its
    siblings, counted, stamped, and becomes the new ``state[row, k]`` (for k < K). On the way the
    longest k whose n-gram had ended earlier in the stream is kept as the stream's match. When a
    node cannot be had (corpus full, nothing evictable) that n-gram is not recorded and the state
    holds -1 at that depth until a shorter suffix grows back into it.
    """
    depth = state.shape[1]
    q = 2 * chunks
    for i in range(chunks):
        r = packed[i]
        for _ in range(packed[chunks + i]):
            t = packed[q]
            q += 1
            if meta[CLOCK] >= CLOCK_LIMIT:
                rebase(nodes, meta, meta[USED])
            clock = meta[CLOCK] + 1
            meta[CLOCK] = clock
            pos = sinfo[r, POS]
            mlen = 0
            mend = -1
            for k in range(depth, 0, -1):
                p = state[r, k - 1]
                c = -1
                if p >= 0:
                    c = _child(nodes, table, meta, state, p, t, evict_want)
                    if c >= 0:
                        if nodes[c, CNT] < MAX_COUNT:
                            nodes[c, CNT] += 1
                        nodes[c, STAMP] = clock
                        if mlen == 0 and nodes[c, LASTPOS] >= 0:
                            mlen = k
                            mend = nodes[c, LASTPOS]
                        nodes[c, LASTPOS] = pos
                if k < depth:
                    state[r, k] = c
            sinfo[r, POS] = pos + 1
            sinfo[r, LAST] = t
            sinfo[r, MLEN] = mlen
            sinfo[r, MEND] = mend


@njit(cache=True)
def find_path(table, root, tokens):
    """The node reached from ``root`` along ``tokens``, or -1 when the path is not recorded."""
    x = root
    for t in tokens:
        x = _hash_find(table, _key(x, t))
        if x < 0:
            return -1
    return x


@njit(cache=True)
def free_tree(nodes, table, meta, root):
    """Free ``root`` and every node below it (used when a per-stream trie is erased)."""
    stack = np.empty(16, np.int64)
    stack[0] = root
    top = 1
    while top > 0:
        top -= 1
        x = stack[top]
        c = nodes[x, FIRST]
        while c >= 0:
            if top == stack.size:
                grown = np.empty(stack.size * 2, np.int64)
                grown[:top] = stack[:top]
                stack = grown
            stack[top] = c
            top += 1
            c = nodes[c, NEXT]
        p = nodes[x, PAR]
        if p >= 0:
            _hash_delete(table, _key(p, nodes[x, TOK]))
        _release(nodes, meta, x)


@njit(cache=True)
def _tree_child(out_tok, out_par, b, n, parent, token):
    for j in range(1, n):
        if out_par[b, j] == parent and out_tok[b, j] == token:
            return j
    return -1


@njit(cache=True)
def _place(out_tok, out_par, b, n, parent, token):
    """Index of the tree node ``token`` under ``parent``: an existing one, else node ``n``."""
    j = _tree_child(out_tok, out_par, b, n, parent, token)
    if j >= 0:
        return j, n
    out_tok[b, n] = token
    out_par[b, n] = parent
    return n, n + 1


@njit(cache=True)
def _finish(out_tok, out_par, out_mask, out_real, b, n):
    """Record that row b holds n drafted nodes (the root included), pad it from node n with a
    chain under the root repeating the root's token, then fill its mask: row i marks node i and
    its ancestors."""
    D = out_tok.shape[1]
    out_real[b] = n
    parent = 0
    for j in range(n, D):
        out_tok[b, j] = out_tok[b, 0]
        out_par[b, j] = parent
        parent = j
    out_mask[b] = False
    out_mask[b, 0, 0] = True
    for i in range(1, D):
        p = out_par[b, i]
        for j in range(i):
            out_mask[b, i, j] = out_mask[b, p, j]
        out_mask[b, i, i] = True


@njit(cache=True)
def _first_empty(sinfo, rows):
    """Index in ``rows`` of the first stream with no tokens yet, or -1."""
    for b in range(rows.size):
        if sinfo[rows[b], POS] == 0:
            return b
    return -1


@njit(cache=True)
def _start_tree(nodes, state, sinfo, rows, b, min_match, max_match, out_tok, out_par, lengths):
    """Root tree ``b`` at its stream's last token; fill ``lengths`` int64[state.shape[1]] with the
    lengths of the stream's matched suffixes whose trie nodes have children, from ``max_match``
    down to ``min_match``, and return how many."""
    r = rows[b]
    out_tok[b, 0] = sinfo[r, LAST]
    out_par[b, 0] = -1
    found = 0
    for m in range(min(max_match, state.shape[1] - 1), min_match - 1, -1):
        node = state[r, m]
        if node >= 0 and nodes[node, FIRST] >= 0:
            lengths[found] = m
            found += 1
    return found


@njit(cache=True)
def match_lengths(nodes, state, rows, min_match, max_match, out):
    """``out[b]`` = the longest suffix of stream ``rows[b]`` (``max_match`` down to ``min_match``
    tokens) whose trie node has children: the match a draft of that stream starts from (0: none,
    the draft is padding)."""
    for b in range(rows.size):
        out[b] = 0
        for m in range(min(max_match, state.shape[1] - 1), min_match - 1, -1):
            node = state[rows[b], m]
            if node >= 0 and nodes[node, FIRST] >= 0:
                out[b] = m
                break


@njit(cache=True)
def draft_bfs(nodes, state, sinfo, rows, min_match, max_match, max_breadth, min_breadth,
              out_tok, out_par, out_mask, out_real):
    """Draft trees breadth-first by recency into ``out_tok``/``out_par`` int64[B, D] and
    ``out_mask`` bool[B, D, D]. Returns -1, or the index of a stream with no tokens (nothing done).

    For each matched suffix, longest first (lengths ``max_match`` down to ``min_match``), the
    subtree under its trie node is walked breadth-first, taking at each node its most recent
    children, at most ``floor(breadth)`` of them (at least one). The breadth starts at
    ``min_breadth + (max_match - m) * s`` for a match of length m, with
    ``s = (max_breadth - min_breadth) / (max_match - min_match + 1)``, and shrinks by s per level:
    longer matches give narrower trees. Paths already in the tree are shared, not repeated. The
    walk stops at D nodes; a tree left short is padded by :func:`_finish`.
    """
    empty = _first_empty(sinfo, rows)
    if empty >= 0:
        return empty
    D = out_tok.shape[1]
    lengths = np.empty(state.shape[1], np.int64)
    scale = (max_breadth - min_breadth) / (max_match - min_match + 1)
    q_tree = np.empty(D, np.int64)
    q_node = np.empty(D, np.int64)
    q_breadth = np.empty(D, np.float64)
    for b in range(rows.size):
        n = 1
        found = _start_tree(nodes, state, sinfo, rows, b, min_match, max_match, out_tok, out_par, lengths)
        for k in range(found):
            if n == D:
                break
            m = lengths[k]
            node = state[rows[b], m]
            q_tree[0] = 0
            q_node[0] = node
            q_breadth[0] = min_breadth + (max_match - m) * scale
            head = 0
            tail = 1
            while head < tail and n < D:
                tp = q_tree[head]
                tn = q_node[head]
                breadth = q_breadth[head]
                head += 1
                width = max(1, int(breadth))
                c = nodes[tn, FIRST]
                taken = 0
                while c >= 0 and taken < width and n < D:
                    j, n = _place(out_tok, out_par, b, n, tp, nodes[c, TOK])
                    if tail < D:
                        q_tree[tail] = j
                        q_node[tail] = c
                        q_breadth[tail] = breadth - scale
                        tail += 1
                    taken += 1
                    c = nodes[c, NEXT]
        _finish(out_tok, out_par, out_mask, out_real, b, n)
    return -1


@njit(cache=True)
def _best_child(nodes, x, below_cnt, below_id):
    """The child of x with the largest (count, -id) strictly below (below_cnt, -below_id)."""
    best = -1
    best_cnt = -1
    c = nodes[x, FIRST]
    while c >= 0:
        cnt = nodes[c, CNT]
        if cnt < below_cnt or (cnt == below_cnt and c > below_id):
            if cnt > best_cnt or (cnt == best_cnt and c < best):
                best = c
                best_cnt = cnt
        c = nodes[c, NEXT]
    return best


@njit(cache=True)
def _children_total(nodes, x):
    total = 0
    c = nodes[x, FIRST]
    while c >= 0:
        total += nodes[c, CNT]
        c = nodes[c, NEXT]
    return total


@njit(cache=True)
def draft_frequency(nodes, state, sinfo, rows, min_match, max_match, out_tok, out_par, out_mask, out_real):
    """Draft trees by path probability; outputs and return value as :func:`draft_bfs`.

    For each matched suffix, longest first, nodes of the subtree under its trie node are taken
    best-first by path probability: the product along the path of
    ``count(child) / sum of count(siblings)``. Ties go to the lower node id. Paths already in the
    tree are shared; a tree left short is padded by :func:`_finish`.
    """
    empty = _first_empty(sinfo, rows)
    if empty >= 0:
        return empty
    D = out_tok.shape[1]
    lengths = np.empty(state.shape[1], np.int64)
    cap = D
    f_tree = np.empty(cap, np.int64)
    f_node = np.empty(cap, np.int64)
    f_prob = np.empty(cap, np.float64)
    f_total = np.empty(cap, np.float64)
    f_best = np.empty(cap, np.int64)
    for b in range(rows.size):
        n = 1
        found = _start_tree(nodes, state, sinfo, rows, b, min_match, max_match, out_tok, out_par, lengths)
        for k in range(found):
            if n == D:
                break
            node = state[rows[b], lengths[k]]
            f_tree[0] = 0
            f_node[0] = node
            f_prob[0] = 1.0
            f_total[0] = _children_total(nodes, node)
            f_best[0] = _best_child(nodes, node, 2147483647, -1)
            size = 1
            while n < D:
                pick = -1
                pick_p = -1.0
                for i in range(size):
                    c = f_best[i]
                    if c >= 0:
                        p = f_prob[i] * nodes[c, CNT] / f_total[i]
                        if p > pick_p:
                            pick = i
                            pick_p = p
                if pick < 0:
                    break
                c = f_best[pick]
                j, n = _place(out_tok, out_par, b, n, f_tree[pick], nodes[c, TOK])
                f_best[pick] = _best_child(nodes, f_node[pick], nodes[c, CNT], c)
                if size < cap and nodes[c, FIRST] >= 0:
                    f_tree[size] = j
                    f_node[size] = c
                    f_prob[size] = pick_p
                    f_total[size] = _children_total(nodes, c)
                    f_best[size] = _best_child(nodes, c, 2147483647, -1)
                    size += 1
        _finish(out_tok, out_par, out_mask, out_real, b, n)
    return -1
