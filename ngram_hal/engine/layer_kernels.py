"""The model's per-layer compute around attention, in two implementations.

:class:`TorchLayerKernels` is plain torch on any device: RMSNorm, rotary embeddings and the K/V
store through the backend's ``store_kv``, SwiGLU, and the projections as the model's linear
layers. :class:`TritonLayerKernels` does the same work in the fused kernels of
:mod:`ngram_hal.kernels.gpu`: the residual add inside the norm, the rotary embedding inside the
K/V store, SwiGLU in one pass; and, for forwards of few rows (decode) or in the batch-invariant
mode, the norm and SwiGLU inside the products around them and the residual add inside the product
that precedes it. The model picks one by its backend's ``model_kernels``.

A layer runs as ``norm_linear`` (QKV), ``rope_store``, attention, ``linear_add`` (output
projection), ``norm_swiglu`` (gate/up and SwiGLU), ``linear_add`` (down). ``linear_add`` either
adds its product to the residual stream at once and returns None, or returns it as the pending
``delta`` that the next norm adds. ``fold_norm`` says how a layer keeps each norm's weight: apart,
or folded into the projection after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import Backend
from ..kv_cache import KVCache
from .config import LlamaConfig
from .linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype; times ``weight`` unless it is None."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return normed if weight is None else weight * normed


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


class TorchLayerKernels:
    """Norm, rotary + K/V store and SwiGLU in plain torch; the K/V store is the backend's op."""

    fuses_products = False

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype):
        self.config = config
        self.backend = backend
        self.dtype = dtype

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``weight * rmsnorm(x)`` (``rmsnorm(x)`` for a
        weight of None). x: float[N, hidden]."""
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


class TritonLayerKernels(TorchLayerKernels):
    """The same steps in the fused Triton kernels of :mod:`ngram_hal.kernels.gpu`.

    The rotary kernel reads cos/sin from a table of ``max_positions`` rows built once (positions
    past it are clamped) and writes K/V straight into the cache rows (-1 locs skipped). The
    norms' weights are folded into the projections after them. Forwards of at most
    ``backend.launch.fused_linear_rows`` rows run each projection whose weight holds at most
    ``fused_linear_max_bytes`` as a fused product (:data:`~ngram_hal.kernels.gpu.matmul.SMALL_ROWS`
    tiling); with ``batch_invariant`` every forward runs every projection so, in the fixed
    invariant tiling.
    """

    fuses_products = True

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype, batch_invariant: bool = False):
        super().__init__(config, backend, dtype)
        from ..kernels.gpu import matmul, norm, rotary, swiglu

        self._norm, self._rotary, self._swiglu = norm.rms_norm, rotary.rotary_store, swiglu.swiglu
        self._matmul = matmul
        self.table = rotary.rope_table(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                       backend.device)
        self.batch_invariant = batch_invariant
        launch = getattr(backend, "launch", None)
        self.fused_rows = launch.fused_linear_rows if launch is not None else 0
        self.fused_bytes = launch.fused_linear_max_bytes if launch is not None else 0
        self._ones = torch.ones(config.hidden_size, dtype=dtype, device=backend.device)

    def _tiling(self, rows: int, linear: Linear):
        """The fused product's tiling for ``rows`` rows, or None to run the steps apart."""
        if self.batch_invariant:
            return self._matmul.INVARIANT
        weight = linear.weight
        if rows > self.fused_rows or weight.numel() * weight.element_size() > self.fused_bytes:
            return None
        return self._matmul.SMALL_ROWS

    def norm(self, x, weight, delta=None):
        return self._norm(x, self._ones if weight is None else weight, self.config.rms_norm_eps, delta)

    def rope(self, positions):
        return positions

    def rope_store(self, rope, qkv, kv, layer, out_cache_loc):
        cfg = self.config
        return self._rotary(qkv, rope, self.table, kv.k[layer], kv.v[layer], out_cache_loc, cfg.num_heads,
                            cfg.num_kv_heads)

    def swiglu(self, gate_up):
        return self._swiglu(gate_up)

    def fold_norm(self, norm, weight):
        """The norm's weight folded into the projection's (``W * g``): the norm then only scales rows."""
        return None, self._matmul.fold_norm(weight, norm)

    def norm_linear(self, x, norm, linear, delta=None):
        tiling = self._tiling(x.shape[0], linear) if delta is None else None
        if tiling is None:
            return super().norm_linear(x, norm, linear, delta)
        return self._matmul.fused_linear(x, linear.weight, norm_eps=self.config.rms_norm_eps, tiling=tiling)

    def norm_swiglu(self, x, norm, linear, delta=None):
        tiling = self._tiling(x.shape[0], linear) if delta is None else None
        if tiling is None:
            return super().norm_swiglu(x, norm, linear, delta)
        return self._matmul.fused_linear(x, linear.weight, norm_eps=self.config.rms_norm_eps, glu=True,
                                         tiling=tiling)

    def linear_add(self, y, linear, x):
        tiling = self._tiling(y.shape[0], linear)
        if tiling is None:
            return super().linear_add(y, linear, x)
        self._matmul.fused_linear(y, linear.weight, residual=x, tiling=tiling)
        return None


def make_layer_kernels(config: LlamaConfig, backend: Backend, dtype: torch.dtype,
                       batch_invariant: bool = False) -> TorchLayerKernels:
    """The ops for ``backend``: its ``model_kernels`` ("torch" or "triton")."""
    kind = getattr(backend, "model_kernels", "torch")
    if kind == "triton":
        return TritonLayerKernels(config, backend, dtype, batch_invariant)
    if kind == "torch":
        return TorchLayerKernels(config, backend, dtype)
    raise ValueError(f"backend '{backend.name}': unknown model_kernels {kind!r} (expected 'torch' or 'triton')")
