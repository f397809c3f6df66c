"""The Triton backends' model kernels: the steps of
:class:`~ngram_hal.model_kernels.TorchLayerKernels` in the fused kernels of this package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...model_kernels import DenseLinear, Linear, TorchLayerKernels
from ..triton.products import Tiling, choose, choose_invariant
from . import argmax, matmul, norm, rotary, swiglu
from .rotary import RopeStore

if TYPE_CHECKING:
    from ...backend import Backend
    from ...engine.config import LlamaConfig


class TritonLinear(DenseLinear):
    """``x @ weight.T`` (the LM head) in the product the kernels choose for its rows: the fused
    product in a tiling, or ``F.linear``."""

    def __init__(self, weight: torch.Tensor, kernels: TritonLayerKernels):
        super().__init__(weight)
        self.kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float[M, K] -> float[M, N]."""
        tiling = self.kernels.tiling(x.shape[0], self)
        if tiling is None:
            return super().__call__(x)
        return matmul.fused_linear(x.contiguous(), self.weight, tiling=tiling, pdl=self.kernels.pdl(self))


class TritonLayerKernels(TorchLayerKernels):
    """The same steps in the fused Triton kernels of :mod:`ngram_hal.kernels.gpu`: the residual add
    inside the norm, the rotary embedding inside the K/V store, SwiGLU in one pass.

    The rotary kernel reads cos/sin from a table of ``max_positions`` rows built once (positions
    past it are clamped) and writes K/V straight into the cache rows (-1 locs skipped); where the
    QKV projection runs as a fused product (and the launch's ``rope_in_product``), that product
    does the rotation and the store itself (one launch fewer a layer) unless its tiling says the
    rotary kernel does (``Tiling.rotate``: many rows, where the product's epilogue costs more). The
    norms' weights are folded into the projections after them. Each projection runs as the
    launch's product table chooses for its weight shape and rows; shapes it does not list, by the
    fixed rule: forwards of at most ``backend.launch.fused_linear_rows`` rows run each projection
    whose weight holds at most ``fused_linear_max_bytes`` as a fused product
    (:data:`~ngram_hal.kernels.gpu.matmul.SMALL_ROWS` tiling). With ``batch_invariant`` every
    projection is a fused product over the same runs of K at every row count: in the table's fastest
    fused tiling of those runs for the rows where its sweep found their bits equal
    (:func:`~ngram_hal.kernels.triton.products.choose_invariant`), else in one tiling for every row
    count. Where the launch has ``pdl`` the kernels launch early
    (:mod:`ngram_hal.kernels.triton.pdl`), the products only up to ``pdl_max_weight_bytes``.
    """

    def __init__(self, config: LlamaConfig, backend: Backend, dtype: torch.dtype, batch_invariant: bool = False):
        super().__init__(config, backend, dtype)
        self._norm, self._rotary, self._swiglu = norm.rms_norm, rotary.rotary_store, swiglu.swiglu
        self._matmul = matmul
        self.table = rotary.rope_table(self.inv_freq, config.max_position_embeddings)
        self.batch_invariant = batch_invariant
        self.launch = backend.launch
        self._ones = torch.ones(config.hidden_size, dtype=dtype, device=backend.device)

    def tiling(self, rows: int, linear: Linear) -> Tiling | None:
        """The fused product's tiling for a forward of ``rows`` rows through ``linear``, or None to
        run the steps apart."""
        weight = linear.weight
        table = self.launch.products
        choice = None if table is None else table.lookup(*weight.shape)
        if self.batch_invariant:
            return self._matmul.INVARIANT if choice is None else choose_invariant(choice, rows)
        if choice is not None:
            return choose(choice, rows)
        nbytes = weight.numel() * weight.element_size()
        if rows > self.launch.fused_linear_rows or nbytes > self.launch.fused_linear_max_bytes:
            return None
        return self._matmul.SMALL_ROWS

    def pdl(self, linear: Linear) -> bool:
        """Whether ``linear``'s fused product launches early (programmatic dependent launch): with
        the launch's ``pdl``, for weights of at most ``pdl_max_weight_bytes``."""
        weight = linear.weight
        return self.launch.pdl and weight.numel() * weight.element_size() <= self.launch.pdl_max_weight_bytes

    def norm(self, x, weight, delta=None):
        return self._norm(x, self._ones if weight is None else weight, self.config.rms_norm_eps, delta,
                          pdl=self.launch.pdl)

    def rope(self, positions):
        return positions

    def rope_store(self, rope, qkv, kv, layer, out_cache_loc):
        cfg = self.config
        return self._rotary(qkv, rope, self.table, kv.k[layer], kv.v[layer], out_cache_loc, cfg.num_heads,
                            cfg.num_kv_heads, pdl=self.launch.pdl)

    def norm_rope_store(self, x, norm, linear, rope, kv, layer, out_cache_loc, delta=None):
        fused = delta is None and self.launch.rope_in_product
        tiling = self.tiling(x.shape[0], linear) if fused else None
        if tiling is None or not tiling.rotate:
            return super().norm_rope_store(x, norm, linear, rope, kv, layer, out_cache_loc, delta)
        cfg = self.config
        store = RopeStore(rope, self.table, kv.k[layer], kv.v[layer], out_cache_loc, cfg.num_heads, cfg.num_kv_heads)
        return self._matmul.fused_linear(x, linear.weight, norm_eps=cfg.rms_norm_eps, rope=store, tiling=tiling,
                                         pdl=self.pdl(linear))

    def swiglu(self, gate_up):
        return self._swiglu(gate_up, pdl=self.launch.pdl)

    def argmax(self, logits):
        return argmax.argmax(logits, pdl=self.launch.pdl)

    def linear(self, weight):
        return TritonLinear(weight, self)

    def fold_norm(self, norm, weight):
        """The norm's weight folded into the projection's (``W * g``): the norm then only scales rows."""
        return None, self._matmul.fold_norm(weight, norm)

    def norm_linear(self, x, norm, linear, delta=None):
        tiling = self.tiling(x.shape[0], linear) if delta is None else None
        if tiling is None:
            return super().norm_linear(x, norm, linear, delta)
        return self._matmul.fused_linear(x, linear.weight, norm_eps=self.config.rms_norm_eps, tiling=tiling,
                                         pdl=self.pdl(linear))

    def norm_swiglu(self, x, norm, linear, delta=None):
        tiling = self.tiling(x.shape[0], linear) if delta is None else None
        if tiling is None:
            return super().norm_swiglu(x, norm, linear, delta)
        return self._matmul.fused_linear(x, linear.weight, norm_eps=self.config.rms_norm_eps, glu=True,
                                         tiling=tiling, pdl=self.pdl(linear))

    def linear_add(self, y, linear, x):
        tiling = self.tiling(y.shape[0], linear)
        if tiling is None:
            return super().linear_add(y, linear, x)
        self._matmul.fused_linear(y, linear.weight, residual=x, tiling=tiling, pdl=self.pdl(linear))
        return None
