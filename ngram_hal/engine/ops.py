"""The model's per-layer compute besides the projections and attention, in two implementations.

:class:`TorchOps` is plain torch on any device: RMSNorm, rotary embeddings and the K/V store
through the backend's ``store_kv``, SwiGLU. :class:`TritonOps` does the same work in the fused
kernels of :mod:`ngram_hal.kernels.gpu`: the residual add inside the norm, the rotary embedding
inside the K/V store, SwiGLU in one pass; three launches where plain torch takes about fifteen.
The model picks one by its backend's ``model_kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import Backend
from ..memory.kv_cache import KVCache
from .config import LlamaConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position, float32 math: two ``[N, 1, head_dim]`` tensors of ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                               .float() / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [N, heads, d] by the "rotate half" convention (pairs ``i`` and ``i + d/2``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TorchOps:
    """Norm, rotary + K/V store and SwiGLU in plain torch; the K/V store is the backend's op."""

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype):
        self.config = config
        self.backend = backend
        self.dtype = dtype

    def norm(self, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``weight * rmsnorm(x)``. x: float[N, hidden]."""
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def rope(self, positions: torch.Tensor):
        """What :meth:`rope_store` needs for the positions of one forward (computed once)."""
        return rotary(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

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

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection float[N, 2I] -> float[N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps(TorchOps):
    """The same steps in the fused Triton kernels of :mod:`ngram_hal.kernels.gpu`.

    The rotary kernel reads cos/sin from a table of ``max_positions`` rows built once (positions
    past it are clamped) and writes K/V straight into the cache rows (-1 locs skipped).
    """

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype):
        super().__init__(config, backend, dtype)
        from ..kernels.gpu import norm, rotary, swiglu

        self._norm, self._rotary, self._swiglu = norm.rms_norm, rotary.rotary_store, swiglu.swiglu
        self.table = rotary.rope_table(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                       backend.device)

    def norm(self, x, weight, delta=None):
        return self._norm(x, weight, self.config.rms_norm_eps, delta)

    def rope(self, positions):
        return positions

    def rope_store(self, rope, qkv, kv, layer, out_cache_loc):
        cfg = self.config
        return self._rotary(qkv, rope, self.table, kv.k[layer], kv.v[layer], out_cache_loc, cfg.num_heads,
                            cfg.num_kv_heads)

    def swiglu(self, gate_up):
        return self._swiglu(gate_up)


def make_ops(config: LlamaConfig, backend: Backend, dtype: torch.dtype) -> TorchOps:
    """The ops for ``backend``: its ``model_kernels`` ("torch" or "triton")."""
    kind = getattr(backend, "model_kernels", "torch")
    if kind == "triton":
        return TritonOps(config, backend, dtype)
    if kind == "torch":
        return TorchOps(config, backend, dtype)
    raise ValueError(f"backend '{backend.name}': unknown model_kernels {kind!r} (expected 'torch' or 'triton')")
