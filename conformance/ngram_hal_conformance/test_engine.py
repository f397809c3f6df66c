"""Engine tier: a tiny end-to-end decode through the backend equals the same decode through the
reference backend, with and without n-gram speculation: the same tokens, the same verify steps,
and after every step the same K/V in every position a request has committed (so a compaction
that moves the wrong rows is caught even where the tokens happen to survive it).

The HAL ops the engine calls are recorded while it decodes (the ``engine_ops`` property of the
report) and must be among :data:`ENGINE_OPS`, the ops the test is filed under."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ngram_hal.backend import OPS
from ngram_hal.engine import Engine, EngineConfig, LlamaConfig, LlamaModel, SamplingParams

from .checks import host

# The ops a greedy decode may call: every op but sampling's verify.
ENGINE_OPS = [op for op in OPS if op != "verify_tree_sample"]
# What a speculative greedy decode must call on every backend (a backend whose model kernels store
# K/V themselves does not call store_kv).
SPECULATIVE_OPS = {"alloc_extend", "assign_req_to_token", "gather_cache_locs", "move_kv", "accepted_kv_moves",
                   "reconstruct_tree", "verify_tree_greedy", "attention"}
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
# Repetitive prompts, so that speculation drafts and accepts tokens.
PROMPTS = [[5, 9, 14, 3] * 6, [7, 1, 2, 8, 4, 6, 11] * 3, list(range(40, 60))]
NEW_TOKENS = 24
# K/V of committed positions against the reference: (atol, rtol). Only attention's rounding
# reaches the second layer's K/V; a row moved from the wrong slot is off by the rows' scale.
KV_TOLERANCE = (1e-3, 1e-3)


class Decode:
    """A batched greedy decode stepped to the end, its KV slots in pages of ``page_size``: tokens
    and verify steps per request, after each step the host K/V ``[L, n, H, d]`` of the committed
    positions of every running request, and how often the engine called each HAL op (``calls``)."""

    def __init__(self, backend, tree_size: int, page_size: int = 1):
        self.calls: Counter[str] = Counter()
        for op in OPS:
            setattr(backend, op, self._counted(op, getattr(backend, op)))
        try:
            self._decode(backend, tree_size, page_size)
        finally:
            for op in OPS:
                delattr(backend, op)

    def _counted(self, op: str, method):
        def call(*args, **kwargs):
            self.calls[op] += 1
            return method(*args, **kwargs)
        return call

    def _decode(self, backend, tree_size: int, page_size: int) -> None:
        model = LlamaModel.random(TINY, backend, seed=3)
        engine = Engine(model, None, EngineConfig(tree_size=tree_size, num_slots=512, max_context_len=128,
                                                  page_size=page_size))
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        rids = [engine.add_request(p, params, rid=f"prompt{i}") for i, p in enumerate(PROMPTS)]
        self.kv_steps: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        final = {}
        while engine.has_unfinished():
            final.update((o.rid, o) for o in engine.step() if o.finished)
            backend.synchronize()
            self.kv_steps.append(self._committed_kv(engine))
        self.tokens = [final[r].token_ids for r in rids]
        self.verify_steps = sum(final[r].verify_steps for r in rids)

    @staticmethod
    def _committed_kv(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for r in engine.sched.running:
            slots = engine.sched.req_to_token[r.row, :r.seq_len]
            out[r.rid] = (host(engine.kv.k.index_select(1, slots)), host(engine.kv.v.index_select(1, slots)))
        return out


@pytest.fixture(scope="module")
def reference_decode(reference):
    """The reference backend's decode for a spec size and page size, run once per module."""
    runs: dict[tuple[int, int], Decode] = {}

    def run(tree_size: int, page_size: int = 1) -> Decode:
        if (tree_size, page_size) not in runs:
            runs[(tree_size, page_size)] = Decode(reference, tree_size, page_size)
        return runs[(tree_size, page_size)]

    return run


def _assert_same_kv(got: Decode, want: Decode) -> None:
    atol, rtol = KV_TOLERANCE
    for step, (mine, ref) in enumerate(zip(got.kv_steps, want.kv_steps)):
        assert sorted(mine) == sorted(ref), f"after step {step}: running requests {sorted(mine)} vs {sorted(ref)}"
        for rid, pair in ref.items():
            for name, a, b in zip("KV", mine[rid], pair):
                assert a.shape == b.shape, f"after step {step}, {rid}: {name} of {a.shape[1]} positions vs {b.shape[1]}"
                bad = ~torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol)
                if bool(bad.any()):
                    layer, pos = bad.nonzero()[0, :2].tolist()
                    raise AssertionError(f"after step {step}, {rid}: {name} of layer {layer} at position {pos} "
                                         f"differs from the reference ({int(bad.sum())} values off)")


@pytest.mark.conformance(op=ENGINE_OPS, tier="engine")
@pytest.mark.filterwarnings("ignore:record_property is incompatible with junit_family")
@pytest.mark.parametrize("tree_size,page_size", [(1, 1), (4, 1), (4, 16)], ids=["no-spec", "spec-4", "spec-4-page-16"])
def test_greedy_decode_matches_reference(backend, reference_decode, tree_size, page_size, record_property):
    """K/V after every step, token ids and verify steps of a batched greedy decode, its KV slots
    in pages of 1 or 16, equal the reference backend's (and, in pages of 16, the reference's in
    pages of 1); the engine calls only the ops the test is filed under."""
    listed = backend.capabilities().page_sizes
    if listed is not None and page_size not in listed:
        pytest.skip(f"the backend lists page sizes {listed}; this case uses {page_size}")
    got, want = Decode(backend, tree_size, page_size), reference_decode(tree_size, page_size)
    record_property("engine_ops", ",".join(sorted(got.calls)))
    called = set(got.calls)
    assert called <= set(ENGINE_OPS), f"the engine called ops not in ENGINE_OPS: {sorted(called - set(ENGINE_OPS))}"
    if tree_size > 1:
        assert SPECULATIVE_OPS <= called, f"a speculative decode never called {sorted(SPECULATIVE_OPS - called)}"
    assert all(len(t) == NEW_TOKENS for t in want.tokens)
    if tree_size > 1:
        assert want.verify_steps < len(PROMPTS) * NEW_TOKENS, "the workload must accept drafts to cover speculation"
    _assert_same_kv(got, want)
    assert got.tokens == want.tokens, "greedy tokens differ from the reference backend"
    assert got.verify_steps == want.verify_steps, "verify steps differ from the reference backend"
    assert len(got.kv_steps) == len(want.kv_steps), "engine steps differ from the reference backend"
    if page_size > 1:
        assert want.tokens == reference_decode(tree_size).tokens, "the reference's tokens depend on the page size"
