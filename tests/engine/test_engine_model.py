"""The engine on the real SmolLM2-135M-Instruct: short greedy checks only (CPU time is scarce)."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.gguf_loader import find_model_file
from ngram_hal.engine.request import SamplingParams
from ngram_hal.reference import CpuBackend

try:
    find_model_file()
except (FileNotFoundError, OSError) as exc:
    pytest.skip(f"model file not available: {exc}", allow_module_level=True)

MESSAGES = [
    [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, and the cat sat on the mat again."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Rename x to count:\n\ndef f(x):\n    x = x + 1\n    return x * x\n"}],
]


@pytest.fixture(scope="module")
def loaded():
    from ngram_hal.engine.model import LlamaModel
    from ngram_hal.engine.tokenizer import Tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = LlamaModel.from_gguf(CpuBackend())
    yield model, Tokenizer(model.tokenizer_metadata)
    torch.set_num_threads(threads)


def test_greedy_speculative_equals_plain_on_the_real_model(loaded):
    model, tok = loaded
    prompts = [tok.encode_chat(m) for m in MESSAGES]
    params = SamplingParams(max_new_tokens=20, logprobs=True)
    cfg = dict(num_slots=1024, max_context_len=256)
    plain = Engine(model, tok, EngineConfig(tree_size=1, overlap=False, **cfg)).generate(prompts, params)
    spec_engine = Engine(model, tok, EngineConfig(tree_size=8, overlap=True, **cfg))
    spec = spec_engine.generate(prompts, params)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=2e-3, rtol=0)
    assert "Paris" in plain[1].text
    assert spec_engine.stats.tokens_per_step > 1.0
    assert sum(o.verify_steps for o in spec) < sum(o.verify_steps for o in plain)


def test_eos_and_stop_string_on_the_real_model(loaded):
    model, tok = loaded
    engine = Engine(model, tok, EngineConfig(tree_size=8, num_slots=1024, max_context_len=256))
    prompt = tok.encode_chat(MESSAGES[1])
    out = engine.generate([prompt], SamplingParams(max_new_tokens=40))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert "<|im_end|>" not in out.text
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop=("Paris",)))[0]
    assert cut.finish_reason == "stop"
    assert out.text.startswith(cut.text) and "Paris" not in cut.text
    assert tok.decode(cut.token_ids).find("Paris") >= 0
