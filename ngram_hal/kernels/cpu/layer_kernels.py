"""The reference backend's model kernels: plain torch, with float32 CPU projections in panels."""

from __future__ import annotations

import torch

from ...model_kernels import DenseLinear, Linear, TorchLayerKernels
from .panel_linear import PanelLinear
from .quant_linear import QuantPanelLinear, quantize_exactly
from .row_kernels import add_rms_norm, rope_store


class CpuLayerKernels(TorchLayerKernels):
    """:class:`~ngram_hal.model_kernels.TorchLayerKernels` whose float32 CPU weights run as
    :class:`~ngram_hal.kernels.cpu.panel_linear.PanelLinear` (memory-bound products of few rows,
    see its module), or as :class:`~ngram_hal.kernels.cpu.quant_linear.QuantPanelLinear` where a
    weight is exactly a dequantized Q4_1 or Q8_0 tensor (the same results from a fraction of the
    memory reads); other weights stay :class:`~ngram_hal.model_kernels.DenseLinear`.
    ``batch_invariant``: every row count through the panels' kernel, never BLAS (float32 CPU
    weights only). On float32 CPU rows the norm and the rotary embedding with the K/V store are
    compiled too (:mod:`~ngram_hal.kernels.cpu.row_kernels`); the store goes through the backend's
    ``store_kv`` in strict mode, which checks the slots."""

    def __init__(self, config, backend, dtype: torch.dtype, batch_invariant: bool = False):
        super().__init__(config, backend, dtype)
        self.batch_invariant = batch_invariant

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None, delta: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
            return add_rms_norm(x, weight, self.config.rms_norm_eps, delta)
        return super().norm(x, weight, delta)

    def rope_store(self, rope, qkv, kv, layer, out_cache_loc):
        if qkv.device.type == "cpu" and qkv.dtype == torch.float32 and kv.dtype == torch.float32 \
                and not self.backend.strict:
            cfg = self.config
            return rope_store(qkv, *rope, kv.k[layer], kv.v[layer], out_cache_loc, cfg.num_heads, cfg.num_kv_heads)
        return super().rope_store(rope, qkv, kv, layer, out_cache_loc)

    def linear(self, weight: torch.Tensor) -> Linear:
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            quantized = quantize_exactly(weight)
            if quantized is not None:
                return QuantPanelLinear(*quantized, batch_invariant=self.batch_invariant)
            return PanelLinear(weight, self.batch_invariant)
        if self.batch_invariant:
            raise ValueError(f"the batch-invariant mode needs float32 CPU weights, got {weight.dtype} "
                             f"on {weight.device}")
        return DenseLinear(weight)
