"""The reference tree and verify ops: worked examples, device-genericity, and proof that the
conformance suite's sampling check fails wrong sampling algorithms."""

from __future__ import annotations

import pytest
import torch
from mutants import SAMPLING_MISTAKES, mistaken_sampler

from ngram_hal.reference import CpuBackend
from ngram_hal.reference.tree import reconstruct_tree
from ngram_hal.reference.verify import verify_tree_greedy, verify_tree_sample
from ngram_hal_conformance import cases
from ngram_hal_conformance import test_tree_verify as conf

# 0 -> (1, 2), 1 -> 3, 2 -> (4, 5)
PARENTS = [-1, 0, 0, 1, 2, 2]


def _tree(parents=PARENTS, batch=1):
    mask = conf.mask_of([parents] * batch, "cpu")
    return mask, conf.links_of([parents] * batch, "cpu")


def test_reconstruct_tree_worked_example():
    mask, _ = _tree(batch=2)
    positions, index, first, sibling = reconstruct_tree(mask, torch.tensor([7, 0]))
    assert positions.tolist() == [7, 8, 8, 9, 9, 9, 0, 1, 1, 2, 2, 2]
    assert index.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert first.tolist() == [[1, 3, 4, -1, -1, -1]] * 2
    assert sibling.tolist() == [[-1, 2, -1, -1, 5, -1]] * 2


def test_reconstruct_tree_single_node():
    positions, index, first, sibling = reconstruct_tree(torch.ones(3, 1, 1, dtype=torch.bool), torch.tensor([0, 4, 9]))
    assert positions.tolist() == [0, 4, 9]
    assert index.tolist() == [[0], [1], [2]]
    assert first.tolist() == sibling.tolist() == [[-1]] * 3


def test_verify_tree_greedy_worked_example():
    _, links = _tree(batch=3)
    candidates = torch.tensor([[9, 4, 6, 5, 7, 8]] * 3)
    # Request 0 follows 0 -> 2 -> 5 and gets bonus 3; request 1 rejects at the root; request 2
    # stops at node 1 (its child 3 carries 5, the target wants 2).
    target = torch.tensor([[6, 0, 8, 0, 0, 3], [1, 0, 0, 0, 0, 0], [4, 2, 0, 0, 0, 0]])
    predicts, accept_index, accept_len = verify_tree_greedy(candidates, *links, target)
    assert accept_len.tolist() == [3, 1, 2]
    assert accept_index.tolist() == [[0, 2, 5, -1, -1, -1], [6, -1, -1, -1, -1, -1], [12, 13, -1, -1, -1, -1]]
    assert predicts.tolist() == [6, 0, 8, 0, 0, 3, 1, 0, 0, 0, 0, 0, 4, 2, 0, 0, 0, 0]


def test_verify_tree_greedy_takes_first_matching_sibling():
    _, links = _tree([-1, 0, 0, 1, 2])
    # Both children carry token 4; the walk takes node 1, whose child then matches.
    predicts, accept_index, accept_len = verify_tree_greedy(torch.tensor([[0, 4, 4, 7, 8]]), *links,
                                                            torch.tensor([[4, 7, 8, 1, 2]]))
    assert accept_index.tolist() == [[0, 1, 3, -1, -1]]
    assert predicts[accept_index[0, :3]].tolist() == [4, 7, 1]


def test_verify_tree_sample_worked_example():
    _, links = _tree([-1, 0, 0], batch=3)
    candidates = torch.tensor([[0, 1, 2]] * 3)
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]).expand(3, 3, 3).contiguous()
    # Request 0: node 1 fails (0.5 * 1 < 0.25), node 2 fails (0.5 * 0.75 < 0.25): the bonus
    # comes from [0.5, 0, 0]. Request 1: node 1 fails, node 2 passes (0.25 * 0.75 < 0.25) and
    # its one-hot q gives bonus 2. Request 2: node 1 passes (0.125 * 1 < 0.25), bonus 1.
    coins = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.25], [0.0, 0.125, 0.9]])
    final = torch.tensor([0.99, 0.3, 0.6])
    predicts, accept_index, accept_len = verify_tree_sample(candidates, *links, probs, coins, final)
    assert accept_len.tolist() == [1, 2, 2]
    assert accept_index.tolist() == [[0, -1, -1], [3, 5, -1], [6, 7, -1]]
    committed = [predicts[accept_index[b, :n]].tolist() for b, n in enumerate(accept_len.tolist())]
    assert committed == [[0], [2, 2], [1, 1]]


def test_verify_tree_sample_skips_zero_probability_tokens_in_bonus():
    _, links = _tree([-1])
    probs = torch.tensor([[[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]]])
    for final, want in ((0.0, 2), (0.49, 2), (0.5, 4), (0.999, 4)):
        predicts, _, _ = verify_tree_sample(torch.tensor([[3]]), *links, probs, torch.zeros(1, 1),
                                            torch.tensor([final]))
        assert predicts.tolist() == [want]


@pytest.mark.parametrize("op", ["reconstruct_tree", "verify_tree_greedy", "verify_tree_sample"])
def test_ops_run_on_meta_tensors(op):
    """On the meta device tensors hold no data, so any host read of device data would fail:
    the ops are device-generic and sync-free."""
    call = cases.minimal(op, "meta")
    fn = reconstruct_tree if op == "reconstruct_tree" else {"verify_tree_greedy": verify_tree_greedy,
                                                            "verify_tree_sample": verify_tree_sample}[op]
    for t in fn(**call.args):
        assert t.device.type == "meta" and t.dtype == torch.int64


# ---------------------------------------------------------------- the sampling check can fail

def test_chi_square_passes_the_exact_python_walk():
    assert conf.sample_pvalue(mistaken_sampler(None), "cpu") > conf.SAMPLE_PVALUE_BOUND


@pytest.mark.parametrize("mistake", SAMPLING_MISTAKES)
def test_chi_square_fails_wrong_sampling(mistake):
    assert conf.sample_pvalue(mistaken_sampler(mistake), "cpu") < conf.SAMPLE_PVALUE_BOUND


def test_reference_sampling_follows_target_distribution():
    assert conf.sample_pvalue(CpuBackend().verify_tree_sample, "cpu") > conf.SAMPLE_PVALUE_BOUND
