"""Engine tier: a tiny end-to-end decode through the backend equals the same decode through the
reference backend, with and without n-gram speculation."""

from __future__ import annotations

import pytest

from ngram_hal.engine import Engine, EngineConfig, LlamaConfig, LlamaModel, SamplingParams

ENGINE_OPS = ["alloc_extend", "assign_req_to_token", "store_kv", "move_kv", "accepted_kv_moves",
              "reconstruct_tree", "verify_tree_greedy", "attention"]
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
# Repetitive prompts, so that speculation drafts and accepts tokens.
PROMPTS = [[5, 9, 14, 3] * 6, [7, 1, 2, 8, 4, 6, 11] * 3, list(range(40, 60))]


def _greedy(backend, spec_nodes: int) -> tuple[list[list[int]], int]:
    model = LlamaModel.random(TINY, backend, seed=3)
    engine = Engine(model, None, EngineConfig(spec_nodes=spec_nodes, num_slots=512, max_context_len=128))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    return [o.token_ids for o in outs], sum(o.verify_steps for o in outs)


@pytest.mark.conformance(op=ENGINE_OPS, tier="engine")
@pytest.mark.parametrize("spec_nodes", [1, 4], ids=["no-spec", "spec-4"])
def test_greedy_decode_matches_reference(backend, reference, spec_nodes):
    """Token ids of a batched greedy decode equal the reference backend's."""
    got, got_steps = _greedy(backend, spec_nodes)
    want, want_steps = _greedy(reference, spec_nodes)
    assert all(len(t) == 24 for t in want)
    if spec_nodes > 1:
        assert want_steps < 3 * 24, "the workload must accept drafts for this test to cover speculation"
    assert got == want, "greedy tokens differ from the reference backend"
    assert got_steps == want_steps, "verify steps differ from the reference backend"
