"""A Llama-family decoder in plain torch that keeps its K/V in the HAL's paged cache.

Per layer: RMSNorm (with the residual add), fused QKV projection, rotary embeddings at each
token's position and the K/V store, ``backend.attention`` over the cache, output projection,
RMSNorm and a SwiGLU MLP. Everything runs on ``backend.device``. The norm, rotary/store and SwiGLU
steps are the backend's model kernels (:meth:`Backend.layer_kernels
<ngram_hal.backend.Backend.layer_kernels>`: plain torch with the backend's ``store_kv``, or fused
Triton kernels where the backend runs Triton, which for few rows also fold the norms, SwiGLU and
the residual adds into the projections); the projections are the linear layers the same kernels
make (panel-packed float32 weights with a compiled small-row kernel on the reference backend's CPU,
``F.linear`` elsewhere, or a batch-invariant Triton product).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import contract as c
from ..backend import Backend
from ..kv_cache import KVCache
from ..model_kernels import Linear, default_dtype
from .config import LlamaConfig
from .gguf_loader import TokenizerMetadata, load_gguf


@dataclass
class ForwardBatch:
    """One forward pass over N new tokens of B requests (all index tensors int64 on the device).

    Request b contributes ``q_lens[b]`` consecutive rows of ``input_ids`` (requests in order);
    its tokens' K/V go to ``out_cache_loc`` (-1: not stored) and the caller has already put those
    slots into ``req_to_token[req_pool_indices[b], kv_lens[b] - q_lens[b] : kv_lens[b]]``.

    Attributes:
        input_ids: int64[N] token ids.
        positions: int64[N] rotary positions (``kv_lens[b] - q_lens[b] + i`` for plain extends;
            ``seq_len + depth`` for tree nodes).
        out_cache_loc: int64[N] slot of each token's K/V, -1 to skip.
        req_to_token: int64[R, M]. req_pool_indices, kv_lens, q_lens: int64[B].
        tree_mask: bool[B, D, D] for tree verify (then every ``q_lens[b] == D``), else None (causal).
        chains: every tree is a chain (node i the child of node i - 1), so its nodes sit at the
            positions plain decoding gives them: the same attention as a causal extend.
        max_kv_len: host int >= max(kv_lens); None computes it once per forward (a host sync).
        q_active: int64[B] or None: only request b's first ``q_active[b]`` queries attend (a verify
            step's nodes worth verifying); the rows of the others are computed from a zero attention
            output and mean nothing. None: every query attends.
        logits_index: int64[K] rows of N whose logits are returned; None returns all N.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    kv_lens: torch.Tensor
    q_lens: torch.Tensor
    tree_mask: torch.Tensor | None = None
    chains: bool = False
    max_kv_len: int | None = None
    q_active: torch.Tensor | None = None
    logits_index: torch.Tensor | None = None


@dataclass
class _Layer:
    attn_norm: torch.Tensor | None  # None: folded into wqkv (see ngram_hal.model_kernels.TorchLayerKernels.fold_norm)
    wqkv: Linear
    wo: Linear
    mlp_norm: torch.Tensor | None  # None: folded into w_gate_up
    w_gate_up: Linear
    w_down: Linear


def _required_weights(config: LlamaConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                  "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                                  "mlp.up_proj.weight", "mlp.down_proj.weight")]
    return names


def random_weights(config: LlamaConfig, seed: int = 0, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded weights under Hugging Face names, made on ``device`` in ``dtype`` (the same seed gives
    the same weights on one device; devices differ): projections normal with std 0.02, norm
    weights normal around 1 with std 0.1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hd, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hd), "model.norm.weight": (hd,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hd)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hd,), p + "post_attention_layernorm.weight": (hd,),
            p + "self_attn.q_proj.weight": (q_out, hd), p + "self_attn.k_proj.weight": (kv_out, hd),
            p + "self_attn.v_proj.weight": (kv_out, hd), p + "self_attn.o_proj.weight": (hd, q_out),
            p + "mlp.gate_proj.weight": (inter, hd), p + "mlp.up_proj.weight": (inter, hd),
            p + "mlp.down_proj.weight": (hd, inter),
        })
    weights = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        weights[name] = noise.mul_(0.1).add_(1.0) if len(shape) == 1 else noise.mul_(0.02)
    return weights


class LlamaModel:
    """Llama decoder over a :class:`KVCache`, its attention and K/V writes done by ``backend``.

    Args:
        config: the model's shape.
        weights: Hugging Face Llama names -> tensors (as :func:`load_gguf` returns); moved to
            ``backend.device`` and cast to ``dtype``.
        backend: the HAL backend that stores K/V and runs attention.
        dtype: float32, float16 or bfloat16; also the KV cache's dtype. None: float32 on the CPU,
            bfloat16 on an accelerator.
        batch_invariant: compute every projection with one fixed tiling whatever the number of rows
            (:mod:`ngram_hal.kernels.gpu.matmul`), so that a row's logits do not depend on its batch;
            needs a backend with that mode (``Backend.batch_invariant``). None (the default): the
            backend's choice, :meth:`~ngram_hal.Backend.invariant_by_default` (on for the Triton
            backends on a GPU), except for a shard of more than two ranks: an all-reduce of three
            or more partial sums may add them in an order that follows the message's size, which
            the mode does not fix (two add alike in either order).
        tensor_parallel: None for a whole model on one device; else the ranks of the process
            group this model is one shard of (:mod:`ngram_hal.engine.tensor_parallel`), 1 included:
            its row-parallel products are all-reduced through the backend's collectives, its
            vocabulary shards of logits all-gathered by :meth:`forward`, and :meth:`forward_argmax`
            gathers only each shard's best token and its logit.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], backend: Backend,
                 dtype: torch.dtype | None = None, batch_invariant: bool | None = None,
                 tensor_parallel: int | None = None):
        if dtype is None:
            dtype = default_dtype(backend.device)
        missing = [n for n in _required_weights(config) if n not in weights]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, first {missing[0]!r}")
        if dtype not in KVCache.DTYPES:
            raise ValueError(f"dtype must be one of {KVCache.DTYPES}, got {dtype}")
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.dtype = dtype
        self.tokenizer_metadata: TokenizerMetadata | None = None
        self.scale = config.head_dim ** -0.5
        if batch_invariant is None:
            batch_invariant = backend.invariant_by_default() and (tensor_parallel or 1) <= 2
        self.batch_invariant = batch_invariant
        self.tensor_parallel = tensor_parallel
        self.kernels = backend.layer_kernels(config, dtype, self.batch_invariant)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        make_linear = self.kernels.linear
        self.embed = make_linear(w("model.embed_tokens.weight"))
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else make_linear(w("lm_head.weight"))
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn_norm, wqkv = self.kernels.fold_norm(w(p + "input_layernorm.weight"), torch.cat(
                [w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"), w(p + "self_attn.v_proj.weight")]))
            mlp_norm, w_gate_up = self.kernels.fold_norm(w(p + "post_attention_layernorm.weight"), torch.cat(
                [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]))
            self.layers.append(_Layer(attn_norm=attn_norm, wqkv=make_linear(wqkv), wo=make_linear(w(p + "self_attn.o_proj.weight")),
                                      mlp_norm=mlp_norm, w_gate_up=make_linear(w_gate_up),
                                      w_down=make_linear(w(p + "mlp.down_proj.weight"))))

    @classmethod
    def from_gguf(cls, backend: Backend, path: str | os.PathLike | None = None,
                  dtype: torch.dtype | None = None, batch_invariant: bool | None = None) -> "LlamaModel":
        """Load a GGUF file (default: the SmolLM2-135M-Instruct file, see :func:`find_model_file`).

        The file's tokenizer metadata is kept as ``tokenizer_metadata``
        (``Tokenizer(model.tokenizer_metadata)`` builds the tokenizer without reading the file again).
        """
        if dtype is None:
            dtype = default_dtype(backend.device)
        config, weights, tokenizer = load_gguf(path, dtype=dtype)
        model = cls(config, weights, backend, dtype, batch_invariant)
        model.tokenizer_metadata = tokenizer
        return model

    @classmethod
    def random(cls, config: LlamaConfig, backend: Backend, dtype: torch.dtype = torch.float32,
               seed: int = 0, batch_invariant: bool | None = None) -> "LlamaModel":
        """A model with the seeded weights of :func:`random_weights`."""
        return cls(config, random_weights(config, seed), backend, dtype, batch_invariant)

    def new_kv_cache(self, num_slots: int) -> KVCache:
        """An empty cache of ``num_slots`` slots for this model's layers, KV heads and dtype."""
        cfg = self.config
        return KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)

    def _check(self, batch: ForwardBatch) -> None:
        op, dev = "forward", self.device
        c.check_index(op, "input_ids", batch.input_ids, dev, ndim=1)
        N = batch.input_ids.shape[0]
        c.check_index(op, "positions", batch.positions, dev, shape=(N,))
        c.check_index(op, "out_cache_loc", batch.out_cache_loc, dev, shape=(N,))
        if batch.logits_index is not None:
            c.check_index(op, "logits_index", batch.logits_index, dev, ndim=1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run the batch, writing its K/V into ``kv``.

        Returns:
            float32[K, V] logits of the rows ``batch.logits_index`` (float32[N, V] when None).
        """
        logits = self._shard_logits(batch, kv).float()
        if self.tensor_parallel is None:
            return logits
        # Every rank's vocabulary shard, in rank order: [K, V / tp] -> [K, V].
        parts = self.backend.all_gather(logits.contiguous())
        return parts.view(self.tensor_parallel, *logits.shape).transpose(0, 1).reshape(logits.shape[0], -1)

    @torch.inference_mode()
    def forward_argmax(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run the batch as :meth:`forward` does; return the greedy token of each returned row,
        int64[K] (the lowest of tied ids, as ``argmax`` takes). Under tensor parallelism the logits
        are not gathered: each rank's shard gives its best logit and token, one all-gather of 2
        float64 numbers a row (both exact there), and the best of the ranks' wins (the lower rank,
        so the lower id, on a tie)."""
        logits = self._shard_logits(batch, kv)
        if self.tensor_parallel is None:
            return self.kernels.argmax(logits)
        best, token = logits.float().max(-1)
        token = token + self.backend.collective_rank() * logits.shape[-1]
        pairs = self.backend.all_gather(torch.stack([best.double(), token.double()]).unsqueeze(0))
        return pairs[:, 1].gather(0, pairs[:, 0].argmax(0, keepdim=True)).squeeze(0).long()

    def _shard_logits(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """float[K, V / tp] in the model's dtype: this rank's vocabulary shard of the returned rows'
        logits (all of the vocabulary on one device)."""
        self._check(batch)
        cfg, be = self.config, self.backend
        N = batch.input_ids.shape[0]
        max_kv_len = batch.max_kv_len
        if self.batch_invariant:
            # One bound for every batch, so that attention splits each query's keys the same way.
            max_kv_len = batch.req_to_token.shape[1]
        elif max_kv_len is None:
            max_kv_len = int(batch.kv_lens.max()) if batch.kv_lens.numel() else 0
        q_size, kernels = cfg.num_heads * cfg.head_dim, self.kernels
        tree_mask = batch.tree_mask
        if self.batch_invariant and batch.chains:
            # A node of a branching tree reads its own path in the invariant mode, one node a tile;
            # a chain's nodes already sit where decoding puts them, so as a causal extend they give
            # the same bits, several nodes a tile sharing every key read.
            tree_mask = None
        layout = be.attention_layout(batch.req_to_token, batch.req_pool_indices, batch.kv_lens, batch.q_lens, N,
                                     tree_mask, max_kv_len, self.batch_invariant, batch.q_active)
        rope = kernels.rope(batch.positions)
        x = self.embed.rows(batch.input_ids)
        delta = None
        for i, layer in enumerate(self.layers):
            q = kernels.norm_rope_store(x, layer.attn_norm, layer.wqkv, rope, kv, i, batch.out_cache_loc, delta)
            o = be.attention(q, kv, i, batch.req_to_token, batch.req_pool_indices, batch.kv_lens, batch.q_lens,
                             self.scale, tree_mask, max_kv_len, layout)
            delta = self._row_parallel(o.reshape(N, q_size), layer.wo, x)
            h = kernels.norm_swiglu(x, layer.mlp_norm, layer.w_gate_up, delta)
            delta = self._row_parallel(h, layer.w_down, x)
        h = kernels.norm(x, self.norm, delta)
        if batch.logits_index is not None:
            h = h.index_select(0, batch.logits_index)
        return self.lm_head(h)

    def _row_parallel(self, y: torch.Tensor, linear, x: torch.Tensor) -> torch.Tensor | None:
        """The residual branch's last product of ``y``: as the kernels fuse it with the residual
        add on one device; under tensor parallelism each rank's partial sum, all-reduced."""
        if self.tensor_parallel is None:
            return self.kernels.linear_add(y, linear, x)
        return self.backend.all_reduce(linear(y))
