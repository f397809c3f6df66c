"""Drafters behind one interface: batch format, overlap-pending tokens, prompt lookup, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal.contract import value_tree_mask
from ngram_hal.speculative.drafter import DraftBatch, Drafter, LinearDrafter, TrieDrafter

FAST = settings(max_examples=40, deadline=None)
DRAFTERS = {
    "trie-bfs": lambda: TrieDrafter(max_depth=6),
    "trie-frequency": lambda: TrieDrafter(max_depth=6, mode="frequency"),
    "trie-per-request": lambda: TrieDrafter(max_depth=6, shared=False),
    "linear": lambda: LinearDrafter(max_ngram=4),
}


@pytest.fixture(params=list(DRAFTERS))
def drafter(request) -> Drafter:
    return DRAFTERS[request.param]()


def test_batch_format(drafter):
    drafter.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    drafter.add_request(7, torch.tensor([2, 7, 1, 8, 2, 8], dtype=torch.int64))
    for D in (1, 2, 8):
        batch = drafter.draft(["a", 7], D)
        assert isinstance(batch, DraftBatch) and batch.batch_size == 2 and batch.tree_size == D
        assert batch.tokens.dtype == torch.int64 and batch.tokens.shape == (2 * D,)
        assert batch.tree_mask.dtype == torch.bool and batch.tree_mask.shape == (2, D, D)
        assert batch.tokens.device.type == "cpu" and batch.tree_mask.is_contiguous()
        value_tree_mask("test", "tree_mask", batch.tree_mask)
        assert (batch.tokens >= 0).all()
        assert batch.tokens.view(2, D)[:, 0].tolist() == [5, 8]  # roots: last context tokens


def test_pending_tokens_count_as_context(drafter):
    drafter.add_request("r", [10, 11, 12, 13, 10, 11])
    drafter.extend("r", [12])  # accepted at the last step, not yet written to the request
    drafter.extend("r", [])
    batch = drafter.draft(["r"], 3)
    assert batch.tokens.tolist() == [12, 13, 10]


@FAST
@given(st.lists(st.integers(0, 12), min_size=1, max_size=60), st.lists(st.integers(0, 12), max_size=20))
def test_prepare_changes_no_draft(prompt, more):
    small = [lambda: TrieDrafter(max_depth=6, capacity=4096),
             lambda: TrieDrafter(max_depth=6, mode="frequency", capacity=4096),
             lambda: TrieDrafter(max_depth=6, shared=False, capacity=4096),
             lambda: LinearDrafter(max_ngram=4, capacity=4096)]
    for make in small:
        lazy, eager = make(), make()
        for d in (lazy, eager):
            d.add_request("r", prompt)
        eager.prepare()
        for d in (lazy, eager):
            d.extend("r", more)
        eager.prepare()
        for D in (1, 4, 8):
            a, b = lazy.draft(["r"], D), eager.draft(["r"], D)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tree_mask, b.tree_mask)
            assert torch.equal(a.drafted, b.drafted)


def test_repeated_text_is_drafted_exactly(drafter):
    text = [int(t) for t in np.random.default_rng(3).integers(0, 50, 40)]
    drafter.add_request("r", text + text[:10])
    batch = drafter.draft(["r"], 5)
    tokens, mask = batch.tokens.tolist(), batch.tree_mask[0]
    assert tokens[0] == text[9]
    # The chain of the true continuation is in the tree: node i+1 hangs under node i.
    assert tokens[1:5] == text[10:14]
    assert all(mask[i, i - 1] for i in range(1, 5))


def test_shared_corpus_learns_across_requests():
    shared, alone = TrieDrafter(max_depth=4), TrieDrafter(max_depth=4, shared=False)
    for d in (shared, alone):
        d.add_request("teacher", [1, 2, 3, 4])
        d.add_request("student", [9, 1, 2])
    assert shared.draft(["student"], 3).tokens.tolist() == [2, 3, 4]
    assert alone.draft(["student"], 3).tokens.tolist() == [2, 2, 2]  # padding only


def reference_lookup(context, max_n, D):
    """Textbook prompt lookup: latest earlier occurrence of the longest suffix; periodic copy."""
    n = len(context)
    for length in range(min(max_n, n - 1), 0, -1):
        for end in range(n - 2, length - 2, -1):
            if context[end - length + 1:end + 1] == context[n - length:]:
                period = n - 1 - end
                return [context[-1]] + [context[end + 1 + j % period] for j in range(D - 1)]
    return [context[-1]] * D


@FAST
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=50), steps=st.lists(
    st.lists(st.integers(0, 3), max_size=3), max_size=5), D=st.integers(1, 9))
def test_linear_matches_reference_prompt_lookup(context, steps, D):
    drafter = LinearDrafter(max_ngram=4)
    drafter.add_request("r", context)
    full = list(context)
    assert drafter.draft(["r"], D).tokens.tolist() == reference_lookup(full, 4, D)
    for tokens in steps:
        drafter.extend("r", tokens)
        full += tokens
        assert drafter.draft(["r"], D).tokens.tolist() == reference_lookup(full, 4, D)


def test_linear_min_ngram_pads_short_matches():
    drafter = LinearDrafter(max_ngram=4, min_ngram=2)
    drafter.add_request("r", [1, 2, 3, 9, 3])  # only a 1-token match ("3")
    assert drafter.draft(["r"], 3).tokens.tolist() == [3, 3, 3]
    drafter.extend("r", [9])  # "3 9" matched: copy what followed it
    assert drafter.draft(["r"], 3).tokens.tolist() == [9, 3, 9]


def test_erase_then_reuse_id(drafter):
    drafter.add_request("r", [1, 2, 3])
    drafter.erase("r")
    with pytest.raises(KeyError, match="'r'"):
        drafter.draft(["r"], 2)
    drafter.add_request("r", [4, 5])
    assert drafter.draft(["r"], 1).tokens.tolist() == [5]


def test_errors_leave_the_drafter_usable(drafter):
    drafter.add_request("r", [1, 2, 3, 1, 2])
    before = drafter.draft(["r"], 4).tokens.tolist()
    with pytest.raises(KeyError, match="ghost"):
        drafter.extend("ghost", [1])
    with pytest.raises(KeyError, match="ghost"):
        drafter.draft(["r", "ghost"], 4)
    with pytest.raises(KeyError, match="ghost"):
        drafter.erase("ghost")
    with pytest.raises(ValueError, match="'tokens'.*-1"):
        drafter.extend("r", [3, -1])
    with pytest.raises(ValueError, match="'tokens'"):
        drafter.extend("r", [3.0])
    with pytest.raises(ValueError, match="'prompt'.*-1"):
        drafter.add_request("s", [5, -1])
    with pytest.raises(ValueError, match="'prompt'"):
        drafter.add_request("s", [])
    with pytest.raises(ValueError, match="'tree_size'"):
        drafter.draft(["r"], 0)
    with pytest.raises(ValueError, match="already open"):
        drafter.add_request("r", [1])
    assert drafter.draft(["r"], 4).tokens.tolist() == before
    drafter.add_request("s", [5])  # the failed adds left no trace
    assert drafter.draft(["s"], 1).tokens.tolist() == [5]


def test_trie_settings_are_validated():
    with pytest.raises(ValueError, match="max_match"):
        TrieDrafter(max_depth=4, max_match=4)
    with pytest.raises(ValueError, match="min_breadth"):
        TrieDrafter(max_breadth=2, min_breadth=3)
    with pytest.raises(ValueError, match="mode"):
        TrieDrafter(mode="dfs")
    with pytest.raises(ValueError, match="capacity"):
        TrieDrafter(capacity=8)
    with pytest.raises(ValueError, match="max_ngram"):
        LinearDrafter(max_ngram=1)
    with pytest.raises(ValueError, match="min_ngram"):
        LinearDrafter(max_ngram=3, min_ngram=4)
    assert TrieDrafter(max_depth=4).config.max_match is None


@pytest.mark.parametrize("make", [TrieDrafter, LinearDrafter], ids=["trie", "linear"])
def test_drafted_counts_real_nodes_and_is_one_without_a_match(make):
    """``drafted`` is 1 when nothing matched (the tree is the root plus padding) and counts the
    drafted nodes once the context repeats."""
    drafter = make()
    drafter.add_request("fresh", [1, 2, 3, 4])
    drafter.add_request("repeat", [5, 6, 7, 8, 9, 5, 6])
    batch = drafter.draft(["fresh", "repeat"], 6)
    assert batch.drafted.dtype == torch.int64 and batch.drafted.shape == (2,)
    assert batch.drafted[0].item() == 1
    assert 1 < batch.drafted[1].item() <= 6
    assert batch.tokens.view(2, 6)[1, 1].item() == 7


def test_match_lengths_name_the_suffix_a_draft_continues(drafter):
    """The length of the context suffix the next draft continues: the 3-token suffix 5 6 7
    occurred before (followed by 8), a fresh context matches nothing; pending tokens count."""
    drafter.add_request("fresh", [1, 2, 3, 4])
    drafter.add_request("repeat", [5, 6, 7, 8, 9, 5, 6])
    drafter.extend("repeat", [7])
    assert drafter.match_lengths(["fresh", "repeat"]) == [0, 3]
    assert drafter.draft(["repeat"], 2).tokens.tolist() == [7, 8]
    with pytest.raises(KeyError, match="nobody"):
        drafter.match_lengths(["nobody"])


@FAST
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(0, 5), max_size=10))
def test_a_match_length_of_zero_is_a_draft_of_padding(prompt, more):
    """Every drafter drafts something exactly where it reports a match, and within its limits."""
    for name, make in DRAFTERS.items():
        d = make()
        d.add_request("r", prompt)
        d.extend("r", more)
        (length,) = d.match_lengths(["r"])
        assert 0 <= length <= (4 if name == "linear" else 5)
        assert (length > 0) == (d.draft(["r"], 4).drafted.item() > 1), name
