"""Tensor parallelism on the CPU (gloo): a model split over ranks decodes what the whole model
decodes. SmolLM2-135M at TP = 3 (its 3 KV heads, 9 query heads and 1,536 intermediate split
evenly) against TP = 1 in fp32, with and without speculation; a random-weight shape at TP = 2;
the collectives' path at one rank (gloo, and nccl where a CUDA device is present); the greedy
token taken across the ranks' vocabulary shards without gathering the logits, ties included."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.collectives import launch
from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.gguf_loader import find_model_file
from ngram_hal.engine.model import ForwardBatch, LlamaModel, random_weights
from ngram_hal.engine.request import SamplingParams
from ngram_hal.engine.tensor_parallel import check_divisible, shard
from ngram_hal.engine.tokenizer import Tokenizer
from ngram_hal.engine.workload import load_prompts
from ngram_hal.reference import CpuBackend

NEW_TOKENS = 12
TREE_SIZES = (1, 8)
SHAPE = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16)
LOGITS_TOLERANCE = 1e-4
"""Largest difference allowed between the split model's fp32 logits and the whole model's: the
ranks' partial sums add in another order."""
SMOLLM2_LOGITS_TOLERANCE = 2e-3
"""The same for SmolLM2-135M's prompt prefill: 30 layers of reordered fp32 sums, on logits up to
about 40 (measured: 7e-5)."""


def decode(model: LlamaModel, prompts: list[list[int]]) -> dict:
    """Greedy tokens of ``prompts`` at each tree size, and the logits of the first prompt's prefill."""
    out = {}
    for tree_size in TREE_SIZES:
        engine = Engine(model, None, EngineConfig(tree_size=tree_size, num_slots=4096, max_context_len=1024,
                                                  max_running=4), eos_token_ids=[])
        done = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        out[tree_size] = [o.token_ids for o in done]
    return out


def smollm2_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat(spec.messages) for spec in load_prompts(None)]


def smollm2_rank(rank: int, world: int) -> dict:
    from ngram_hal.engine.tensor_parallel import load_shard

    torch.set_num_threads(1)
    model = load_shard(CpuBackend(), None, torch.float32, rank, world)
    prompts = smollm2_prompts(Tokenizer(model.tokenizer_metadata))
    return decode(model, prompts), prefill_logits(model, prompts[0])


def random_rank(rank: int, world: int, prompts: list[list[int]]) -> tuple[dict, torch.Tensor]:
    torch.set_num_threads(1)
    config, weights = shard(SHAPE, random_weights(SHAPE, 0), rank, world)
    model = LlamaModel(config, weights, CpuBackend(), torch.float32, tensor_parallel=world)
    return decode(model, prompts), prefill_logits(model, prompts[0])


def prefill_logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    """The logits of ``prompt``'s prefill, through the engine's model forward."""
    return model.forward(prefill_batch(prompt, model.device), model.new_kv_cache(len(prompt)))


def prefill_batch(prompt: list[int], device) -> ForwardBatch:
    """A prefill of ``prompt`` into slots 0..n-1, every row's logits returned."""
    n = len(prompt)
    ar = torch.arange(n, device=device)
    return ForwardBatch(input_ids=torch.tensor(prompt, device=device), positions=ar, out_cache_loc=ar,
                        req_to_token=ar.view(1, n), req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
                        kv_lens=torch.tensor([n], device=device), q_lens=torch.tensor([n], device=device))


def test_smollm2_split_over_three_ranks_decodes_as_the_whole_model():
    try:
        path = find_model_file()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"model file not available: {exc}")
    whole = LlamaModel.from_gguf(CpuBackend(), path, torch.float32)
    prompts = smollm2_prompts(Tokenizer(whole.tokenizer_metadata))
    want, want_logits = decode(whole, prompts), prefill_logits(whole, prompts[0])
    for rank, (got, logits) in enumerate(launch(smollm2_rank, 3, "gloo")):
        for tree_size in TREE_SIZES:
            assert got[tree_size] == want[tree_size], f"rank {rank}, tree size {tree_size}"
        assert (logits - want_logits).abs().max() <= SMOLLM2_LOGITS_TOLERANCE, f"rank {rank}"


def test_a_random_shape_split_over_two_ranks():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    whole = LlamaModel(SHAPE, random_weights(SHAPE, 0), CpuBackend(), torch.float32)
    want, want_logits = decode(whole, prompts), prefill_logits(whole, prompts[0])
    for rank, (got, logits) in enumerate(launch(random_rank, 2, "gloo", prompts)):
        assert got == want, f"rank {rank}"
        assert logits.shape == want_logits.shape
        assert (logits - want_logits).abs().max() <= LOGITS_TOLERANCE, f"rank {rank}"


def test_sizes_that_do_not_split_and_auto_are_refused():
    with pytest.raises(ValueError, match="over 3 ranks: num_kv_heads 2 is not a multiple of 3"):
        check_divisible(SHAPE, 3)
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        shard(SHAPE, random_weights(SHAPE, 0), 2, 2)
    config, weights = shard(SHAPE, random_weights(SHAPE, 0), 0, 2)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (2, 1, 64)
    model = LlamaModel(config, weights, CpuBackend(), torch.float32, tensor_parallel=2)
    with pytest.raises(ValueError, match="spec_policy 'auto' under tensor parallelism"):
        Engine(model, None, EngineConfig(spec_policy="auto", num_slots=64, max_context_len=64))


def tied_rank(rank: int, world: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tokens of every prefill row by :meth:`forward_argmax` and by the gathered
    logits, for a head whose second half of the vocabulary repeats its first half (every best
    logit is tied between two ranks' shards)."""
    torch.set_num_threads(1)
    weights = random_weights(SHAPE, 0)
    head = weights["model.embed_tokens.weight" if SHAPE.tie_word_embeddings else "lm_head.weight"]
    half = SHAPE.vocab_size // 2
    head[half:] = head[:half]
    config, part = shard(SHAPE, weights, rank, world)
    model = LlamaModel(config, part, CpuBackend(), torch.float32, tensor_parallel=world)
    batch = prefill_batch(prompt, model.device)
    return (model.forward_argmax(batch, model.new_kv_cache(len(prompt))),
            model.forward(batch, model.new_kv_cache(len(prompt))).argmax(-1))


def test_the_greedy_token_is_taken_across_shards_without_the_logits():
    prompt = torch.randint(0, SHAPE.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    for rank, (tokens, from_logits) in enumerate(launch(tied_rank, 2, "gloo", prompt)):
        assert torch.equal(tokens, from_logits), f"rank {rank}"
        assert bool((tokens < SHAPE.vocab_size // 2).all()), "a tie goes to the lower id, in the lower rank's shard"


def one_rank(rank: int, world: int, device: str, prompts: list[list[int]]) -> dict:
    torch.set_num_threads(1)
    config, weights = shard(SHAPE, random_weights(SHAPE, 0), rank, world)
    model = LlamaModel(config, weights, CpuBackend(device=device), torch.float32, tensor_parallel=world)
    return decode(model, prompts)


@pytest.mark.parametrize("group,device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_one_rank_runs_the_collectives_path(group, device):
    """A process group of one: every all-reduce and gather runs (on NCCL where a GPU is present)
    and the tokens are the whole model's."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    whole = decode(LlamaModel(SHAPE, random_weights(SHAPE, 0), CpuBackend(device=device), torch.float32), prompts)
    assert launch(one_rank, 1, group, device, prompts) == [whole]
