"""Model shapes: the presets' byte counts, JSON shapes, the memory check, random weights by device."""

from __future__ import annotations

import json

import pytest
import torch

from ngram_hal.engine.model import LlamaModel, random_weights
from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.shapes import (PRESETS, check_fits, kv_bytes, load_shape, parameter_bytes, roofline, step_work,
                                    streamed_bytes, tensor_parallel_bytes)
from ngram_hal.reference import CpuBackend


def test_the_presets_stream_the_weights_of_their_models():
    """bf16 bytes a decode step reads: 2.47 GB for Llama-3.2-1B, 15.0 GB for Llama-3.1-8B."""
    assert streamed_bytes(PRESETS["llama-1b"], torch.bfloat16) == pytest.approx(2.47e9, rel=0.005)
    assert streamed_bytes(PRESETS["llama-8b"], torch.bfloat16) == pytest.approx(15.0e9, rel=0.005)
    # A tied head is streamed but held once; an untied one adds its own matrix.
    one = PRESETS["llama-1b"]
    assert parameter_bytes(one, torch.bfloat16) == streamed_bytes(one, torch.bfloat16)
    eight = PRESETS["llama-8b"]
    embed = eight.vocab_size * eight.hidden_size * 2
    assert parameter_bytes(eight, torch.bfloat16) == streamed_bytes(eight, torch.bfloat16) + embed


def test_a_steps_work_counts_products_attention_and_kv_reads():
    """One layer of hidden 4, two query heads and one KV head of dimension 2, intermediate 8, vocab 16:
    4*(2*2 + 2*2) + 4*4 + 3*4*8 + 2*4 = 152 layer weights (its two norms counted), 64 in the head;
    3 requests of 10 keys."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=2, max_position_embeddings=64)
    flops, nbytes = step_work(cfg, torch.bfloat16, batch=3, context=10)
    assert flops == 2 * 3 * (152 + 64) + 4 * 3 * 10 * 4
    assert nbytes == streamed_bytes(cfg, torch.bfloat16) + 2 * 3 * 10 * 2 * 2


def test_the_roofline_is_the_lower_roof_and_names_it():
    cfg = PRESETS["llama-8b"]
    flops, nbytes = step_work(cfg, torch.bfloat16, batch=1, context=512)
    # Batch 1 at 4 TB/s and 800 TFLOP/s: bytes bind (about 15 GB a step against 16 GFLOP).
    one = roofline(cfg, torch.bfloat16, 1, 512, 4e12, 8e14, tokens_per_s=200.0)
    assert one["bound_by"] == "memory" and one["memory_roof_tokens_per_s"] == pytest.approx(4e12 / nbytes)
    assert one["fraction_of_roofline"] == pytest.approx(200.0 * nbytes / 4e12)
    # With a thousandth of the throughput the operations bind.
    slow = roofline(cfg, torch.bfloat16, 1, 512, 4e12, 8e11, tokens_per_s=10.0)
    assert slow["bound_by"] == "compute" and slow["compute_roof_tokens_per_s"] == pytest.approx(8e11 / flops)
    assert slow["fraction_of_roofline"] == pytest.approx(10.0 * flops / 8e11)


def test_parameter_bytes_counts_every_weight_of_a_model():
    tiny = PRESETS["smollm2-135m"].model_copy(update={"num_layers": 2, "vocab_size": 64})
    weights = random_weights(tiny)
    assert parameter_bytes(tiny, torch.float32) == sum(t.numel() for t in weights.values()) * 4


def test_a_shape_is_a_preset_or_a_json_file(tmp_path):
    assert load_shape("llama-8b") == ("llama-8b", PRESETS["llama-8b"])
    path = tmp_path / "narrow.json"
    path.write_text(json.dumps({"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_layers": 1,
                                "num_heads": 2, "num_kv_heads": 1, "head_dim": 8}))
    name, config = load_shape(str(path))
    assert name == "narrow" and config.hidden_size == 16
    with pytest.raises(ValueError, match="'llama-9b': neither a preset"):
        load_shape("llama-9b")
    path.write_text(json.dumps({"vocab_size": 32}))
    with pytest.raises(ValueError, match="narrow.json': not a LlamaConfig"):
        load_shape(str(path))


def test_a_model_that_cannot_fit_is_refused_before_anything_is_made():
    config = PRESETS["llama-8b"]
    need = parameter_bytes(config, torch.bfloat16) + kv_bytes(config, torch.bfloat16, 4096)
    check_fits("llama-8b", config, torch.bfloat16, 4096, need)
    check_fits("llama-8b", config, torch.bfloat16, 4096, None)
    with pytest.raises(MemoryError, match=r"shape llama-8b: 16.06 GB of bfloat16 weights and 0.54 GB of KV cache "
                                          r"\(4096 slots\) need more than the 16.00 GB free"):
        check_fits("llama-8b", config, torch.bfloat16, 4096, 16_000_000_000)


def test_random_weights_are_made_in_the_dtype_asked_for_and_seeded():
    tiny = PRESETS["smollm2-135m"].model_copy(update={"num_layers": 1, "vocab_size": 64})
    a, b = random_weights(tiny, seed=4, dtype=torch.bfloat16), random_weights(tiny, seed=4, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, b[n]) for n, t in a.items())
    model = LlamaModel(tiny, a, CpuBackend(), torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_tensor_parallel_bytes_per_token():
    """Two all-reduces of a hidden-wide bf16 row per layer: 512 KiB a token at 8B, 2.5 MiB at 70B's 80 layers."""
    assert tensor_parallel_bytes(PRESETS["llama-8b"], torch.bfloat16, 1) == 2 * 32 * 4096 * 2 == 512 * 2**10
    full_70b = PRESETS["llama-70b-slice"].model_copy(update={"num_layers": 80})
    assert tensor_parallel_bytes(full_70b, torch.bfloat16, 16) == 16 * 2.5 * 2**20
