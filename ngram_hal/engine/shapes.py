"""Model shapes by name, for running the engine at real sizes with seeded random weights.

:data:`PRESETS` holds the Llama-family shapes the benchmarks use; :func:`load_shape` takes a
preset's name or a JSON file of :class:`~ngram_hal.engine.config.LlamaConfig` fields. The byte
counts say what a shape costs: :func:`parameter_bytes` what its weights occupy,
:func:`streamed_bytes` what one decode step reads of them (every projection and the LM head; the
embedding rows a step gathers are negligible), whose ratio to the device's copy bandwidth bounds
plain decoding at batch 1; :func:`roofline` bounds it at any batch by both the bytes (KV rows
included) and the operations of a step. :func:`check_fits` refuses a model and cache that cannot
fit before anything is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError

from .config import LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                            max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                            max_position_embeddings=131072, tie_word_embeddings=False),
    # 8 of Llama-3.1-70B's 80 layers, with its embedding and head: one layer's cost at that width.
    "llama-70b-slice": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=8,
                                   num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                   max_position_embeddings=131072, tie_word_embeddings=False),
}
"""Shapes of SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B and an 8-layer slice of Llama-3.1-70B."""


def load_shape(spec: str) -> tuple[str, LlamaConfig]:
    """``(name, config)`` of a preset's name or of a JSON file of LlamaConfig fields (named after
    the file); a ``ValueError`` naming what is wrong otherwise."""
    if spec in PRESETS:
        return spec, PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"shape {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    try:
        return path.stem, LlamaConfig(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError, ValidationError) as exc:
        raise ValueError(f"shape {spec!r}: not a LlamaConfig: {exc}") from exc


def _layer_parameters(config: LlamaConfig) -> int:
    hd, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return hd * (q_out + 2 * kv_out) + q_out * hd + 3 * hd * inter + 2 * hd


def parameter_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of every weight of the model in ``dtype``."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    total = config.num_layers * _layer_parameters(config) + embeddings + config.hidden_size
    return total * dtype.itemsize


def _product_parameters(config: LlamaConfig) -> int:
    """Weights a decode step multiplies its rows by: every layer's (norms included) and the LM head."""
    return config.num_layers * _layer_parameters(config) + config.vocab_size * config.hidden_size


def streamed_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: every layer's projections and norms, the final
    norm and the LM head."""
    return (_product_parameters(config) + config.hidden_size) * dtype.itemsize


def streaming_limit(streamed: int, bandwidth: float, batch: int, tokens_per_s: float) -> dict[str, float]:
    """The weight-streaming limit of plain decoding at ``batch`` requests a step (``batch *
    bandwidth / streamed``: every step reads the ``streamed`` bytes of weights once, at the copy
    ``bandwidth`` in bytes per second) and the share of it that ``tokens_per_s`` reached."""
    limit = batch * bandwidth / streamed
    return {"limit_tokens_per_s": limit, "fraction_of_limit": tokens_per_s / limit}


def step_work(config: LlamaConfig, dtype: torch.dtype, batch: int, context: int) -> tuple[float, float]:
    """``(flops, bytes)`` of one plain decode step of ``batch`` requests whose keys number ``context``
    each: two operations per weight and row (the norms' few weights counted alike, the LM head
    included), four per query head, head dimension and key in attention (scores and the weighted
    sum); the weights streamed once (:func:`streamed_bytes`) and every request's K and V rows read
    once."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    flops = 2 * batch * _product_parameters(config) + 4 * config.num_layers * batch * context * q_size
    kv_read = 2 * config.num_layers * batch * context * kv_size * dtype.itemsize
    return float(flops), float(streamed_bytes(config, dtype) + kv_read)


def roofline(config: LlamaConfig, dtype: torch.dtype, batch: int, context: int, bandwidth: float,
             flops_per_s: float, tokens_per_s: float) -> dict[str, float | str]:
    """Plain decoding's rooflines at ``batch`` requests of ``context`` keys: the tokens per second
    the device's ``bandwidth`` (bytes per second) allows for a step's bytes and its ``flops_per_s``
    for a step's operations (:func:`step_work`), which of the two binds, and the share of the
    lower one that ``tokens_per_s`` reached."""
    flops, nbytes = step_work(config, dtype, batch, context)
    memory, compute = batch * bandwidth / nbytes, batch * flops_per_s / flops
    bound = min(memory, compute)
    return {"memory_roof_tokens_per_s": memory, "compute_roof_tokens_per_s": compute,
            "bound_by": "memory" if memory <= compute else "compute", "fraction_of_roofline": tokens_per_s / bound}


def tensor_parallel_bytes(config: LlamaConfig, dtype: torch.dtype, rows: int) -> int:
    """Bytes each rank hands to the all-reduces of one forward of ``rows`` rows split by tensor
    parallelism: one after the output projection and one after the down projection of every layer,
    ``rows x hidden_size`` each. A ring all-reduce over N ranks sends (and receives) 2 (N - 1) / N
    of that per rank."""
    return 2 * config.num_layers * rows * config.hidden_size * dtype.itemsize


def kv_bytes(config: LlamaConfig, dtype: torch.dtype, num_slots: int) -> int:
    """Bytes of a KV cache of ``num_slots`` slots (K and V, every layer, the scratch slot included)."""
    return 2 * config.num_layers * (num_slots + 1) * config.num_kv_heads * config.head_dim * dtype.itemsize


def check_fits(name: str, config: LlamaConfig, dtype: torch.dtype, num_slots: int, free_bytes: int | None) -> None:
    """Raise ``MemoryError`` naming the shape and the sizes when its weights and a cache of
    ``num_slots`` slots need more than ``free_bytes`` (None: the device does not say; no check)."""
    if free_bytes is None:
        return
    weights, cache = parameter_bytes(config, dtype), kv_bytes(config, dtype, num_slots)
    if weights + cache > free_bytes:
        raise MemoryError(f"shape {name}: {weights / 1e9:.2f} GB of {str(dtype).removeprefix('torch.')} weights and "
                          f"{cache / 1e9:.2f} GB of KV cache ({num_slots} slots) need more than the "
                          f"{free_bytes / 1e9:.2f} GB free on the device")
