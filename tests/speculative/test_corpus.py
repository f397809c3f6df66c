"""The n-gram corpus: counts against brute force, match state, draft trees, eviction, erase, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal.contract import value_tree_mask
from ngram_hal.speculative import trie
from ngram_hal.speculative.corpus import Corpus, as_tokens

FAST = settings(max_examples=40, deadline=None)


def ngram_counts(streams, max_depth):
    counts = Counter()
    for s in streams:
        for end in range(len(s)):
            for n in range(1, min(max_depth, end + 1) + 1):
                counts[tuple(s[end - n + 1:end + 1])] += 1
    return counts


def check_tree(tokens, parents, mask):
    """Valid BFS tree per row: parents below children, root parent -1, the mask agrees with the
    parents and passes the contract's tree check."""
    B, D = tokens.shape
    assert parents[:, 0].tolist() == [-1] * B
    for i in range(1, D):
        assert (parents[:, i] >= 0).all() and (parents[:, i] < i).all()
    assert (tokens >= 0).all()
    assert mask.shape == (B, D, D) and mask.dtype == np.bool_
    for b in range(B):
        for i in range(D):
            ancestors, j = {i}, i
            while j > 0:
                j = int(parents[b, j])
                ancestors.add(j)
            assert set(np.flatnonzero(mask[b, i]).tolist()) == ancestors
    value_tree_mask("test", "tree_mask", torch.from_numpy(mask))


def hash_consistent(corpus: Corpus) -> bool:
    nodes, table, meta = corpus.arrays()
    used = int(meta[trie.USED])
    live = 0
    for x in range(used):
        p = int(nodes[x, trie.PAR])
        if p == trie.FREE_PARENT:
            continue
        live += 1
        if p >= 0 and trie.find_path(table, p, nodes[x, trie.TOK:trie.TOK + 1].astype(np.int64)) != x:
            return False
    keys = int((table[:, 0] != trie.EMPTY).sum())
    roots = int((nodes[:used, trie.PAR] == trie.ROOT_PARENT).sum())
    return live == corpus.num_nodes and keys == live - roots


streams_st = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=3)


@FAST
@given(streams=streams_st, max_depth=st.integers(2, 6), chunk=st.integers(1, 7))
def test_counts_match_brute_force_shared(streams, max_depth, chunk):
    corpus = Corpus(max_depth=max_depth)
    for key, s in enumerate(streams):
        corpus.open(key, s[:chunk])
    # Interleave the rest of the streams in chunks, as a batch would.
    pos = [chunk] * len(streams)
    while any(p < len(s) for p, s in zip(pos, streams)):
        for key, s in enumerate(streams):
            corpus.extend(key, s[pos[key]:pos[key] + chunk])
            pos[key] += chunk
    want = ngram_counts(streams, max_depth)
    for gram, n in want.items():
        assert corpus.count(gram) == n
    assert corpus.num_nodes == len(want) + 1  # plus the root
    assert hash_consistent(corpus)


@FAST
@given(streams=streams_st, max_depth=st.integers(2, 5))
def test_per_stream_tries_are_separate(streams, max_depth):
    corpus = Corpus(max_depth=max_depth, shared=False)
    for key, s in enumerate(streams):
        corpus.open(key, s)
    for key, s in enumerate(streams):
        for gram, n in ngram_counts([s], max_depth).items():
            assert corpus.count(gram, key) == n
    assert corpus.num_nodes == sum(len(ngram_counts([s], max_depth)) + 1 for s in streams)


def brute_last_match(s, max_n):
    """Longest suffix (<= max_n) of s with an earlier occurrence; (length, end of latest one)."""
    n = len(s)
    for length in range(min(max_n, n - 1), 0, -1):
        suffix = s[n - length:]
        for end in range(n - 2, length - 2, -1):
            if s[end - length + 1:end + 1] == suffix:
                return length, end
    return 0, -1


@FAST
@given(s=st.lists(st.integers(0, 3), min_size=1, max_size=60), max_depth=st.integers(2, 6),
       split=st.integers(1, 60))
def test_last_match_is_longest_latest_earlier_occurrence(s, max_depth, split):
    corpus = Corpus(max_depth=max_depth, shared=False)
    corpus.open("r", s[:split])
    assert corpus.last_match("r") == brute_last_match(s[:split], max_depth)
    for i in range(split, len(s)):
        corpus.extend("r", [s[i]])
        assert corpus.last_match("r") == brute_last_match(s[: i + 1], max_depth)


def test_bfs_follows_most_recent_continuation():
    corpus = Corpus(max_depth=4)
    corpus.open("r", [1, 2, 7, 9, 1, 2, 8, 9, 1, 2])  # after "1 2": 7 then, more recently, 8
    tokens, parents, mask = corpus.draft(["r"], 3, max_breadth=1, min_breadth=1)
    assert tokens.tolist() == [[2, 8, 9]]
    assert parents.tolist() == [[-1, 0, 1]]
    tokens, parents, mask = corpus.draft(["r"], 4, max_breadth=2, min_breadth=2)
    check_tree(tokens, parents, mask)
    assert tokens[0, :3].tolist() == [2, 8, 7]  # both children, most recent first
    assert parents[0, :3].tolist() == [-1, 0, 0]


def test_frequency_takes_most_probable_path_first():
    corpus = Corpus(max_depth=3)
    corpus.open("r", [5, 1, 3, 5, 1, 3, 5, 1, 4, 5, 1])  # after "5 1": 3 twice, 4 once (latest)
    tokens, parents, mask = corpus.draft(["r"], 3, mode="frequency")
    assert tokens.tolist() == [[1, 3, 4]]
    bfs, _, _ = corpus.draft(["r"], 3, mode="bfs")
    assert bfs[0, 1] == 4  # recency puts the latest first


def test_longer_matches_give_narrower_trees():
    # Suffix "1 2 3" (length 3) was followed by 4 and 5; suffix "3" alone also by 6 and 7.
    corpus = Corpus(max_depth=4)
    corpus.open("r", [1, 2, 3, 4, 1, 2, 3, 5, 0, 3, 6, 0, 3, 7, 0, 1, 2, 3])
    tokens, parents, mask = corpus.draft(["r"], 8, max_match=3, max_breadth=3, min_breadth=1)
    check_tree(tokens, parents, mask)
    children = [tokens[0, i] for i in range(1, 8) if parents[0, i] == 0]
    # Breadth 1 for the length-3 match: only its latest continuation (5); breadth 2 for the
    # length-1 match: its two latest continuations (7, 6) join.
    assert children == [5, 7, 6]  # 4, the oldest continuation of "3", is beyond breadth 2


def test_short_tree_is_padded_with_a_chain_repeating_the_root():
    corpus = Corpus(max_depth=3)
    corpus.open("r", [4, 9])  # nothing ever followed 9
    tokens, parents, mask = corpus.draft(["r"], 5)
    assert tokens.tolist() == [[9, 9, 9, 9, 9]]
    assert parents.tolist() == [[-1, 0, 1, 2, 3]]
    tokens, parents, mask = corpus.draft(["r"], 1)
    assert tokens.tolist() == [[9]] and parents.tolist() == [[-1]]


@FAST
@given(s=st.lists(st.integers(0, 5), min_size=1, max_size=80), D=st.integers(1, 12),
       mode=st.sampled_from(["bfs", "frequency"]), max_depth=st.integers(2, 7))
def test_draft_trees_are_valid_and_paths_were_seen(s, D, mode, max_depth):
    corpus = Corpus(max_depth=max_depth)
    corpus.open("r", s)
    tokens, parents, mask = corpus.draft(["r"], D, mode=mode)
    assert tokens.shape == parents.shape == (1, D) and tokens.dtype == parents.dtype == np.int64
    check_tree(tokens, parents, mask)
    assert tokens[0, 0] == s[-1]
    seen = ngram_counts([s], max_depth)
    for i in range(1, D):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[0, j]))
            j = int(parents[0, j])
        path.reverse()
        padding = all(t == s[-1] for t in path)
        continued = any(tuple(s[len(s) - m:] + path) in seen for m in range(1, max_depth))
        assert continued or padding


def test_batch_of_streams_drafts_each_in_order():
    corpus = Corpus(max_depth=4)
    corpus.open("a", [1, 2, 3, 1, 2])
    corpus.open("b", [7, 8, 7])
    tokens, _, _ = corpus.draft(["b", "a"], 3)
    assert tokens[0, 0] == 7 and tokens[1, 0] == 2
    assert tokens[1, 1] == 3 and tokens[0, 1] == 8


def test_capacity_bounds_nodes_and_evicts_least_recent_leaves():
    rng = np.random.default_rng(0)
    corpus = Corpus(max_depth=4, capacity=256, evict_fraction=1 / 8)
    first = rng.integers(100, 200, 600)
    corpus.open("r", first)
    assert corpus.num_nodes <= 256
    pattern = [1, 2, 3, 4, 5, 6]
    corpus.extend("r", pattern * 3)
    assert corpus.num_nodes <= 256
    assert corpus.count([1, 2, 3, 4]) == 3 and corpus.count([6, 1, 2]) == 2  # recent: kept
    assert sum(corpus.count(first[i:i + 4].tolist()) > 0 for i in range(0, 100)) == 0  # oldest: gone
    assert hash_consistent(corpus)
    tokens, parents, mask = corpus.draft(["r"], 6, max_breadth=1)
    check_tree(tokens, parents, mask)
    assert tokens[0, :4].tolist() == [6, 1, 2, 3]


def test_eviction_never_breaks_live_match_states():
    rng = np.random.default_rng(1)
    corpus = Corpus(max_depth=5, capacity=64, evict_fraction=1 / 4)
    streams = {k: [] for k in range(4)}
    for k in streams:
        corpus.open(k)
    for _ in range(200):
        k = int(rng.integers(0, 4))
        chunk = rng.integers(0, 12, int(rng.integers(1, 5))).tolist()
        streams[k] += chunk
        corpus.extend(k, chunk)
        corpus.flush()
        assert corpus.num_nodes <= 64
        # Each stream's state still points at the nodes of its current suffixes.
        for key, s in streams.items():
            if not s:
                continue
            state = corpus.suffix_nodes(key)
            for depth in range(1, min(len(s), 4) + 1):
                node = int(state[depth])
                if node >= 0:
                    assert trie.find_path(corpus.arrays().table, 0, np.array(s[-depth:], np.int64)) == node
    assert hash_consistent(corpus)


def test_full_corpus_skips_ngrams_instead_of_failing():
    corpus = Corpus(max_depth=8, capacity=64)
    for k in range(7):  # 7 streams pin up to 7 * 7 nodes plus the root
        corpus.open(k, list(range(100 * k, 100 * k + 12)))
    corpus.flush()
    assert corpus.num_nodes <= 64
    tokens, parents, mask = corpus.draft(list(range(7)), 4)
    check_tree(tokens, parents, mask)


def test_erase_shared_keeps_what_was_learned():
    corpus = Corpus(max_depth=3)
    corpus.open("a", [1, 2, 3])
    corpus.extend("a", [1, 2])  # pending until the erase
    corpus.erase("a")
    assert "a" not in corpus and len(corpus) == 0
    assert corpus.count([1, 2]) == 2
    corpus.open("a", [1, 2])  # the id can be reused, and learns from the old request
    tokens, _, _ = corpus.draft(["a"], 2)
    assert tokens.tolist() == [[2, 3]]


def test_erase_per_stream_frees_its_trie():
    corpus = Corpus(max_depth=4, shared=False)
    corpus.open("keep", [1, 2, 3])
    corpus.flush()
    base = corpus.num_nodes
    corpus.open("gone", list(range(50)))
    corpus.flush()
    assert corpus.num_nodes > base + 50
    corpus.extend("gone", [7, 7])
    corpus.erase("gone")
    assert corpus.num_nodes == base
    assert hash_consistent(corpus)
    corpus.open("gone", [5])
    assert corpus.count([5], "gone") == 1 and corpus.count([1, 2], "keep") == 1


def test_errors_name_the_argument_and_change_nothing():
    corpus = Corpus(max_depth=3)
    corpus.open("r", [1, 2])
    with pytest.raises(KeyError, match="nope"):
        corpus.extend("nope", [1])
    with pytest.raises(KeyError, match="nope"):
        corpus.draft(["r", "nope"], 2)
    with pytest.raises(ValueError, match="'tokens'.*-1"):
        corpus.extend("r", [3, -1])
    with pytest.raises(ValueError, match="'tokens'"):
        corpus.extend("r", [3, 1.5])
    with pytest.raises(ValueError, match="'tokens'"):
        corpus.extend("r", [True])
    with pytest.raises(ValueError, match="'tokens'"):
        corpus.extend("r", torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="'tokens'"):
        corpus.open("s", [[1, 2]])
    with pytest.raises(ValueError, match="already open"):
        corpus.open("r", [1])
    with pytest.raises(ValueError, match="'tree_size'"):
        corpus.draft(["r"], 0)
    with pytest.raises(ValueError, match="'mode'"):
        corpus.draft(["r"], 2, mode="dfs")
    with pytest.raises(ValueError, match="'max_match'"):
        corpus.draft(["r"], 2, max_match=3)
    corpus.open("empty")
    with pytest.raises(ValueError, match="no tokens"):
        corpus.draft(["empty"], 2)
    assert "s" not in corpus
    assert corpus.count([3]) == 0 and corpus.count([1, 2]) == 1
    tokens, _, _ = corpus.draft(["r"], 2)
    assert tokens[0, 0] == 2
    corpus.extend("r", torch.tensor([3], dtype=torch.int64))
    corpus.extend("r", np.array([4], np.int32))
    assert corpus.count([2, 3, 4]) == 1


def test_as_tokens_accepts_ints_and_rejects_the_rest():
    assert as_tokens("op", "t", [np.int64(3), 4]).tolist() == [3, 4]
    assert as_tokens("op", "t", []).dtype == np.int64
    for bad in ([-2], [2**31], "ab", 5, [None]):
        with pytest.raises(ValueError, match="op: argument 't'"):
            as_tokens("op", "t", bad)


def test_rebase_keeps_recency_order():
    corpus = Corpus(max_depth=3)
    corpus.open("r", [1, 2, 3, 4, 5])
    corpus.flush()
    nodes, _, meta = corpus.arrays()
    used = int(meta[trie.USED])
    before = nodes[:used, trie.STAMP].copy()
    meta[trie.CLOCK] += trie.CLOCK_KEEP - 1  # as if ~2**30 ticks had passed since
    nodes[1:used, trie.STAMP] += trie.CLOCK_KEEP - 1
    trie.rebase(nodes, meta, used)
    after = nodes[1:used, trie.STAMP]
    assert int(meta[trie.CLOCK]) == trie.CLOCK_KEEP
    assert np.array_equal(np.argsort(after, kind="stable"), np.argsort(before[1:], kind="stable"))
    corpus.extend("r", [6])
    assert corpus.count([5, 6]) == 1


def test_memory_is_sized_by_capacity():
    corpus = Corpus(max_depth=4, capacity=1 << 14)
    assert corpus.bytes_per_node == pytest.approx(64.0)  # a 32-byte row and two 16-byte slots
    before = corpus.nbytes
    corpus.open("r", np.arange(40_000) % 977)
    corpus.flush()
    assert corpus.nbytes <= before + 1024  # no growth: only the stream rows
    assert corpus.num_nodes <= 1 << 14


def test_map_memory_keeps_what_the_corpus_holds():
    text = [int(t) for t in np.random.default_rng(5).integers(0, 30, 200)]
    corpus = Corpus(max_depth=6, capacity=4096)
    corpus.open("a", text)
    before = corpus.draft(["a"], 8)
    counts = [corpus.count(text[i:i + 3]) for i in range(0, 190, 7)]
    table = corpus.arrays().table.copy()
    corpus.map_memory()
    corpus.map_memory()
    assert np.array_equal(corpus.arrays().table, table)
    assert [corpus.count(text[i:i + 3]) for i in range(0, 190, 7)] == counts
    after = corpus.draft(["a"], 8)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("shared", [True, False])
def test_background_recording_matches_recording_in_place(shared):
    """A flush that records in a worker thread (enough tokens pending), with more tokens and new
    streams arriving while it runs, ends with the same counts, drafts and match states as
    synchronous flushes of the same tokens in the same order."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50, 600).tolist() for _ in range(4)]
    steps = [[rng.integers(0, 50, 5).tolist() for _ in range(5)] for _ in range(6)]  # 25 >= 16 tokens a step
    corpora = {wait: Corpus(max_depth=6, shared=shared) for wait in (True, False)}
    for wait, corpus in corpora.items():
        for key, p in enumerate(prompts):
            corpus.open(key, p)
        corpus.flush(wait=wait)
        assert wait or corpus.backlog in (0, 2400)
        for i, step in enumerate(steps):
            if i == 2:
                corpus.open(4, prompts[0][:40])  # a new stream while the worker may run
            for key, toks in enumerate(step[:len(corpus)]):
                corpus.extend(key, toks)
            corpus.flush(wait=wait)
    sync, background = corpora[True], corpora[False]
    background.flush()  # what a draft does first: tokens left pending while the worker ran
    assert background.num_nodes == sync.num_nodes and not background.recording
    keys = list(range(5))
    for got, want in zip(background.draft(keys, 8), sync.draft(keys, 8)):
        assert np.array_equal(got, want)
    gram = prompts[0][10:14]
    assert background.count(gram, None if shared else 0) == sync.count(gram, None if shared else 0) > 0
    assert hash_consistent(background)
