"""Prompt lookup on the device (``speculative.lookup``) against the host's linear drafter.

:class:`DeviceDrafter` must draft exactly what :class:`LinearDrafter` drafts from the same
context, when it learns that context the engine's way: prompts recorded at the prefill, then each
step's committed tokens read from the relay. The Triton kernel must match the torch
implementation, the token table included (on a GPU where there is one, else under Triton's
interpreter).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal.contract import ContractError
from ngram_hal.reference import CpuBackend
from ngram_hal.speculative.drafter import LinearDrafter
from ngram_hal.speculative.lookup import DeviceDrafter, active_nodes, record_and_draft
from ngram_hal.speculative.relay import OverlapRelay

STRIDE = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _relay(runs: list[list[int]], seq_lens: list[int]) -> OverlapRelay:
    """The relay of a step that committed ``runs`` (one per request) ending at ``seq_lens``."""
    tokens = torch.full((len(runs), STRIDE), -1, dtype=torch.int64)
    for b, run in enumerate(runs):
        tokens[b, :len(run)] = torch.tensor(run)
    return OverlapRelay(tokens.view(-1), torch.tensor([len(r) for r in runs]), torch.tensor(seq_lens), STRIDE)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=3),
       steps=st.lists(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=STRIDE), min_size=3, max_size=3),
                      max_size=6),
       tree_size=st.integers(1, 12), max_ngram=st.integers(2, 6), min_ngram=st.integers(1, 3))
def test_drafts_equal_the_linear_drafter(prompts, steps, tree_size, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    B, width = len(prompts), 128
    device = DeviceDrafter(CpuBackend(), num_rows=4, width=width, max_ngram=max_ngram, min_ngram=min_ngram)
    # Drafting one step ahead: chains of 12 recorded and drafted by the step before, cut to n.
    ahead = DeviceDrafter(CpuBackend(), num_rows=4, width=width, tree_size=12, max_ngram=max_ngram,
                          min_ngram=min_ngram)
    host = LinearDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    rows = torch.tensor([3, 0, 2][:B])
    # The engine's prefill: the prompt but its last token goes to the table; the last token is the
    # relay's first committed token (as a first sampled token would be).
    for drafter in (device, ahead):
        drafter.add_prompts(rows, torch.tensor([len(p) - 1 for p in prompts]),
                            torch.tensor([t for prompt in prompts for t in prompt[:-1]], dtype=torch.int64))
    relay = _relay([p[-1:] for p in prompts], [len(p) - 1 for p in prompts])
    contexts = [list(p) for p in prompts]
    for b, prompt in enumerate(prompts):
        host.add_request(b, prompt)
    for runs in [None, *steps]:
        if runs is not None:
            runs = runs[:B]
            for b, run in enumerate(runs):
                host.extend(b, run)
                contexts[b] += run
            relay = _relay(runs, [len(c) - 1 for c in contexts])
        got, active = device.draft(rows, relay, tree_size)
        got = got.view(B, tree_size)
        assert got.tolist() == host.draft(list(range(B)), tree_size).tokens.view(B, tree_size).tolist()
        matches = torch.tensor(host.match_lengths(list(range(B))))
        assert torch.equal(active, active_nodes(matches, tree_size))
        ahead.draft_next(rows, relay)
        assert torch.equal(ahead.chains_ahead(B, tree_size)[0], got)
        assert torch.equal(ahead.chains_ahead(B, tree_size)[1].clamp(max=tree_size), active)  # n or more: all n
        assert torch.equal(ahead.table, device.table)
        for b, context in enumerate(contexts):
            assert device.table[rows[b], :len(context)].tolist() == context
            assert got[b, 0] == context[-1]


def test_no_match_repeats_the_root_and_short_matches_pad():
    device = DeviceDrafter(CpuBackend(), num_rows=1, width=16, max_ngram=4, min_ngram=2)
    device.add_prompts(torch.tensor([0]), torch.tensor([4]), torch.tensor([1, 2, 3, 9]))
    rows = torch.tensor([0])
    chains, active = device.draft(rows, _relay([[3]], [4]), 3)
    assert chains.tolist() == [3, 3, 3] and active.tolist() == [1]  # only "3" matched: the root alone
    chains, active = device.draft(rows, _relay([[9]], [5]), 3)
    assert chains.tolist() == [9, 3, 9] and active.tolist() == [3]  # "3 9": copy, then repeat


def test_active_nodes_follow_the_match():
    """The root alone with no match, all n after a match of any length."""
    match = torch.tensor([0, 1, 2, 8])
    assert active_nodes(match, 16).tolist() == [1, 16, 16, 16]
    assert active_nodes(match, 1).tolist() == [1, 1, 1, 1]
    assert active_nodes(match, 16).dtype == torch.int64


def test_chain_masks_are_chains():
    device = DeviceDrafter(CpuBackend(), num_rows=1, width=16)
    masks = device.chain_masks(3, 4)
    assert masks.shape == (3, 4, 4) and masks.dtype == torch.bool
    assert torch.equal(masks[2], torch.ones(4, 4, dtype=torch.bool).tril())
    assert device.chain_masks(5, 4).shape == (5, 4, 4) and device.chain_masks(2, 4).shape == (2, 4, 4)


def test_bad_arguments_raise_and_change_nothing():
    with pytest.raises(ContractError, match="min_ngram"):
        DeviceDrafter(CpuBackend(), num_rows=1, width=16, max_ngram=2, min_ngram=3)
    device = DeviceDrafter(CpuBackend(), num_rows=2, width=16)
    before = device.table.clone()
    relay = _relay([[1]], [0])
    with pytest.raises(ContractError, match="rows"):
        device.draft(torch.tensor([0], dtype=torch.int32), relay, 2)
    with pytest.raises(ContractError, match="rows"):
        device.draft(torch.tensor([0, 1]), relay, 2)
    with pytest.raises(ContractError, match="tree_size"):
        device.draft(torch.tensor([0]), relay, 0)
    with pytest.raises(ContractError, match="lens"):
        device.add_prompts(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([5]))
    with pytest.raises(ContractError, match="rows"):
        device.draft_next(torch.tensor([0, 1, 1]), _relay([[1], [1], [1]], [0, 0, 0]))
    with pytest.raises(ContractError, match="live"):
        device.draft_next(torch.tensor([0]), relay, live=torch.tensor([1, 1]))
    with pytest.raises(ContractError, match="tree_size"):
        device.chains_ahead(1, 2)
    assert torch.equal(device.table, before)


CASES = [  # (rows R, width W, batch B, relay stride S, tree size n, max_ngram, vocab)
    (6, 40, 3, 8, 8, 8, 2), (6, 1200, 4, 16, 16, 8, 3), (3, 600, 1, 1, 1, 3, 4), (5, 513, 5, 4, 12, 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_kernel_matches_torch(case):
    pytest.importorskip("triton")
    from ngram_hal.kernels.gpu.lookup import record_and_draft as kernel

    R, W, B, S, n, K, vocab = case
    gen = torch.Generator().manual_seed(sum(case))
    for trial in range(4):
        table = torch.randint(0, vocab, (R, W), generator=gen)
        rows = torch.randperm(R, generator=gen)[:B]
        lens = torch.randint(1, S + 1, (B,), generator=gen)
        seq_lens = torch.maximum(torch.randint(0, W, (B,), generator=gen), lens - 1)
        seq_lens[0] = W - 1 if trial == 0 else seq_lens[0]  # the root on the table's last position
        tokens = torch.randint(0, vocab, (B * S,), generator=gen)
        mine, want_match = table.clone(), torch.full((B,), -1)
        want = record_and_draft(mine, rows, tokens, lens, seq_lens, n, K, 1, match=want_match)
        theirs, match = table.to(DEVICE), torch.full((B,), -1, device=DEVICE)
        got = kernel(theirs, *(t.to(DEVICE) for t in (rows, tokens, lens, seq_lens)), n, K, 1, match=match)
        assert torch.equal(got.cpu(), want) and torch.equal(theirs.cpu(), mine)
        assert torch.equal(match.cpu(), want_match) and bool((want_match >= 0).all() & (want_match <= K).all())


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_padding_records_nothing(case):
    """A padded batch (a captured step's): the requests past ``live`` point at row 0 with length 0;
    neither implementation writes for them, and the real requests' chains land in ``out``."""
    pytest.importorskip("triton")
    from ngram_hal.kernels.gpu.lookup import record_and_draft as kernel

    R, W, B, S, n, K, vocab = case
    gen = torch.Generator().manual_seed(sum(case))
    table = torch.randint(0, vocab, (R, W), generator=gen)
    real = B - 1
    rows = torch.cat([torch.randperm(R - 1, generator=gen)[:real] + 1, torch.zeros(1, dtype=torch.int64)])
    lens = torch.randint(1, S + 1, (B,), generator=gen)
    seq_lens = torch.maximum(torch.randint(1, W, (B,), generator=gen), lens)
    seq_lens[real:] = lens[real:]  # a padding request's committed tokens would start at position 1
    tokens = torch.randint(0, vocab, (B * S,), generator=gen)
    live = torch.tensor([real])
    want = record_and_draft(table.clone(), rows[:real], tokens[:real * S], lens[:real], seq_lens[:real], n, K, 1)
    for impl, dev in ((record_and_draft, "cpu"), (kernel, DEVICE)):
        mine = table.to(dev)
        out = torch.full((B * n,), -7, dtype=torch.int64, device=dev)
        impl(mine, *(t.to(dev) for t in (rows, tokens, lens, seq_lens)), n, K, 1, live.to(dev), out)
        assert torch.equal(mine[0].cpu(), table[0]), "padding wrote into row 0"
        assert torch.equal(out[:real * n].cpu(), want)


def test_engine_drafts_with_the_triton_kernel_and_stays_exact():
    """On a backend with Triton model kernels (here the cuda backend, interpreted where there is no
    GPU) the engine drafts through the Triton kernel; greedy output equals plain decoding's."""
    pytest.importorskip("triton")
    from ngram_hal_cuda import CudaBackend

    from ngram_hal.engine.config import LlamaConfig
    from ngram_hal.engine.engine import Engine, EngineConfig
    from ngram_hal.engine.model import LlamaModel
    from ngram_hal.engine.request import SamplingParams
    from ngram_hal.kernels.gpu import lookup

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    model = LlamaModel.random(cfg, CudaBackend(device=DEVICE), seed=3)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 2, 9, 1, 2, 9]]
    params = SamplingParams(max_new_tokens=12)
    outs = {}
    for tree_size, drafter in ((1, "trie"), (4, "device")):
        engine = Engine(model, None, EngineConfig(tree_size=tree_size, drafter=drafter, num_slots=256,
                                                  max_context_len=64, graphs=False))
        outs[drafter] = [o.token_ids for o in engine.generate(prompts, params)]
        if drafter == "device":
            assert engine.drafts.lookup.kernel is lookup.record_and_draft
            accepted = engine.stats.tokens_per_step
    assert outs["device"] == outs["trie"]
    assert accepted > 1.0, "the prompts must accept drafts for this test to cover speculation"
