"""The steps that graphs capture (``ngram_hal.engine.graphs``), run eagerly on the CPU.

The greedy verify step (``GreedyStep``), padded to a larger batch, commits what the op-by-op step
commits for the real requests; the prefill of several requests (``PaddedPrefill``), padded to
more requests and tokens, gives the unpadded forward's logits and K/V. Both leave every other slot of the cache as
it was. A verify step never accepts a node past its tree's active count."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.graphs import GreedyStep, PaddedPrefill, prefill_bucket, prefill_lengths
from ngram_hal.engine.model import ForwardBatch, LlamaModel
from ngram_hal.engine.verify_step import verify_step
from ngram_hal.reference import CpuBackend
from ngram_hal.speculative.lookup import DeviceDrafter
from ngram_hal.speculative.relay import OverlapRelay
from ngram_hal.speculative.verify import commit, prepare_tree, tree_cache_locs, verify_greedy
from tiny_model import TINY

I64 = torch.int64
PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40, 41, 8, 8]]


def _state(model: LlamaModel):
    """A cache and a table holding both prompts' K/V (rows 1 and 3 of four), slots scattered; row 0,
    which padding requests point at, holds slots too, so a padding write would show."""
    kv = model.new_kv_cache(128)
    table = torch.full((4, 64), -1, dtype=I64)
    free = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    rows = [1, 3]
    table[1, :32], table[3, :32], table[0, :32] = free[:32], free[32:64], free[64:96]
    ids = [t for p in PROMPTS for t in p]
    model.forward(ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor([i for p in PROMPTS for i in range(len(p))]),
        out_cache_loc=torch.cat([table[r, :len(p)] for r, p in zip(rows, PROMPTS)]), req_to_token=table,
        req_pool_indices=torch.tensor(rows), kv_lens=torch.tensor([len(p) for p in PROMPTS]),
        q_lens=torch.tensor([len(p) for p in PROMPTS])), kv)
    return kv, table, torch.tensor(rows), torch.tensor([len(p) for p in PROMPTS])


def _op_by_op(model, kv, table, rows, seq_lens, tokens, mask, n):
    be = model.backend
    tree = prepare_tree(be, tokens, mask, seq_lens)
    locs = tree_cache_locs(be, table, rows, seq_lens, n)
    logits = model.forward(ForwardBatch(input_ids=tokens, positions=tree.positions, out_cache_loc=locs,
                                        req_to_token=table, req_pool_indices=rows, kv_lens=seq_lens + n,
                                        q_lens=torch.full((2,), n, dtype=I64), tree_mask=mask if n > 1 else None,
                                        max_kv_len=table.shape[1]), kv)
    return commit(be, kv, verify_greedy(be, tree, logits), locs, table, rows, seq_lens)


@pytest.mark.parametrize("tree_size", [1, 4])
@pytest.mark.parametrize("padded", [2, 5])
def test_padded_greedy_step_commits_what_the_op_by_op_step_does(tree_size, padded):
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, table, rows, seq_lens = _state(model)
    parents = [-1, 0, 0, 1][:tree_size]
    mask = torch.zeros(tree_size, tree_size, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    mask = mask.expand(2, tree_size, tree_size).contiguous()
    tokens = torch.tensor([[7, 12, 30, 2][:tree_size], [8, 8, 9, 8][:tree_size]], dtype=I64).view(-1)

    ref_kv = model.new_kv_cache(128)
    ref_kv.k.copy_(kv.k)
    ref_kv.v.copy_(kv.v)
    want = _op_by_op(model, ref_kv, table, rows, seq_lens, tokens, mask, tree_size)

    step = GreedyStep(model, kv, table, padded, tree_size)
    step.run()  # what capture runs first: no request, so no write
    step.load(tokens, mask if tree_size > 1 else None, rows, seq_lens)
    step.run()
    got = step.result(2)
    for name in ("accept_tokens", "accept_lens", "new_seq_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    _assert_same_writes(kv, ref_kv, table, rows, seq_lens, tree_size)


def _assert_same_writes(kv, ref_kv, table, rows, seq_lens, tree_size):
    """The step wrote the real requests' node slots as the op-by-op step did, and nothing else.

    Their K/V come from forwards of different row counts (the padded batch and the real one),
    which the CPU attention does not promise to compute bit for bit alike: they agree within
    float32's tolerance. Every other data row is untouched, bit for bit (row S is the scratch
    row where writes aimed at -1 land)."""
    written = torch.cat([table[r, s:s + tree_size] for r, s in zip(rows.tolist(), seq_lens.tolist())])
    others = torch.ones(kv.k.shape[1], dtype=torch.bool)
    others[written] = False
    others[-1] = False
    for got_c, want_c in ((kv.k, ref_kv.k), (kv.v, ref_kv.v)):
        torch.testing.assert_close(got_c[:, written], want_c[:, written])
        assert torch.equal(got_c[:, others], want_c[:, others]), "padding changed the cache"


@pytest.mark.parametrize("tree_size", [1, 4])
def test_greedy_step_with_a_drafter_records_and_drafts_the_next_chains(tree_size):
    """With a device drafter the step's trees are chains (it commits what the op-by-op step with
    chain masks commits), and the step ends by recording its committed tokens and drafting the
    next chains, as a separate draft of its relay would; the padding request, which points at
    row 0, records nothing there."""
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, table, rows, seq_lens = _state(model)
    drafter, separate = (DeviceDrafter(CpuBackend(), *table.shape, tree_size=4) for _ in range(2))
    for d in (drafter, separate):
        d.table[0] = -5  # row 0, no request's: a padding write would show
        d.add_prompts(rows, seq_lens, torch.tensor([t for p in PROMPTS for t in p]))
    # The prefill's first tokens: 7 after the first prompt (which holds "7 ..." to copy), 8 after the second.
    first = OverlapRelay(torch.tensor([7, 8]), torch.ones(2, dtype=I64), seq_lens, 1)
    chains, _ = separate.draft(rows, first, tree_size)
    drafter.table.copy_(separate.table)
    before = drafter.table.clone()

    ref_kv = model.new_kv_cache(128)
    ref_kv.k.copy_(kv.k)
    ref_kv.v.copy_(kv.v)
    want = _op_by_op(model, ref_kv, table, rows, seq_lens, chains, separate.chain_masks(2, tree_size), tree_size)

    step = GreedyStep(model, kv, table, 3, tree_size, drafter)
    step.run()  # what capture runs first: no request, so no write
    assert torch.equal(drafter.table, before)
    step.load(chains.view(2, tree_size), None, rows, seq_lens)
    step.run()
    got = step.result(2)
    for name in ("accept_tokens", "accept_lens", "new_seq_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    _assert_same_writes(kv, ref_kv, table, rows, seq_lens, tree_size)
    want_chains, want_active = separate.draft(rows, got, 4)
    assert torch.equal(drafter.chains_ahead(2, 4)[0].reshape(-1), want_chains)
    assert torch.equal(drafter.chains_ahead(2, 4)[1], want_active)
    assert torch.equal(drafter.table, separate.table) and torch.equal(drafter.table[0], before[0])


def test_dummy_run_writes_nothing():
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, table, _, _ = _state(model)
    before = (kv.k.clone(), kv.v.clone(), table.clone())
    GreedyStep(model, kv, table, 4, 4).run()
    assert torch.equal(kv.k[:, :-1], before[0][:, :-1]) and torch.equal(kv.v[:, :-1], before[1][:, :-1])
    assert torch.equal(table, before[2])


def test_prefill_buckets():
    assert [prefill_bucket(n) for n in (1, 16, 17, 444, 512, 513, 1500)] == [16, 16, 32, 512, 512, 1024, 1536]


def test_prefill_lengths_are_every_bucket_up_to_the_limit():
    assert prefill_lengths(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert prefill_lengths(100) == [16, 32, 64]
    for limit in (16, 100, 512, 1500, 4096):
        buckets = {prefill_bucket(n) for n in range(1, limit + 1)}
        assert prefill_lengths(limit) == sorted(b for b in buckets if b <= limit)


PREFILL_PROMPTS = [[1, 9, 33, 4, 4, 17, 2, 60, 5], [7, 7, 8], [2, 50, 3, 3, 11]]


@pytest.mark.parametrize("table_tail", ["unassigned", "stale slots"])
@pytest.mark.parametrize("requests,batch", [(1, 1), (1, 2), (3, 4)])
def test_padded_prefill_equals_the_unpadded_forward(table_tail, requests, batch):
    """Prompts prefilled together, padded to ``batch`` requests and 16 (or 32) tokens, give the
    unpadded forward's last-token logits and K/V, and write no other slot."""
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, _, _, _ = _state(model)
    table = torch.full((6, 64), -1, dtype=I64)
    prompts = [torch.tensor(p, dtype=I64) for p in PREFILL_PROMPTS[:requests]]
    lens = [p.shape[0] for p in prompts]
    rows = [2, 5, 4][:requests]
    start = 100
    for r, n in zip(rows, lens):
        table[r, :n] = torch.arange(start, start + n)
        start += n
    if table_tail == "stale slots":
        table[rows[-1], lens[-1]:32] = torch.arange(96 - (32 - lens[-1]), 96)
    locs = torch.cat([table[r, :n] for r, n in zip(rows, lens)])
    ids = torch.cat(prompts)
    N = ids.shape[0]

    ref_kv = model.new_kv_cache(128)
    ref_kv.k.copy_(kv.k)
    ref_kv.v.copy_(kv.v)
    want = model.forward(ForwardBatch(input_ids=ids, positions=torch.tensor([i for n in lens for i in range(n)]),
                                      out_cache_loc=locs, req_to_token=table, req_pool_indices=torch.tensor(rows),
                                      kv_lens=torch.tensor(lens), q_lens=torch.tensor(lens),
                                      logits_index=torch.tensor(lens).cumsum(0) - 1), ref_kv)

    padded = 16 if N <= 16 else 32
    step = PaddedPrefill(model, kv, table, batch, padded)
    step.run()  # what capture runs first: nothing loaded, so no write
    step.load(ids, locs, torch.tensor(rows), lens, torch.tensor)
    got = step.run()
    assert got.shape == (batch, want.shape[1])
    torch.testing.assert_close(got[:requests], want, rtol=1e-5, atol=1e-5)
    others = torch.ones(kv.k.shape[1], dtype=torch.bool)
    others[locs] = False
    others[-1] = False  # the scratch row where writes aimed at -1 land
    for got_c, want_c in ((kv.k, ref_kv.k), (kv.v, ref_kv.v)):
        torch.testing.assert_close(got_c[:, locs], want_c[:, locs], rtol=1e-5, atol=1e-5)
        assert torch.equal(got_c[:, others], want_c[:, others]), "the padded prefill wrote outside the prompts' slots"


def test_padded_prefill_refuses_what_does_not_fit():
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, table, _, _ = _state(model)
    with pytest.raises(ValueError, match="exceed the request table"):
        PaddedPrefill(model, kv, table, 1, 128)
    step = PaddedPrefill(model, kv, table, 2, 16)
    with pytest.raises(ValueError, match="tokens .* do not fit"):
        step.load(torch.zeros(17, dtype=I64), torch.zeros(17, dtype=I64), torch.tensor([0]), [17], torch.tensor)
    with pytest.raises(ValueError, match="tokens .* do not fit"):
        step.load(torch.zeros(6, dtype=I64), torch.zeros(6, dtype=I64), torch.tensor([0]), [5], torch.tensor)
    with pytest.raises(ValueError, match="requests .* do not fit"):
        step.load(torch.zeros(6, dtype=I64), torch.zeros(6, dtype=I64), torch.tensor([0, 1, 2]), [2, 2, 2],
                  torch.tensor)


def test_nodes_past_active_are_never_accepted():
    """A verify step with ``active`` commits no node at or past a tree's active count, even where
    the node is the target's own next token, and commits what the step without it commits up to
    there (the nodes before it attend as they did)."""
    model = LlamaModel.random(TINY, CpuBackend(), seed=7)
    kv, table, rows, seq_lens = _state(model)
    n = 5
    masks = DeviceDrafter(CpuBackend(), *table.shape, tree_size=n).chain_masks(2, n)
    q_lens = torch.full((2,), n, dtype=I64)

    def step(chains, active=None):
        fresh = model.new_kv_cache(128)
        fresh.k.copy_(kv.k)
        fresh.v.copy_(kv.v)
        return verify_step(model.backend, lambda batch: model.forward_argmax(batch, fresh), fresh, table.clone(),
                           chains.view(-1), masks, rows, seq_lens, q_lens, n, table.shape[1], chains=True,
                           active=active)

    chains = torch.tensor([[7] + [0] * (n - 1), [8] + [0] * (n - 1)])
    for i in range(1, n):  # the target's own continuation: every draft is accepted
        chains[:, i] = step(chains)[1].predicts.view(2, n)[:, i - 1]
    full, _ = step(chains)
    assert full.accept_lens.tolist() == [n, n]
    cut, _ = step(chains, torch.tensor([2, n + 3]))
    assert cut.accept_lens.tolist() == [2, n]
    assert torch.equal(cut.accept_tokens.view(2, n)[0, :2], full.accept_tokens.view(2, n)[0, :2])
    assert torch.equal(cut.accept_tokens.view(2, n)[1], full.accept_tokens.view(2, n)[1])
