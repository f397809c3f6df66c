"""Conformance for ``reconstruct_tree``, ``verify_tree_greedy`` and ``verify_tree_sample``.

Contract tier: a non-square mask, probabilities not matching the tree, and an empty batch.
Semantics tier: exact agreement with brute-force Python oracles written from the op docstrings,
on worked examples (the first mismatch ends the walk, the first matching sibling wins, any
topological node order) and over random trees (BFS order, or any order with parents before
children) and small vocabularies so that drafts match. Sampling is checked three ways: exactly, on dyadic probabilities and coins
where every float operation is exact; in the limit of one-hot targets, where it must equal
greedy; and statistically, by a chi-square test of the first two committed tokens against the
target distribution.

The module-level helpers (oracles, strategies, :func:`sample_pvalue`) can be pointed at other
implementations of the ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from . import cases
from .checks import assert_equal, assert_index_output, raises_contract

conformance = pytest.mark.conformance

SAMPLE_PVALUE_BOUND = 1e-6
DYADIC_BITS = 6
COIN_BITS = 10


# ---------------------------------------------------------------- trees and oracles

def tree_mask_of(parents: list[int]) -> list[list[bool]]:
    """``mask[i][j]``: node j is node i or one of its ancestors."""
    D = len(parents)
    mask = [[False] * D for _ in range(D)]
    for i in range(D):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def children_of(parents: list[int], node: int) -> list[int]:
    """Children of ``node`` in sibling (node) order."""
    return [j for j in range(len(parents)) if parents[j] == node]


def oracle_tree(parents: list[int], seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """``(positions, first_child, next_sibling)`` of one tree, -1 for none."""
    D = len(parents)
    positions, first_child, next_sibling = [], [], []
    for i in range(D):
        depth, j = 0, parents[i]
        while j >= 0:
            depth, j = depth + 1, parents[j]
        positions.append(seq_len + depth)
        kids = children_of(parents, i)
        first_child.append(kids[0] if kids else -1)
        later = [j for j in range(i + 1, D) if i > 0 and parents[j] == parents[i]]
        next_sibling.append(later[0] if later else -1)
    return positions, first_child, next_sibling


def oracle_greedy(parents: list[int], tokens: list[int], target: list[int]) -> tuple[list[int], list[int]]:
    """``(accepted nodes, committed tokens)`` of greedy verification of one tree."""
    node, accepted = 0, [0]
    while True:
        match = [j for j in children_of(parents, node) if tokens[j] == target[node]]
        if not match:
            return accepted, [target[n] for n in accepted]
        node = match[0]
        accepted.append(node)


def oracle_sample(parents: list[int], tokens: list[int], probs: list[list[float]], coins: list[float],
                  final: float) -> tuple[list[int], list[int]]:
    """``(accepted nodes, committed tokens)`` of target-only rejection sampling of one tree."""
    node, accepted, committed = 0, [0], []
    while True:
        q = list(probs[node])
        chosen = None
        for j in children_of(parents, node):
            t = tokens[j]
            if coins[j] * sum(q) < q[t]:
                chosen = j
                break
            q[t] = 0.0
        if chosen is None:
            threshold, cdf = final * sum(q), 0.0
            for t, p in enumerate(q):
                cdf += p
                if cdf > threshold:
                    break
            committed.append(t)
            return accepted, committed
        committed.append(tokens[chosen])
        accepted.append(chosen)
        node = chosen


def links_of(parents_batch: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(retrieve_index, retrieve_next_token, retrieve_next_sibling)`` int64[B, D], built by the
    oracle, independent of any backend."""
    B, D = len(parents_batch), len(parents_batch[0])
    trees = [oracle_tree(parents, 0) for parents in parents_batch]
    index = torch.arange(B * D, dtype=torch.int64, device=device).view(B, D)
    return index, cases.index([t[1] for t in trees], device), cases.index([t[2] for t in trees], device)


def floats(values, device) -> torch.Tensor:
    """A float32 tensor on ``device``."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def mask_of(parents_batch: list[list[int]], device) -> torch.Tensor:
    """bool[B, D, D] tree masks."""
    return torch.tensor([tree_mask_of(p) for p in parents_batch], dtype=torch.bool, device=device)


def expected_outputs(accepted: list[list[int]], committed: list[list[int]], D: int
                     ) -> tuple[list[int], list[list[int]], list[int]]:
    """``(predicts, accept_index, accept_len)`` laid out as the verify ops return them."""
    B = len(accepted)
    predicts = [0] * (B * D)
    accept_index = [[-1] * D for _ in range(B)]
    for b in range(B):
        for j, (node, tok) in enumerate(zip(accepted[b], committed[b])):
            predicts[b * D + node] = tok
            accept_index[b][j] = b * D + node
    return predicts, accept_index, [len(a) for a in accepted]


def assert_verify_outputs(got, want, device, what: str) -> None:
    assert isinstance(got, tuple) and len(got) == 3, f"{what} returns (predicts, accept_index, accept_len)"
    predicts, accept_index, accept_len = want
    B, D = len(accept_index), len(accept_index[0])
    for t, name, shape in zip(got, ("predicts", "accept_index", "accept_len"), ((B * D,), (B, D), (B,))):
        assert_index_output(t, device, shape, f"{what} {name}")
    assert_equal(got[2], accept_len, f"{what} accept_len")
    assert_equal(got[1], accept_index, f"{what} accept_index")
    assert_equal(got[0], predicts, f"{what} predicts")


@st.composite
def parent_lists(draw, tree_size: int, bfs: bool) -> list[int]:
    """A tree of ``tree_size`` nodes as a parent list; parents precede children, BFS when asked
    (then parents are non-decreasing)."""
    parents = [-1]
    for i in range(1, tree_size):
        low = parents[-1] if bfs and i > 1 else 0
        parents.append(draw(st.integers(low, i - 1)))
    return parents


@st.composite
def tree_batches(draw, max_batch: int = 8, max_nodes: int = 16) -> list[list[int]]:
    """B in 1..max_batch trees of one D in 1..max_nodes."""
    B = draw(st.integers(1, max_batch), label="B")
    D = draw(st.integers(1, max_nodes), label="D")
    bfs = draw(st.booleans(), label="bfs")
    return [draw(parent_lists(D, bfs)) for _ in range(B)]


@st.composite
def greedy_cases(draw) -> tuple[list[list[int]], list[int], list[int]]:
    """Trees, node tokens and target argmaxes over a vocabulary of 1..4 tokens (flat, B*D)."""
    parents = draw(tree_batches())
    n = len(parents) * len(parents[0])
    vocab = draw(st.integers(1, 4), label="vocab")
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n), label="tokens")
    target = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n), label="target")
    return parents, tokens, target


def dyadic_inputs(rng: np.random.Generator, B: int, D: int, V: int):
    """Probabilities that are multiples of ``2**-DYADIC_BITS`` (some zero, rows summing to 1) and
    coins that are multiples of ``2**-COIN_BITS``: every sum, product and comparison the
    sampling rule makes is then exact in float32, whatever the order of operations."""
    units = 2 ** DYADIC_BITS
    counts = np.zeros((B, D, V), dtype=np.int64)
    for b in range(B):
        for i in range(D):
            support = np.flatnonzero(rng.random(V) < 0.7)
            if support.size == 0:
                support = np.array([rng.integers(V)])
            np.add.at(counts[b, i], rng.choice(support, size=units), 1)
    coins = rng.integers(0, 2 ** COIN_BITS, size=(B, D)) / 2 ** COIN_BITS
    final = rng.integers(0, 2 ** COIN_BITS, size=B) / 2 ** COIN_BITS
    return counts / units, coins, final


# ---------------------------------------------------------------- chi-square check of sampling

# A fixed tree with several children per node, a token repeated among the root's children,
# drafts that are the target's argmax and no zero probabilities, so that common mistakes
# (accepting an argmax draft outright, not renormalising after a rejection, drawing the bonus
# from the unreduced distribution, trying a rejected token again) move the distribution.
STAT_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2, 5]
STAT_TOKENS = [5, 0, 1, 0, 2, 3, 0, 4, 5]
STAT_PROBS = [
    [0.30, 0.25, 0.05, 0.10, 0.20, 0.10],
    [0.15, 0.05, 0.10, 0.40, 0.20, 0.10],
    [0.10, 0.10, 0.20, 0.05, 0.35, 0.20],
    [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    [0.20, 0.20, 0.20, 0.15, 0.15, 0.10],
    [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
    [0.30, 0.10, 0.20, 0.10, 0.20, 0.10],
    [0.25, 0.15, 0.05, 0.20, 0.15, 0.20],
    [0.10, 0.10, 0.20, 0.30, 0.20, 0.10],
]
STAT_DRAWS = 8000


def stat_expected() -> torch.Tensor:
    """float64[V, V+1]: probability of committing first token t1 then t2 (column t2 + 1), or t1
    alone (column 0) when t1 is not a draft and the step ends there."""
    V = len(STAT_PROBS[0])
    expected = torch.zeros(V, V + 1, dtype=torch.float64)
    node_of: dict[int, int] = {}
    for j in children_of(STAT_PARENTS, 0):
        node_of.setdefault(STAT_TOKENS[j], j)
    for t1, p1 in enumerate(STAT_PROBS[0]):
        if t1 in node_of:
            expected[t1, 1:] = p1 * torch.tensor(STAT_PROBS[node_of[t1]], dtype=torch.float64)
        else:
            expected[t1, 0] = p1
    return expected


def sample_pvalue(verify_sample, device, seed: int = 1234) -> float:
    """Chi-square p-value of the first two committed tokens against the target distribution.

    ``verify_sample`` has the signature of ``Backend.verify_tree_sample``; it runs on
    STAT_DRAWS copies of the fixed tree with independent coins. An outcome outside the
    distribution's support gives 0.
    """
    N, D, V = STAT_DRAWS, len(STAT_PARENTS), len(STAT_PROBS[0])
    gen = torch.Generator().manual_seed(seed)
    index, first, sibling = links_of([STAT_PARENTS], device)
    offsets = torch.arange(N, dtype=torch.int64, device=device).unsqueeze(1) * D
    predicts, accept_index, accept_len = verify_sample(
        cases.index(STAT_TOKENS, device).expand(N, D).contiguous(), (index + offsets).contiguous(),
        first.expand(N, D).contiguous(), sibling.expand(N, D).contiguous(),
        torch.tensor(STAT_PROBS, dtype=torch.float32, device=device).expand(N, D, V).contiguous(),
        torch.rand((N, D), generator=gen).to(device), torch.rand((N,), generator=gen).to(device))
    tokens = predicts[accept_index[:, :2].clamp(min=0)].cpu()
    lens = accept_len.cpu()
    cell = tokens[:, 0] * (V + 1) + torch.where(lens >= 2, tokens[:, 1] + 1, 0)
    if bool(((tokens < 0) | (tokens >= V)).any()):
        return 0.0
    observed = torch.bincount(cell, minlength=V * (V + 1)).double()
    expected = stat_expected().reshape(-1) * N
    support = expected > 0
    if bool((observed[~support] > 0).any()):
        return 0.0
    stat = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------- the calls the other tiers run

def _chain_links(device) -> dict[str, torch.Tensor]:
    """Two requests, each a 3-node chain tree: its candidates and retrieve links."""
    return {"candidates": cases.index([[5, 6, 7], [1, 2, 3]], device),
            "retrieve_index": cases.index([[0, 1, 2], [3, 4, 5]], device),
            "retrieve_next_token": cases.index([[1, 2, -1], [1, 2, -1]], device),
            "retrieve_next_sibling": cases.index([[-1, -1, -1], [-1, -1, -1]], device)}


@cases.minimal_call("reconstruct_tree")
def _minimal_reconstruct(rng, device, page_size, dtype):
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3).contiguous().to(device)
    return cases.Call("reconstruct_tree", {"tree_mask": chain, "seq_lens": cases.index([4, 0], device)})


@cases.minimal_call("verify_tree_greedy")
def _minimal_greedy(rng, device, page_size, dtype):
    return cases.Call("verify_tree_greedy", {**_chain_links(device),
                                             "target_predict": cases.index([[6, 9, 4], [0, 0, 0]], device)})


@cases.minimal_call("verify_tree_sample")
def _minimal_sample(rng, device, page_size, dtype):
    return cases.Call("verify_tree_sample", {**_chain_links(device),
                                             "target_probs": torch.full((2, 3, 8), 1 / 8, device=device),
                                             "uniform_samples": torch.full((2, 3), 0.5, device=device),
                                             "uniform_final": torch.full((2,), 0.25, device=device)})


TIMED_VOCAB, TIMED_SAMPLE_BATCH = 32000, 8


def _timed_links(backend, batch: int, depth: int, device):
    """The retrieve links of ``batch`` trees: a root with two children, then chains below them."""
    parents = [-1, 0, 0] + [i - 2 for i in range(3, depth)]
    tree = backend.reconstruct_tree(mask_of([parents] * batch, device),
                                    torch.zeros(batch, dtype=torch.int64, device=device))
    return tree[1:]


@cases.timed_call("reconstruct_tree")
def _timed_reconstruct(rng, backend, device):
    B, D = cases.TIMED_BATCH, cases.TIMED_NODES
    chains = torch.ones(D, D, dtype=torch.bool, device=device).tril().expand(B, D, D).contiguous()
    return (cases.Call("reconstruct_tree", {"tree_mask": chains, "seq_lens": torch.full(
                (B,), cases.TIMED_CONTEXT, dtype=torch.int64, device=device)}),
            f"{B} trees of {D} nodes")


@cases.timed_call("verify_tree_greedy")
def _timed_greedy(rng, backend, device):
    B, D = cases.TIMED_BATCH, cases.TIMED_NODES
    links = _timed_links(backend, B, D, device)
    tokens = torch.randint(0, 4, (B, D), generator=torch.Generator().manual_seed(3)).to(device)
    return (cases.Call("verify_tree_greedy", {
                "candidates": tokens, "retrieve_index": links[0], "retrieve_next_token": links[1],
                "retrieve_next_sibling": links[2], "target_predict": tokens.roll(-1, 1).contiguous()}),
            f"{B} trees of {D} nodes")


@cases.timed_call("verify_tree_sample")
def _timed_sample(rng, backend, device):
    B, D, V = TIMED_SAMPLE_BATCH, cases.TIMED_NODES, TIMED_VOCAB
    links = _timed_links(backend, B, D, device)
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(B, D, V, generator=gen), -1).to(device)
    return (cases.Call("verify_tree_sample", {
                "candidates": torch.randint(0, V, (B, D), generator=gen).to(device),
                "retrieve_index": links[0], "retrieve_next_token": links[1], "retrieve_next_sibling": links[2],
                "target_probs": probs, "uniform_samples": torch.rand(B, D, generator=gen).to(device),
                "uniform_final": torch.rand(B, generator=gen).to(device)}),
            f"{B} trees of {D} nodes, vocabulary {V}")


# ---------------------------------------------------------------- contract
# (Dtype, rank, size, layout and device of every argument: test_contract.py; malformed trees
# and links in strict mode: test_strict.py.)

TREE_OPS = [pytest.param(op, marks=conformance(op=op))
            for op in ("reconstruct_tree", "verify_tree_greedy", "verify_tree_sample")]


@conformance(op="reconstruct_tree", tier="contract")
def test_reconstruct_tree_needs_square_mask(backend, device):
    call = cases.minimal("reconstruct_tree", device)
    with raises_contract("reconstruct_tree", "tree_mask"):
        call.replace(tree_mask=call.args["tree_mask"][:, :, :2].contiguous()).run(backend)


@conformance(op="verify_tree_sample", tier="contract")
def test_verify_tree_sample_needs_matching_probs(backend, device):
    call = cases.minimal("verify_tree_sample", device)
    with raises_contract("verify_tree_sample", "target_probs"):
        call.replace(target_probs=call.args["target_probs"][:, :2].contiguous()).run(backend)


def _assert_outputs(op: str, out, device, B: int, D: int) -> None:
    shapes = [(B * D,), (B, D), (B, D), (B, D)] if op == "reconstruct_tree" else [(B * D,), (B, D), (B,)]
    assert isinstance(out, tuple) and len(out) == len(shapes), f"{op} returns {len(shapes)} tensors"
    for i, (t, shape) in enumerate(zip(out, shapes)):
        assert_index_output(t, device, shape, f"{op} output {i}")


@conformance(tier="contract")
@pytest.mark.parametrize("op", TREE_OPS)
def test_empty_batch(backend, device, op):
    """B = 0 is valid and gives empty outputs."""
    call = cases.minimal(op, device)
    D = call.args["tree_mask" if op == "reconstruct_tree" else "candidates"].shape[1]
    empty = call.replace(**{name: value[:0].contiguous() for name, value in call.args.items()})
    _assert_outputs(op, empty.run(backend), device, 0, D)


# ---------------------------------------------------------------- semantics

@conformance(op="reconstruct_tree", tier="semantics")
@given(parents=tree_batches(), data=st.data())
def test_reconstruct_tree_matches_oracle(backend, device, parents, data):
    B, D = len(parents), len(parents[0])
    seq_lens = data.draw(st.lists(st.integers(0, 4096), min_size=B, max_size=B), label="seq_lens")
    got = backend.reconstruct_tree(mask_of(parents, device), cases.index(seq_lens, device))
    want = [oracle_tree(p, s) for p, s in zip(parents, seq_lens)]
    assert_equal(got[0], [x for w in want for x in w[0]], "positions")
    assert_equal(got[1], [[b * D + i for i in range(D)] for b in range(B)], "retrieve_index")
    assert_equal(got[2], [w[1] for w in want], "retrieve_next_token")
    assert_equal(got[3], [w[2] for w in want], "retrieve_next_sibling")


# Trees whose nodes are in a topological order other than BFS: siblings are not adjacent.
NON_BFS_TREES = {"depth_first": [-1, 0, 1, 1, 0, 4], "interleaved": [-1, 0, 0, 2, 1, 2, 3]}


@conformance(op="reconstruct_tree", tier="semantics")
@pytest.mark.parametrize("name", sorted(NON_BFS_TREES))
def test_reconstruct_tree_any_topological_order(backend, device, name):
    """Parents before children is the only order rule: the next sibling is the next node with the
    same parent, wherever it stands, and depth counts ancestors, not BFS levels."""
    parents = NON_BFS_TREES[name]
    D = len(parents)
    got = backend.reconstruct_tree(mask_of([parents], device), cases.index([10], device))
    positions, first_child, next_sibling = oracle_tree(parents, 10)
    assert_equal(got[0], positions, f"{name}: positions")
    assert_equal(got[1], [list(range(D))], f"{name}: retrieve_index")
    assert_equal(got[2], [first_child], f"{name}: retrieve_next_token")
    assert_equal(got[3], [next_sibling], f"{name}: retrieve_next_sibling")


# name: (parents, tokens, target argmax at each node, accepted nodes, committed tokens)
GREEDY_EXAMPLES = {
    # The root's child does not match: the walk ends there, whatever its descendants hold.
    "stops_at_first_mismatch": ([-1, 0, 1, 2], [9, 5, 6, 7], [4, 6, 7, 8], [0], [4]),
    # Two children carry the matching token: the first in sibling order is taken.
    "first_matching_sibling": ([-1, 0, 0, 1, 2], [9, 5, 5, 3, 4], [5, 3, 4, 1, 1], [0, 1, 3], [5, 3, 1]),
    # A later sibling matches after earlier ones do not.
    "later_sibling": ([-1, 0, 0, 0], [9, 1, 2, 3], [3, 0, 0, 6], [0, 3], [3, 6]),
    # Every draft accepted: the bonus token is the target's token after the leaf.
    "whole_chain": ([-1, 0, 1], [9, 5, 6], [5, 6, 7], [0, 1, 2], [5, 6, 7]),
}


@conformance(op="verify_tree_greedy", tier="semantics")
@pytest.mark.parametrize("name", sorted(GREEDY_EXAMPLES))
def test_verify_tree_greedy_worked_examples(backend, device, name):
    parents, tokens, target, accepted, committed = GREEDY_EXAMPLES[name]
    D = len(parents)
    got = backend.verify_tree_greedy(cases.index([tokens], device), *links_of([parents], device),
                                     cases.index([target], device))
    assert_verify_outputs(got, expected_outputs([accepted], [committed], D), device, name)


@conformance(op="verify_tree_greedy", tier="semantics")
@given(case=greedy_cases())
def test_verify_tree_greedy_matches_oracle(backend, device, case):
    parents, tokens, target = case
    B, D = len(parents), len(parents[0])
    walks = [oracle_greedy(p, tokens[b * D:(b + 1) * D], target[b * D:(b + 1) * D]) for b, p in enumerate(parents)]
    got = backend.verify_tree_greedy(cases.index(tokens, device).view(B, D), *links_of(parents, device),
                                     cases.index(target, device).view(B, D))
    assert_verify_outputs(got, expected_outputs([w[0] for w in walks], [w[1] for w in walks], D), device, "greedy")


@conformance(op="verify_tree_sample", tier="semantics")
@given(parents=tree_batches(), vocab=st.integers(1, 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_verify_tree_sample_matches_oracle_on_dyadic_inputs(backend, device, parents, vocab, seed, data):
    """Exact agreement, ties of ``u * sum(q) == q[t]`` included (they reject)."""
    B, D = len(parents), len(parents[0])
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=B * D, max_size=B * D), label="tokens")
    probs, coins, final = dyadic_inputs(np.random.default_rng(seed), B, D, vocab)
    walks = [oracle_sample(p, tokens[b * D:(b + 1) * D], probs[b].tolist(), coins[b].tolist(), float(final[b]))
             for b, p in enumerate(parents)]
    got = backend.verify_tree_sample(cases.index(tokens, device).view(B, D), *links_of(parents, device),
                                     floats(probs, device), floats(coins, device), floats(final, device))
    assert_verify_outputs(got, expected_outputs([w[0] for w in walks], [w[1] for w in walks], D), device, "sample")


@conformance(op=["verify_tree_greedy", "verify_tree_sample"], tier="semantics")
@given(case=greedy_cases(), seed=st.integers(0, 2**32 - 1))
def test_verify_tree_sample_with_one_hot_target_is_greedy(backend, device, case, seed):
    parents, tokens, target = case
    B, D = len(parents), len(parents[0])
    candidates, predict = cases.index(tokens, device).view(B, D), cases.index(target, device).view(B, D)
    links = links_of(parents, device)
    one_hot = torch.nn.functional.one_hot(predict, 4).to(torch.float32).contiguous()
    gen = torch.Generator().manual_seed(seed)
    coins, final = torch.rand((B, D), generator=gen).to(device), torch.rand((B,), generator=gen).to(device)
    greedy = backend.verify_tree_greedy(candidates, *links, predict)
    sampled = backend.verify_tree_sample(candidates, *links, one_hot, coins, final)
    for name, g, s in zip(("predicts", "accept_index", "accept_len"), greedy, sampled):
        assert_equal(s, g, f"one-hot sample vs greedy: {name}")


@conformance(op="verify_tree_sample", tier="semantics")
def test_verify_tree_sample_follows_target_distribution(backend, device):
    pvalue = sample_pvalue(backend.verify_tree_sample, device)
    assert pvalue > SAMPLE_PVALUE_BOUND, f"committed tokens deviate from the target distribution (p = {pvalue:.3g})"
