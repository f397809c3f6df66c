"""The model kernels: the per-layer compute around attention that the model runs through its
backend, and their plain-torch implementation, which is every backend's default and the oracle
the conformance suite's model tier checks others against.

:class:`TorchLayerKernels` is plain torch on any device: RMSNorm, rotary embeddings and the K/V
store through the backend's ``store_kv``, SwiGLU, and the projections as the model's linear
layers. A backend with kernels of its own returns a subclass from
:meth:`Backend.layer_kernels <ngram_hal.backend.Backend.layer_kernels>` (the Triton backends:
:class:`~ngram_hal.kernels.gpu.layer_kernels.TritonLayerKernels`).

A layer runs as ``norm_rope_store`` (QKV: ``norm_linear`` then ``rope_store``, which a backend
may fuse), attention, ``linear_add`` (output projection), ``norm_swiglu`` (gate/up and SwiGLU),
``linear_add`` (down). ``linear_add`` either
adds its product to the residual stream at once and returns None, or returns it as the pending
``delta`` that the next norm adds. ``fold_norm`` says how a layer keeps each norm's weight: apart,
or folded into the projection after it, and ``linear`` makes the model's linear layers (a
:class:`Linear`: :class:`DenseLinear` here, the backend's fastest product in a subclass).
``config`` is the model's shape (a :class:`~ngram_hal.engine.config.LlamaConfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from .kv_cache import KVCache

if TYPE_CHECKING:
    from .backend import Backend
    from .engine.config import LlamaConfig


class Linear(Protocol):
    """A linear layer over a weight float[N, K] (``out_features`` N, ``in_features`` K):
    ``layer(x)`` is ``x @ weight.T`` (float[M, K] -> float[M, N]), ``layer.rows(ids)`` an embedding
    lookup (int64[n] -> float[n, K], for a weight tied to the token embeddings) and
    ``layer.dense()`` the weight itself."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor: ...


class DenseLinear:
    """``x @ weight.T`` through ``F.linear`` on the weight's device, in its dtype (a :class:`Linear`).

    Args:
        weight: float[N, K].
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float[M, K] -> float[M, N]."""
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """int64[n] -> float[n, K]."""
        return F.embedding(ids, self.weight)

    def dense(self) -> torch.Tensor:
        """The weight, float[N, K]."""
        return self.weight


def default_dtype(device: torch.device) -> torch.dtype:
    """The model dtype a device runs best: float32 on the CPU, bfloat16 on an accelerator."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype; times ``weight`` unless it is None."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return normed if weight is None else weight * normed


def rope_frequencies(config: LlamaConfig, device) -> torch.Tensor:
    """float32[head_dim / 2]: the rotary frequencies ``rope_theta ** (-2j / head_dim)``, each divided
    by its ``rope_freq_factors`` entry where the model scales them."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device=device)
    return inv_freq


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position at the frequencies ``inv_freq`` (float32[head_dim / 2], from
    :func:`rope_frequencies`), float32 math: two ``[N, 1, head_dim]`` tensors of ``dtype``."""
    freqs = positions.float().unsqueeze(1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [N, heads, d] by the "rotate half" convention (pairs ``i`` and ``i + d/2``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TorchLayerKernels:
    """Norm, rotary + K/V store and SwiGLU in plain torch; the K/V store is the backend's op."""

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype):
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.inv_freq = rope_frequencies(config, backend.device)

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``weight * rmsnorm(x)`` (``rmsnorm(x)`` for a
        weight of None). x: float[N, hidden]."""
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def rope(self, positions: torch.Tensor):
        """What :meth:`rope_store` needs for the positions of one forward (computed once)."""
        return rotary(positions, self.inv_freq, self.dtype)

    def rope_store(self, rope, qkv: torch.Tensor, kv: KVCache, layer: int, out_cache_loc: torch.Tensor
                   ) -> torch.Tensor:
        """Rotate the new tokens' queries and keys and store K/V of ``layer``; returns q [N, Hq, d]."""
        cfg = self.config
        N, Hq, H, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk, v = qkv.split([(Hq + H) * d, H * d], dim=-1)
        qk = apply_rotary(qk.reshape(N, Hq + H, d), *rope)
        q, k = qk.split([Hq, H], dim=1)
        self.backend.store_kv(kv, layer, out_cache_loc, k.contiguous(), v.reshape(N, H, d).contiguous())
        return q.contiguous()

    def norm_rope_store(self, x: torch.Tensor, norm: torch.Tensor | None, linear: Linear, rope, kv: KVCache,
                        layer: int, out_cache_loc: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The QKV step of a layer: ``rope_store(rope, norm_linear(x, norm, linear, delta), kv, layer,
        out_cache_loc)``; x float[N, hidden] -> the rotated queries float[N, Hq, d], K/V stored."""
        return self.rope_store(rope, self.norm_linear(x, norm, linear, delta), kv, layer, out_cache_loc)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection float[N, 2I] -> float[N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row: float[K, V] -> int64[K], the lowest index of the row's
        largest logit."""
        return logits.argmax(-1)

    def linear(self, weight: torch.Tensor) -> Linear:
        """The linear layer the model runs over ``weight`` (float[N, K], on the device, in the
        model's dtype)."""
        return DenseLinear(weight)

    def fold_norm(self, norm: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The (norm weight, projection weight) pair a layer keeps for ``norm_linear``/``norm_swiglu``:
        here both as given."""
        return norm, weight

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor | None, linear: Linear,
                    delta: torch.Tensor | None = None) -> torch.Tensor:
        """``linear(norm(x, norm, delta))``: float[N, hidden] -> float[N, out]."""
        return linear(self.norm(x, norm, delta))

    def norm_swiglu(self, x: torch.Tensor, norm: torch.Tensor | None, linear: Linear,
                    delta: torch.Tensor | None = None) -> torch.Tensor:
        """``swiglu(linear(norm(x, norm, delta)))`` of the fused gate/up projection: float[N, hidden]
        -> float[N, I]."""
        return self.swiglu(self.norm_linear(x, norm, linear, delta))

    def linear_add(self, y: torch.Tensor, linear: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """The residual branch's last product ``linear(y)``; returned as the next norm's ``delta``
        (here), or added to ``x`` in place (then None)."""
        return linear(y)
