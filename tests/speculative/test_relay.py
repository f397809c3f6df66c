"""OverlapRelay: validation, filter, merge, last tokens; empty batches; no host reads."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.contract import ContractError
from ngram_hal.speculative.relay import OverlapRelay


def _relay(tokens: list[list[int]], lens: list[int], seq_lens: list[int], device="cpu") -> OverlapRelay:
    flat = [t for row in tokens for t in row]
    return OverlapRelay(_index(flat, device), _index(lens, device), _index(seq_lens, device), len(tokens[0]))


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@pytest.fixture
def relay() -> OverlapRelay:
    return _relay([[5, 6, -1], [7, -1, -1], [8, 9, 10]], [2, 1, 3], [12, 4, 30])


def _rows(r: OverlapRelay) -> tuple[list, list, list]:
    return r.accept_tokens.view(-1, r.tree_size).tolist(), r.accept_lens.tolist(), r.new_seq_lens.tolist()


def test_filter_keeps_and_reorders(relay):
    kept = relay.filter(torch.tensor([2, 0]))
    assert _rows(kept) == ([[8, 9, 10], [5, 6, -1]], [3, 2], [30, 12])
    assert kept.tree_size == 3 and kept.batch_size == 2
    assert _rows(relay)[1] == [2, 1, 3], "filter leaves the original as it was"


def test_filter_to_nothing_and_back(relay):
    empty = relay.filter(torch.empty(0, dtype=torch.int64))
    assert empty.batch_size == 0 and empty.accept_tokens.shape == (0,)
    assert _rows(empty.filter(torch.empty(0, dtype=torch.int64))) == ([], [], [])
    assert _rows(empty.merge(relay)) == _rows(relay)
    assert _rows(relay.merge(empty)) == _rows(relay)


def test_merge_appends(relay):
    other = _relay([[1, 2, 3]], [3], [9])
    merged = relay.merge(other)
    assert _rows(merged) == ([[5, 6, -1], [7, -1, -1], [8, 9, 10], [1, 2, 3]], [2, 1, 3, 3], [12, 4, 30, 9])
    assert merged.accept_tokens.is_contiguous() and merged.accept_tokens.dtype == torch.int64


def test_filter_then_merge_is_continuous_batching(relay):
    # Request 1 finished; two new requests join.
    joined = relay.filter(torch.tensor([0, 2])).merge(_relay([[4, -1, -1], [3, 3, -1]], [1, 2], [7, 8]))
    assert _rows(joined)[1:] == ([2, 3, 1, 2], [12, 30, 7, 8])
    assert joined.last_tokens().tolist() == [6, 10, 4, 3]


def test_last_tokens(relay):
    assert relay.last_tokens().tolist() == [6, 7, 10]
    assert OverlapRelay.empty(4, "cpu").last_tokens().shape == (0,)


def test_merge_widens_the_narrower_stride(relay):
    narrow = _relay([[1, 2]], [2], [5])
    assert _rows(relay.merge(narrow)) == ([[5, 6, -1], [7, -1, -1], [8, 9, 10], [1, 2, -1]], [2, 1, 3, 2],
                                          [12, 4, 30, 5])
    first = narrow.merge(relay)
    assert first.tree_size == 3 and _rows(first)[0][0] == [1, 2, -1]
    assert first.last_tokens().tolist() == [2, 6, 7, 10]
    assert _rows(narrow) == ([[1, 2]], [2], [5]), "merge leaves both relays as they were"


def test_widen_and_bad_arguments(relay):
    assert relay.widen(3) is relay
    assert _rows(relay.widen(4))[0][1] == [7, -1, -1, -1]
    with pytest.raises(ContractError, match="tree_size"):
        relay.widen(2)
    with pytest.raises(ContractError, match="other"):
        relay.merge("not a relay")


def test_merge_needs_same_device(relay):
    with pytest.raises(ContractError, match="other"):
        relay.merge(OverlapRelay.empty(3, "meta"))


@pytest.mark.parametrize("bad", [torch.tensor([0], dtype=torch.int32), torch.tensor([[0]]), [0]])
def test_filter_rejects_bad_keep_indices(relay, bad):
    with pytest.raises(ContractError, match="keep_indices"):
        relay.filter(bad)


def test_construction_is_validated():
    tokens, lens = torch.full((6,), -1), torch.ones(2, dtype=torch.int64)
    with pytest.raises(ContractError, match="accept_tokens"):
        OverlapRelay(tokens, lens, lens, 4)
    with pytest.raises(ContractError, match="new_seq_lens"):
        OverlapRelay(tokens, lens, lens.to(torch.int32), 3)
    with pytest.raises(ContractError, match="accept_lens"):
        OverlapRelay(tokens, [1, 1], lens, 3)
    with pytest.raises(ContractError, match="tree_size"):
        OverlapRelay(tokens[:0], lens[:0], lens[:0], 0)


def test_runs_on_meta_tensors():
    """Meta tensors hold no data: filter, merge and last_tokens never read device data."""
    meta = torch.device("meta")
    r = OverlapRelay(torch.empty(12, dtype=torch.int64, device=meta), torch.empty(3, dtype=torch.int64, device=meta),
                     torch.empty(3, dtype=torch.int64, device=meta), 4)
    out = r.filter(torch.empty(2, dtype=torch.int64, device=meta)).merge(r)
    assert out.batch_size == 5 and out.accept_tokens.shape == (20,) and out.device.type == "meta"
    assert out.last_tokens().shape == (5,)
