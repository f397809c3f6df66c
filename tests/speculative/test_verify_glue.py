"""Verify glue end to end on a real KV cache, request table and slot allocator, against a fake
target whose next token is a fixed function of the last two tokens."""

from __future__ import annotations

import random

import pytest
import torch

from ngram_hal.contract import ContractError
from ngram_hal.kv_cache import KVCache
from ngram_hal.memory import ReqToTokenPool, SlotAllocator
from ngram_hal.reference import CpuBackend
from ngram_hal.speculative.relay import OverlapRelay
from ngram_hal.speculative.verify import (TreeBatch, commit, prepare_tree, slots_needed, tree_cache_locs, verify_greedy,
                                   verify_sample)
from ngram_hal_conformance.test_tree_verify import mask_of

VOCAB = 50
LAYERS, HEADS, HEAD_DIM = 2, 2, 4
# Node 0 the root; 1, 2, 3 its children; 4 under 1; 5, 6 under 2; 7 under 5. The right path,
# when the draft has it, runs 0 -> 2 -> 5 -> 7; every other node carries a wrong token.
PARENTS = [-1, 0, 0, 0, 1, 2, 2, 5]
D = len(PARENTS)
RIGHT_PATH = [2, 5, 7]


def next_token(context: list[int]) -> int:
    """The fake target's greedy choice after ``context``."""
    return (7 * context[-1] + 3 * context[-2] + 1) % VOCAB


def greedy_continuation(context: list[int], n: int) -> list[int]:
    out = list(context)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(context):]


def _index(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def kv_row(token: int, position: int) -> torch.Tensor:
    """The K (and, negated, V) a layer holds for ``token`` at ``position``: [L, H, d], exact in float32."""
    layer = torch.arange(LAYERS, dtype=torch.float32).view(LAYERS, 1, 1) * 2**20
    return (layer + token * 1024 + position).expand(LAYERS, HEADS, HEAD_DIM)


class Harness:
    """B requests decoded by speculation through the glue, with a host-side record of each."""

    def __init__(self, prompts: list[list[int]], page_size: int, rng: random.Random):
        self.backend = CpuBackend(strict=True)
        self.kv = KVCache(LAYERS, 256, HEADS, HEAD_DIM)
        self.pool = ReqToTokenPool(8, 128)
        self.alloc = SlotAllocator(self.backend, 256, page_size)
        self.rng = rng
        self.pool.alloc()  # so request b does not sit in row b
        self.rows = [self.pool.alloc() for _ in prompts]
        self.tokens = [list(p) for p in prompts]
        # The last token of each prompt is the first root; its KV is written by the first step.
        self.seq_lens = [len(p) - 1 for p in prompts]
        self.allocated = list(self.seq_lens)
        for b, n in enumerate(self.seq_lens):
            locs = self.alloc.alloc(n)
            self.pool.req_to_token[self.rows[b], :n] = locs
            self._store(locs, self.tokens[b][:n], list(range(n)))

    def _store(self, locs: torch.Tensor, tokens: list[int], positions: list[int]) -> None:
        rows = torch.stack([kv_row(t, p) for t, p in zip(tokens, positions)], dim=1)
        for layer in range(LAYERS):
            self.backend.store_kv(self.kv, layer, locs, rows[layer].contiguous(), (-rows[layer]).contiguous())

    def reserve(self) -> None:
        """Extend the requests short of slots for this step's tree, as the engine does."""
        need = [slots_needed(s, a, D) for s, a in zip(self.seq_lens, self.allocated)]
        grow = [b for b in range(len(self.rows)) if need[b]]
        if not grow:
            return
        start = [self.allocated[b] for b in grow]
        end = [self.allocated[b] + need[b] for b in grow]
        table = self.pool.req_to_token
        last = [int(table[self.rows[b], n - 1]) if n else -1 for b, n in zip(grow, start)]
        locs = self.alloc.alloc_extend(_index(start), _index(end), _index(last), start, end)
        self.backend.assign_req_to_token(table, _index([self.rows[b] for b in grow]), _index(start), _index(end),
                                         locs)
        for b, n in zip(grow, end):
            self.allocated[b] = n

    def draft(self, right: list[int]) -> tuple[list[int], list[list[int]]]:
        """Draft tokens of every request's tree, the right path holding ``right[b]`` true tokens."""
        drafts, truth = [], []
        for b, depth in enumerate(right):
            true = greedy_continuation(self.tokens[b], 4)
            tree = [self.tokens[b][-1]]
            for node in range(1, D):
                level = self._depth(node) - 1
                wrong = (true[level] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
                on_path = node in RIGHT_PATH[:depth]
                tree.append(true[level] if on_path else wrong)
            drafts.extend(tree)
            truth.append(true)
        return drafts, truth

    @staticmethod
    def _depth(node: int) -> int:
        depth = 0
        while PARENTS[node] >= 0:
            node, depth = PARENTS[node], depth + 1
        return depth

    def target_logits(self, drafts: list[int]) -> torch.Tensor:
        """float[B*D, V]: the fake target's scores after each node (its path as the context)."""
        logits = torch.randn(len(drafts), VOCAB, generator=torch.Generator().manual_seed(len(drafts)))
        for b in range(len(self.rows)):
            for node in range(D):
                path, n = [], node
                while n > 0:
                    path.append(drafts[b * D + n])
                    n = PARENTS[n]
                logits[b * D + node, next_token(self.tokens[b] + path[::-1])] = 10.0
        return logits

    def step(self, right: list[int], mode: str) -> OverlapRelay:
        self.reserve()
        be, B = self.backend, len(self.rows)
        req_pool_indices, seq_lens = _index(self.rows), _index(self.seq_lens)
        drafts, truth = self.draft(right)
        tree = prepare_tree(be, _index(drafts), mask_of([PARENTS] * B, "cpu"), seq_lens)
        out_cache_loc = tree_cache_locs(be, self.pool.req_to_token, req_pool_indices, seq_lens, D)
        self._store(out_cache_loc, drafts, tree.positions.tolist())
        logits = self.target_logits(drafts)
        if mode == "greedy":
            out = verify_greedy(be, tree, logits)
        else:
            probs = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).to(torch.float32)
            out = verify_sample(be, tree, probs, generator=torch.Generator().manual_seed(sum(right)))
        relay = commit(be, self.kv, out, out_cache_loc, self.pool.req_to_token, req_pool_indices, seq_lens)
        self._check(relay, right, truth)
        return relay

    def _check(self, relay: OverlapRelay, right: list[int], truth: list[list[int]]) -> None:
        lens = relay.accept_lens.tolist()
        assert lens == [r + 1 for r in right]
        assert relay.new_seq_lens.tolist() == [s + n for s, n in zip(self.seq_lens, lens)]
        tokens = relay.accept_tokens.view(-1, D).tolist()
        for b, n in enumerate(lens):
            assert tokens[b] == truth[b][:n] + [-1] * (D - n)
            self.seq_lens[b] += n
            self.tokens[b] += truth[b][:n]
        assert relay.last_tokens().tolist() == [t[-1] for t in self.tokens]
        # Every position with KV holds the row of the token committed there.
        table = self.pool.req_to_token
        for b, n in enumerate(self.seq_lens):
            locs = table[self.rows[b], :n]
            want = torch.stack([kv_row(t, p) for p, t in enumerate(self.tokens[b][:n])], dim=1)
            assert torch.equal(self.kv.k[:, locs], want), f"request {b}: K rows after compaction"
            assert torch.equal(self.kv.v[:, locs], -want), f"request {b}: V rows after compaction"


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_speculative_decoding_matches_plain_greedy(mode, page_size):
    rng = random.Random(page_size)
    prompts = [[3, 9, 4], [11, 2], [5, 5, 8, 1, 30]]
    h = Harness(prompts, page_size, rng)
    for _ in range(8):
        h.step([rng.randint(0, 3) for _ in prompts], mode)
    for prompt, tokens in zip(prompts, h.tokens):
        assert tokens == prompt + greedy_continuation(prompt, len(tokens) - len(prompt))


def test_worked_step():
    """One step by hand: request 0 accepts two drafts, request 1 none, request 2 all three."""
    h = Harness([[3, 9, 4], [11, 2], [5, 5, 8, 1, 30]], 1, random.Random(0))
    relay = h.step([2, 0, 3], "greedy")
    assert relay.accept_lens.tolist() == [3, 1, 4]
    assert relay.accept_tokens.view(3, D)[1].tolist() == [next_token([11, 2])] + [-1] * (D - 1)


def test_prepare_tree_positions_and_candidates():
    be = CpuBackend()
    drafts = torch.arange(2 * D, dtype=torch.int64)
    tree = prepare_tree(be, drafts, mask_of([PARENTS] * 2, "cpu"), torch.tensor([10, 0]))
    assert isinstance(tree, TreeBatch) and (tree.batch_size, tree.tree_size) == (2, D)
    assert tree.positions.tolist() == [10, 11, 11, 11, 12, 12, 12, 13, 0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.candidates.tolist() == [list(range(D)), list(range(D, 2 * D))]
    assert tree.retrieve_next_token[0].tolist() == [1, 4, 5, -1, -1, 7, -1, -1]


def test_glue_rejects_bad_shapes():
    be = CpuBackend()
    mask = mask_of([PARENTS] * 2, "cpu")
    with pytest.raises(ContractError, match="draft_tokens"):
        prepare_tree(be, torch.zeros(D, dtype=torch.int64), mask, torch.tensor([0, 0]))
    with pytest.raises(ContractError, match="draft_tokens"):
        prepare_tree(be, torch.zeros(2 * D, dtype=torch.int32), mask, torch.tensor([0, 0]))
    tree = prepare_tree(be, torch.zeros(2 * D, dtype=torch.int64), mask, torch.tensor([0, 0]))
    with pytest.raises(ContractError, match="logits"):
        verify_greedy(be, tree, torch.zeros(D, VOCAB))
    with pytest.raises(ContractError, match="probs"):
        verify_sample(be, tree, torch.zeros(2 * D, VOCAB, dtype=torch.float64))


def test_verify_sample_draws_its_coins_from_the_generator():
    be = CpuBackend()
    tree = prepare_tree(be, torch.zeros(4 * D, dtype=torch.int64), mask_of([PARENTS] * 4, "cpu"),
                        torch.zeros(4, dtype=torch.int64))
    probs = torch.full((4 * D, VOCAB), 1.0 / VOCAB)
    first = verify_sample(be, tree, probs, generator=torch.Generator().manual_seed(5))
    again = verify_sample(be, tree, probs, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    explicit = verify_sample(be, tree, probs, uniform_samples=torch.rand((4, D), generator=gen),
                             uniform_final=torch.rand((4,), generator=gen))
    for a, b, c in zip(vars(first).values(), vars(again).values(), vars(explicit).values()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_tree_cache_locs_reads_the_tree_positions():
    be = CpuBackend()
    table = torch.arange(40, dtype=torch.int64).view(4, 10)
    locs = tree_cache_locs(be, table, torch.tensor([2, 0]), torch.tensor([3, 7]), 3)
    assert locs.tolist() == [23, 24, 25, 7, 8, 9]


@pytest.mark.parametrize("seq_len,allocated,want", [(0, 0, 16), (10, 10, 16), (10, 17, 9), (10, 18, 0),
                                                    (10, 26, 0), (5, 12, 9)])
def test_slots_needed(seq_len, allocated, want):
    assert slots_needed(seq_len, allocated, 8) == want


def test_slots_needed_rejects_bad_ints():
    with pytest.raises(ContractError, match="tree_size"):
        slots_needed(3, 3, 0)
    with pytest.raises(ContractError, match="seq_len"):
        slots_needed(torch.tensor(3), 3, 4)
