"""The CPU float32 linear layer over weights kept as their file's block-quantization codes (Q4_1, Q8_0).

A CPU decode step is bound by reading the weights: :class:`PanelLinear`'s float32 panels stream 4
bytes a weight. The model file holds most of them as Q4_1 (each block of 32 weights of a row: 4-bit
codes ``q``, a float16 scale ``d`` and minimum ``m``, the weight ``d * q + m``) or Q8_0 (signed
8-bit codes and a scale, ``q * d``). :func:`quantize_exactly` recognises a float32 weight that is
exactly such a tensor dequantized (each block re-derived, then checked bit for bit), and
:class:`QuantPanelLinear` keeps its codes, one byte each, in :class:`PanelLinear`'s column panels,
with ``d`` and ``m`` as float32 per block and column (m zero for Q8_0): 1.25 bytes a weight.

The kernels are :class:`PanelLinear`'s, each weight decoded where they load it. ``d * q`` is exact
in float32 (a float16 scale's 11-bit significand times a code of at most 8 bits), so ``d * q + m`` is the file's
float32 weight however the compiler fuses it, and every output is bit for bit
:class:`PanelLinear`'s over the dense weight, for every row count and thread count, where both run
the kernel. The kernel takes more rows here (:attr:`QuantPanelLinear.kernel_rows`) before the
panels are decoded whole for ``torch.mm``, as decoding costs more than reading float32 panels.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from numba.np.numpy_support import carray

from .panel_linear import PANEL, ROWS, STRIP, PanelLinear, _set_threads, _tile

BLOCK = 32
"""Weights of one row that share a scale (and a minimum) in Q4_1 and Q8_0."""
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
    if K % BLOCK or N == 0:
        return None
    blocks = weight.reshape(N, K // BLOCK, BLOCK)
    for fmt in FORMATS:
        found = _derive(blocks[:1], fmt) and _derive(blocks, fmt)  # the first row rejects most weights
        if found is not None:
            codes, d, m = found
            return fmt, codes.reshape(N, K).numpy(), d.numpy(), m.numpy()
    return None


@njit(boundscheck=False, inline="always")
def _decode_panel(codes, d, m, p, weights, i):
    """weights[i] float32[K, PANEL] = panel p's weights, ``d * q + m`` (codes uint8 or int8
    [P, K, PANEL], d and m float32[P, K/32, PANEL])."""
    for k in range(codes.shape[1]):
        b = k // BLOCK
        for j in range(PANEL):
            weights[i, k, j] = d[p, b, j] * np.float32(codes[p, k, j]) + m[p, b, j]


@njit(cache=True, boundscheck=False)
def _decode(codes, d, m, panels, weights):
    """weights[i] = the weights of panel ``panels[i]``, on the calling thread."""
    for i in range(panels.shape[0]):
        _decode_panel(codes, d, m, panels[i], weights, i)


@njit(cache=True, boundscheck=False, parallel=True)
def _decode_parallel(codes, d, m, panels, weights):
    """:func:`_decode` with the panels split among numba's threads."""
    for i in prange(panels.shape[0]):
        _decode_panel(codes, d, m, panels[i], weights, i)


@njit(fastmath=True, boundscheck=False, inline="always")
def _few_rows_panel(x, codes, d, m, out, p):
    """Panel p of ``out = x @ weights``, as PanelLinear's: each row of the panel decoded once into
    a buffer that stays in L1 with the ``[M, PANEL]`` partial sums."""
    M, K = x.shape
    acc = np.zeros((M, PANEL), np.float32)
    w = np.empty(PANEL, np.float32)
    for k in range(K):
        b = k // BLOCK
        c, scale, low = codes[p, k], d[p, b], m[p, b]
        for j in range(PANEL):
            w[j] = scale[j] * np.float32(c[j]) + low[j]
        for r in range(M):
            xm = x[r, k]
            a = acc[r]
            for j in range(PANEL):
                a[j] += xm * w[j]
    out[:, p * PANEL:(p + 1) * PANEL] = acc


@njit(fastmath=True, boundscheck=False, inline="always")
def _row_blocks_panel(x, codes, d, m, out, p):
    """Panel p of ``out = x @ weights``, M a multiple of ROWS, as PanelLinear's: column strips by
    blocks of ROWS rows, partial sums in registers, each weight decoded as it is loaded."""
    M, K = x.shape
    acc = carray(_tile(), (ROWS, STRIP))
    for s in range(0, PANEL, STRIP):
        c0 = p * PANEL + s
        for m0 in range(0, M, ROWS):
            for r in range(ROWS):
                for j in range(STRIP):
                    acc[r, j] = 0.0
            for k in range(K):
                b = k // BLOCK
                x0 = x[m0, k]
                x1 = x[m0 + 1, k]
                x2 = x[m0 + 2, k]
                x3 = x[m0 + 3, k]
                for j in range(STRIP):
                    w = d[p, b, s + j] * np.float32(codes[p, k, s + j]) + m[p, b, s + j]
                    acc[0, j] += x0 * w
                    acc[1, j] += x1 * w
                    acc[2, j] += x2 * w
                    acc[3, j] += x3 * w
            for r in range(ROWS):
                for j in range(STRIP):
                    out[m0 + r, c0 + j] = acc[r, j]


@njit(cache=True, fastmath=True, boundscheck=False)
def _codes_matmul(x, codes, d, m, out, blocked):
    """``out[M, P*PANEL] = x[M, K] @ weights`` on the calling thread."""
    for p in range(codes.shape[0]):
        if blocked:
            _row_blocks_panel(x, codes, d, m, out, p)
        else:
            _few_rows_panel(x, codes, d, m, out, p)


@njit(cache=True, fastmath=True, boundscheck=False, parallel=True)
def _codes_matmul_parallel(x, codes, d, m, out, blocked):
    """:func:`_codes_matmul` with the panels split among numba's threads."""
    for p in prange(codes.shape[0]):
        if blocked:
            _row_blocks_panel(x, codes, d, m, out, p)
        else:
            _few_rows_panel(x, codes, d, m, out, p)


def _in_panels(a: np.ndarray, dtype) -> np.ndarray:
    """[N, X] -> [P, X, PANEL] of ``dtype``: column panels of PANEL rows of ``a``, zero-padded."""
    N = a.shape[0]
    P = -(-N // PANEL)
    padded = np.zeros((P * PANEL, a.shape[1]), dtype)
    padded[:N] = a
    return np.ascontiguousarray(padded.reshape(P, PANEL, -1).transpose(0, 2, 1))


class QuantPanelLinear(PanelLinear):
    """``y = x @ weight.T`` over a weight kept as Q4_1 or Q8_0 codes in column panels, bit for bit
    :class:`PanelLinear` over the dequantized weight (see the module docstring).

    Args:
        fmt, codes, d, m: from :func:`quantize_exactly` (codes float32[N, K], d and m float32[N, K/32]).
        batch_invariant: the compiled kernel for every row count (``torch.mm`` past ``kernel_rows``
            otherwise).
    """

    kernel_rows = 128
    """Measured on the 2-core CPU, every projection of SmolLM2: the kernel 129 ms at 64 rows and
    243 at 128, decoding the panels for ``torch.mm`` 223 and 282."""
    few_rows = 5
    """Measured the same way: each weight decoded once for all rows, partial sums in L1, took
    0.81-0.94x the row blocks' time (which decode it once a block) at 3-5 rows and 1.07x at 6, on
    1 and 2 threads."""

    def __init__(self, fmt: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray, batch_invariant: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"QuantPanelLinear: format {fmt!r} (expected one of {', '.join(FORMATS)})")
        self.out_features, self.in_features = codes.shape
        self.batch_invariant = batch_invariant
        self.format = fmt
        self._codes = _in_panels(codes, np.uint8 if fmt == "q4_1" else np.int8)
        self._d, self._m = _in_panels(d, np.float32), _in_panels(m, np.float32)
        self.num_panels = self._codes.shape[0]

    def _weights(self, panels: np.ndarray) -> torch.Tensor:
        """float32[len(panels), K, PANEL]: the weights of these panels (int64 indices), decoded."""
        weights = np.empty((panels.shape[0], self.in_features, PANEL), np.float32)
        threads = torch.get_num_threads()
        if threads > 1:
            _set_threads(threads)
        (_decode_parallel if threads > 1 else _decode)(self._codes, self._d, self._m, panels, weights)
        return torch.from_numpy(weights)

    def float_panels(self) -> torch.Tensor:
        return self._weights(np.arange(self.num_panels))

    def _product(self, x: np.ndarray, out: np.ndarray, blocked: bool, threads: int) -> None:
        kernel = _codes_matmul_parallel if threads > 1 else _codes_matmul
        kernel(x, self._codes, self._d, self._m, out, blocked)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: int64[n] -> float32[n, K], each panel that holds one decoded once."""
        panels, where = torch.unique(ids // PANEL, return_inverse=True)
        return self._weights(panels.numpy())[where, :, ids % PANEL]

    def dense(self) -> torch.Tensor:
        return self.float_panels().transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()
