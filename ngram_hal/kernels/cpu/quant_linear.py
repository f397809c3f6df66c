"""The CPU float32 linear layer over weights kept as their file's block-quantization codes (Q4_1, Q8_0).

A CPU decode step is bound by reading the weights: :class:`PanelLinear`'s float32 panels stream 4
bytes a weight. The model file holds most of them as Q4_1 (each block of 32 weights of a row: 4-bit
codes ``q``, a float16 scale ``d`` and minimum ``m``, the weight ``d * q + m``) or Q8_0 (signed
8-bit codes and a scale, ``q * d``). :func:`quantize_exactly` recognises a float32 weight that is
exactly such a tensor dequantized (each block re-derived, then checked bit for bit), and
:class:`QuantPanelLinear` keeps its codes, one byte each, in :class:`PanelLinear`'s column panels,
with ``d`` and ``m`` as float32 per block and column (m zero for Q8_0): 1.25 bytes a weight.

The kernels are :class:`PanelLinear`'s, each weight decoded where they load it
(:func:`~ngram_hal.kernels.cpu.panel_linear.weight_at`). ``d * q`` is exact in float32 (a float16
scale's 11-bit significand times a code of at most 8 bits), so ``d * q + m`` is the file's float32
weight however the compiler fuses it, and every output is bit for bit :class:`PanelLinear`'s over
the dense weight, for every row count and thread count, where both run the kernel. Past
``kernel_rows`` (a prefill) the weight is decoded whole into one ``[K, N]`` matrix for a single
BLAS product, which runs 5-10 % faster than one product per panel (``bench_panel_linear.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .panel_linear import CODE_BLOCK, PANEL, PanelLinear, in_panels, on_torch_threads, weight_at

FORMATS = ("q4_1", "q8_0")


def _candidates(estimate: torch.Tensor) -> list[torch.Tensor]:
    """float32 values of the float16 nearest ``estimate`` and its two float16 neighbours."""
    d16 = estimate.numpy().astype(np.float16)
    return [torch.from_numpy(d.astype(np.float32)) for d in (d16, np.nextafter(d16, np.float16(np.inf)),
                                                             np.nextafter(d16, np.float16(-np.inf)))]


def _derive(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes, d, m) with ``blocks == d * codes + m`` (Q4_1) or ``codes * d`` (Q8_0, m zero) bit for
    bit in every block, or None. blocks: float32[N, K/32, 32]; torch ops, on torch's threads."""
    if fmt == "q4_1":
        m = blocks.amin(-1)
        if not torch.equal(m.half().float(), m):
            return None
        estimate, low, high = (blocks.amax(-1) - m) / 15, 0, 15
    else:
        m = torch.zeros(blocks.shape[:2])
        estimate, low, high = blocks.abs().amax(-1) / 127, -128, 127
    codes, d = torch.zeros_like(blocks), torch.zeros_like(m)
    todo = torch.ones(blocks.shape[:2], dtype=torch.bool)
    for candidate in _candidates(estimate):
        rest = todo.nonzero(as_tuple=True)
        sub, c, low_m = blocks[rest], candidate[rest], m[rest]
        q = ((sub - low_m[:, None]) / torch.where(c > 0, c, 1)[:, None]).round_().clamp_(low, high)
        q[c == 0] = 0
        exact = ((c[:, None] * q + low_m[:, None] if fmt == "q4_1" else q * c[:, None]) == sub).all(-1)
        hit = tuple(i[exact] for i in rest)
        codes[hit], d[hit], todo[hit] = q[exact], c[exact], False
        if not todo.any():
            return codes, d, m
    return None


def quantize_exactly(weight: torch.Tensor) -> tuple[str, np.ndarray, np.ndarray, np.ndarray] | None:
    """The block quantization ``weight`` (float32[N, K] on the CPU) is an exact dequantization of:
    ``(format, codes, d, m)`` with codes float32[N, K] (0..15 for Q4_1, -128..127 for Q8_0) and
    ``d``, ``m`` float32[N, K / 32]; None where K is not a multiple of 32 or no format fits."""
    N, K = weight.shape
    if K % CODE_BLOCK or N == 0:
        return None
    blocks = weight.reshape(N, K // CODE_BLOCK, CODE_BLOCK)
    for fmt in FORMATS:
        found = _derive(blocks[:1], fmt) and _derive(blocks, fmt)  # the first row rejects most weights
        if found is not None:
            codes, d, m = found
            return fmt, codes.reshape(N, K).numpy(), d.numpy(), m.numpy()
    return None


@njit(boundscheck=False, inline="always")
def _decode_panel(weights, p, out, i):
    """out[i] float32[K, PANEL] = panel p's weights, decoded from ``(codes, d, m)``."""
    for k in range(out.shape[1]):
        for j in range(PANEL):
            out[i, k, j] = weight_at(weights, p, k, j)


@njit(cache=True, boundscheck=False)
def _decode(weights, panels, out):
    """out[i] = the weights of panel ``panels[i]``, on the calling thread."""
    for i in range(panels.shape[0]):
        _decode_panel(weights, panels[i], out, i)


@njit(cache=True, boundscheck=False, parallel=True)
def _decode_parallel(weights, panels, out):
    """:func:`_decode` with the panels split among numba's threads."""
    for i in prange(panels.shape[0]):
        _decode_panel(weights, panels[i], out, i)


@njit(boundscheck=False, inline="always")
def _decode_row(weights, k, out):
    """out[k] (out float32[K, P*PANEL]) = row k of every panel, decoded."""
    for p in range(weights[0].shape[0]):
        c0 = p * PANEL
        for j in range(PANEL):
            out[k, c0 + j] = weight_at(weights, p, k, j)


@njit(cache=True, boundscheck=False)
def _decode_dense(weights, out):
    """out float32[K, P*PANEL] = the whole weight decoded, column ``p*PANEL + j`` from panel p, on
    the calling thread."""
    for k in range(out.shape[0]):
        _decode_row(weights, k, out)


@njit(cache=True, boundscheck=False, parallel=True)
def _decode_dense_parallel(weights, out):
    """:func:`_decode_dense` with the rows split among numba's threads (each writes whole rows, so
    no two threads touch one page)."""
    for k in prange(out.shape[0]):
        _decode_row(weights, k, out)


class QuantPanelLinear(PanelLinear):
    """``y = x @ weight.T`` over a weight kept as Q4_1 or Q8_0 codes in column panels, bit for bit
    :class:`PanelLinear` over the dequantized weight (see the module docstring).

    Args:
        fmt, codes, d, m: from :func:`quantize_exactly` (codes float32[N, K], d and m float32[N, K/32]).
        batch_invariant: the compiled kernel for every row count (BLAS over the decoded panels past
            ``kernel_rows`` otherwise).
    """

    def __init__(self, fmt: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray, batch_invariant: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"QuantPanelLinear: format {fmt!r} (expected one of {', '.join(FORMATS)})")
        self.out_features, self.in_features = codes.shape
        self.batch_invariant = batch_invariant
        self.format = fmt
        self.weights = (in_panels(codes, np.uint8 if fmt == "q4_1" else np.int8),
                        in_panels(d, np.float32), in_panels(m, np.float32))

    def _decoded(self, panels: np.ndarray) -> torch.Tensor:
        """float32[len(panels), K, PANEL]: the weights of these panels (int64 indices), decoded."""
        out = np.empty((panels.shape[0], self.in_features, PANEL), np.float32)
        on_torch_threads(_decode, _decode_parallel)(self.weights, panels, out)
        return torch.from_numpy(out)

    def float_panels(self) -> torch.Tensor:
        return self._decoded(np.arange(self.num_panels))

    def _blas(self, x: torch.Tensor) -> torch.Tensor:
        dense = np.empty((self.in_features, self.num_panels * PANEL), np.float32)
        on_torch_threads(_decode_dense, _decode_dense_parallel)(self.weights, dense)
        return torch.mm(x, torch.from_numpy(dense)[:, :self.out_features])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: int64[n] -> float32[n, K], each panel that holds one decoded once."""
        panels, where = torch.unique(ids // PANEL, return_inverse=True)
        return self._decoded(panels.numpy())[where, :, ids % PANEL]
