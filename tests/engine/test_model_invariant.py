"""The reference backend's batch-invariant mode at the model level (float32 on the CPU): a row's
logits do not depend on the rows sharing its forward, and a draft-tree node's logits are those of
plain decoding along its path once accepted. The mode is built for this (each query attends alone
over fixed key columns in contiguous blocks, every product runs the panels' compiled kernel), so
these tests compare bits; the default mode is not, and they compare nothing about it."""

from __future__ import annotations

import pytest
import torch
from tiny_model import TINY, Session

from ngram_hal.engine.model import LlamaModel, random_weights
from ngram_hal.reference import CpuBackend

PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40, 41], [1, 8, 8, 8, 8, 8, 8, 8, 8, 2, 11]]
PARENTS = [-1, 0, 0, 1, 2, 1, 3, 4, 6]
SPARE_ROW = 7


def _session(seed: int = 0) -> Session:
    model = LlamaModel(TINY, random_weights(TINY, seed=5), CpuBackend(), torch.float32, batch_invariant=True)
    return Session(model, seed)


def _path(i: int) -> list[int]:
    """Node i's path from the root."""
    path = [i]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def test_rows_do_not_depend_on_the_batch():
    """Prefill and decode logits of request 0 alone equal its logits in a batch of three (its
    slots scattered differently, so that only its own keys are the same)."""
    alone, batched = _session(seed=1), _session(seed=2)
    prefill_alone = alone.extend([(0, PROMPTS[0])])
    prefill_batched = batched.extend([(1, PROMPTS[1]), (0, PROMPTS[0]), (2, PROMPTS[2])])
    n1 = len(PROMPTS[1])
    assert torch.equal(prefill_alone, prefill_batched[n1:n1 + len(PROMPTS[0])])
    one = alone.extend([(0, [3])])
    many = batched.extend([(1, [9]), (0, [3]), (2, [8])])
    assert torch.equal(one[0], many[1])


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["one-request", "three-requests"])
def test_tree_nodes_equal_plain_decoding_of_their_path(rows):
    """Each node of a branching tree gives the logits that a forward of its path's tokens, after
    the same prefix, gives at its last token."""
    s = _session()
    s.extend(list(enumerate(PROMPTS)))
    D = len(PARENTS)
    tokens = [[(7 * r + 3 * i) % TINY.vocab_size for i in range(D)] for r in rows]
    tree = s.tree(rows, tokens, PARENTS)
    for b, row in enumerate(rows):
        for i in range(D):
            s.fork(row, SPARE_ROW)
            plain = s.extend([(SPARE_ROW, [tokens[b][j] for j in _path(i)])])
            assert torch.equal(tree[b * D + i], plain[-1]), f"request {row}, node {i} (path {_path(i)})"


def test_a_chain_as_a_causal_extend_gives_the_bits_of_its_path():
    """A chain told as such (``ForwardBatch.chains``: attention as a causal extend) gives the bits
    of the same chain read node by node along its path, and of plain decoding."""
    chain = list(range(-1, 6))
    rows = [0, 1, 2]
    tokens = [[(5 * r + 2 * i) % TINY.vocab_size for i in range(len(chain))] for r in rows]
    told, untold = _session(), _session()
    for s in (told, untold):
        s.extend(list(enumerate(PROMPTS)))
    by_extend = told.tree(rows, tokens, chain, chains=True)
    assert torch.equal(by_extend, untold.tree(rows, tokens, chain))
    for b, row in enumerate(rows):
        told.fork(row, SPARE_ROW)
        plain = told.extend([(SPARE_ROW, tokens[b])])
        assert torch.equal(by_extend[b * len(chain):(b + 1) * len(chain)], plain)


def test_the_mode_needs_float32_on_the_cpu():
    with pytest.raises(ValueError, match="float32 on the CPU"):
        CpuBackend().layer_kernels(TINY, torch.bfloat16, batch_invariant=True)
