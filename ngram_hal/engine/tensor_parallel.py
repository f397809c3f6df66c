"""Tensor parallelism: one rank's shard of a Llama model.

:func:`shard` cuts a model's weights (Hugging Face names, ``[out, in]``) for rank ``r`` of ``N``:

- attention by KV heads: rank r keeps KV heads ``[r*H/N, (r+1)*H/N)`` and the query heads that
  read them (the same contiguous block of ``Hq/N``, which keeps grouped-query pairs together),
  so its KV cache holds its own heads only;
- the MLP by its intermediate size: rows of gate and up, columns of down;
- the output and down projections by columns (row-parallel): each rank's product is a partial
  sum, which :class:`~ngram_hal.engine.model.LlamaModel` all-reduces before the residual add;
- the LM head by vocabulary: rows ``[r*V/N, (r+1)*V/N)`` (of the embedding when it is tied), whose
  logits the model all-gathers;
- the embedding and the norms whole on every rank.

The shard's :class:`LlamaConfig` has the rank's head and intermediate counts and the whole
vocabulary (token ids and logits keep their meaning), with an untied head.
"""

from __future__ import annotations

import os

import torch

from ..backend import Backend
from .config import LlamaConfig
from .gguf_loader import load_gguf
from .model import LlamaModel


def check_divisible(config: LlamaConfig, world: int) -> None:
    """A ``ValueError`` naming the first size that ``world`` ranks cannot split evenly."""
    for name in ("num_kv_heads", "num_heads", "intermediate_size", "vocab_size"):
        size = getattr(config, name)
        if size % world:
            raise ValueError(f"tensor parallelism over {world} ranks: {name} {size} is not a multiple of {world}")


def shard(config: LlamaConfig, weights: dict[str, torch.Tensor], rank: int, world: int
          ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, weights)`` of rank ``rank``'s shard of ``world``; ``weights`` as
    :func:`~ngram_hal.engine.model.random_weights` or :func:`load_gguf` give them."""
    check_divisible(config, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    d = config.head_dim

    def block(n: int) -> slice:
        return slice(rank * n // world, (rank + 1) * n // world)

    q, kv, inter = block(config.num_heads * d), block(config.num_kv_heads * d), block(config.intermediate_size)
    out = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"],
           "model.norm.weight": weights["model.norm.weight"],
           "lm_head.weight": weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
           [block(config.vocab_size)]}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = weights[p + name]
        out[p + "self_attn.q_proj.weight"] = weights[p + "self_attn.q_proj.weight"][q]
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            out[p + name] = weights[p + name][kv]
        out[p + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"][:, q]
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            out[p + name] = weights[p + name][inter]
        out[p + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"][:, inter]
    local = config.model_copy(update={"num_heads": config.num_heads // world,
                                      "num_kv_heads": config.num_kv_heads // world,
                                      "intermediate_size": config.intermediate_size // world,
                                      "tie_word_embeddings": False})
    return local, out


def load_shard(backend: Backend, path: str | os.PathLike | None, dtype: torch.dtype | None, rank: int,
               world: int, batch_invariant: bool | None = None) -> LlamaModel:
    """Rank ``rank``'s shard of the GGUF file ``path`` (default: the bundled model) on ``backend``,
    in a process group of ``world`` ranks (:func:`ngram_hal.collectives.init_group`);
    ``batch_invariant`` as :class:`~ngram_hal.engine.model.LlamaModel` takes it."""
    config, weights, tokenizer = load_gguf(path, torch.float32)
    local, part = shard(config, weights, rank, world)
    model = LlamaModel(local, part, backend, dtype, batch_invariant, tensor_parallel=world)
    model.tokenizer_metadata = tokenizer
    return model
