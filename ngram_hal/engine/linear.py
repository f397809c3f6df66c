"""The model's linear layers: the fastest product for the weight's device and dtype.

Both kinds hold a ``[N, K]`` weight and offer ``layer(x)`` (``x @ weight.T``, float[M, K] ->
float[M, N]) and ``layer.rows(ids)`` (an embedding lookup, int64[n] -> float[n, K], for a weight
tied to the token embeddings). :func:`make_linear` picks :class:`ngram_hal.kernels.cpu.PanelLinear`
for float32 on the CPU (memory-bound small-row products, see its module), :class:`InvariantLinear`
when asked for batch invariance, and :class:`DenseLinear` (``F.linear``) everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cpu import PanelLinear


class DenseLinear:
    """``x @ weight.T`` through ``F.linear`` on the weight's device, in its dtype.

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


class InvariantLinear(DenseLinear):
    """``x @ weight.T`` by :func:`ngram_hal.kernels.gpu.matmul.invariant_linear`: one fixed tiling
    for any number of rows, so each row's result is independent of its batch (Triton)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        from ..kernels.gpu.matmul import invariant_linear

        self._product = invariant_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x.contiguous(), self.weight)


Linear = PanelLinear | DenseLinear | InvariantLinear


def default_dtype(device: torch.device) -> torch.dtype:
    """The model dtype a device runs best: float32 on the CPU, bfloat16 on an accelerator."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def make_linear(weight: torch.Tensor, batch_invariant: bool = False, panels: bool = True) -> Linear:
    """A linear layer over ``weight`` (float[N, K], already on its device and in its dtype);
    ``panels=False`` keeps a float32 CPU weight dense (for kernels that read ``layer.weight``)."""
    if batch_invariant:
        return InvariantLinear(weight)
    if panels and weight.device.type == "cpu" and weight.dtype == torch.float32:
        return PanelLinear(weight)
    return DenseLinear(weight)
