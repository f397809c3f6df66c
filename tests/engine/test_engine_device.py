"""The overlap loop on an accelerator: no hidden host syncs, and the same tokens as without overlap.

Runs the reference backend on a CUDA device (its ops are device-generic torch). Skipped where no
CUDA device is present. The sync check uses torch's CUDA sync debug mode, which raises on every
implicit synchronisation (``.item()``, ``nonzero``, blocking copies) but not on the loop's one
deliberate wait, ``event.synchronize()``.
"""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.model import LlamaModel
from ngram_hal.engine.request import SamplingParams
from ngram_hal.reference import CpuBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    return LlamaModel.random(cfg, CpuBackend(device="cuda"), seed=2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


def generate(model, prompts, params, **cfg):
    engine = Engine(model, None, EngineConfig(num_slots=1024, max_context_len=256, **cfg))
    return engine, engine.generate(prompts, params)


@pytest.mark.parametrize("tree_size,drafter", [(1, "trie"), (8, "trie"), (8, "device")])
def test_overlap_loop_has_no_hidden_sync(model, prompts, tree_size, drafter):
    _, expected = generate(model, prompts, SamplingParams(max_new_tokens=32, logprobs=True), tree_size=1,
                           overlap=False)
    params = [SamplingParams(max_new_tokens=32, logprobs=True), SamplingParams(max_new_tokens=32, stop_token_ids=(7,)),
              SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=32, logprobs=True)]
    engine = Engine(model, None, EngineConfig(num_slots=1024, max_context_len=256, tree_size=tree_size,
                                              overlap=True, drafter=drafter))
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = engine.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out, ref, p in zip(outs, expected, params):
        cut = ref.token_ids[:p.max_new_tokens]
        if 7 in p.stop_token_ids and 7 in cut:
            cut = cut[:cut.index(7) + 1]
        assert out.token_ids == cut
    torch.testing.assert_close(outs[0].logprobs, expected[0].logprobs, atol=1e-4, rtol=0)
    assert engine.sched.slots.available() == engine.sched.slots.num_slots


def test_sampling_on_the_device(model, prompts):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_new_tokens=24)
    _, a = generate(model, prompts, params, tree_size=8)
    _, b = generate(model, prompts, params, tree_size=8)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
