"""A float32 linear layer for CPU decoding: weights in column panels, a compiled small-row kernel.

Decoding multiplies a few rows (one per request, or one per draft-tree node) by every weight
matrix. One row is bound by reading the weights from memory; a handful of rows should cost
about the same, yet the BLAS paths that ``F.linear`` reaches for on a few rows read the weights
inefficiently, so that 2 to 8 rows cost about twice one row (``bench/bench_panel_linear.py``
measures both on the whole model's weights).

Layout: the ``[N, K]`` weight is stored as ``P = ceil(N / PANEL)`` panels of ``[K, PANEL]``
(panel p holds output columns ``p*PANEL .. p*PANEL + PANEL-1``, zero-padded), each one
contiguous block. Up to :data:`KERNEL_ROWS` rows a compiled kernel (numba) reads each panel
from memory once and adds ``x[m, k] * panel[k, :]`` to the partial sums of row m, for k in order:

* up to :attr:`PanelLinear.few_rows` rows, the ``[M, PANEL]`` partial sums stay in L1;
* past that, the panel is walked in column strips of :data:`STRIP` and blocks of :data:`ROWS`
  rows (the input padded with zero rows), each block's ``[ROWS, STRIP]`` partial sums held in a
  stack buffer that the compiler keeps in registers.

On one thread the kernel is a serial build (numba's parallel launch costs more than it gives
there, and its idle pool threads would spin on the other cores); on more, the panels are split
among ``torch.get_num_threads()`` threads. Both paths do the same float operations per output
element in the same order, so up to ``KERNEL_ROWS`` an output row does not depend on the other
rows of the batch or on the thread count (``tests/backends/test_panel_linear.py``). Past that the product
is compute-bound and each panel goes to ``torch.mm`` (BLAS), unless the layer is batch-invariant:
then every row count runs the kernel, so that no row's result depends on the rest of the call.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

PANEL = 192
STRIP = 16
ROWS = 4
FEW_ROWS = 2
KERNEL_ROWS = 32


@intrinsic
def _tile(typingctx):
    """A float32[ROWS * STRIP] buffer on the stack: the compiler can keep it in registers, as it
    knows that no other array aliases it (a heap array gets reloaded after every store)."""
    def codegen(context, builder, signature, args):
        size = context.get_constant(types.intp, ROWS * STRIP)
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=size)
    return types.CPointer(types.float32)(), codegen


@njit(fastmath=True, boundscheck=False, inline="always")
def _few_rows_panel(x, panels, out, p):
    """Panel p of ``out = x @ panels``: the ``[M, PANEL]`` partial sums stay in L1 while the
    panel streams past once."""
    M, K = x.shape
    acc = np.zeros((M, PANEL), np.float32)
    for k in range(K):
        w = panels[p, k]
        for m in range(M):
            xm = x[m, k]
            a = acc[m]
            for j in range(PANEL):
                a[j] += xm * w[j]
    out[:, p * PANEL:(p + 1) * PANEL] = acc


@njit(fastmath=True, boundscheck=False, inline="always")
def _row_blocks_panel(x, panels, out, p):
    """Panel p of ``out = x @ panels``, M a multiple of ROWS: column strips of STRIP by blocks of
    ROWS rows, each block's ``[ROWS, STRIP]`` partial sums in registers."""
    M, K = x.shape
    acc = carray(_tile(), (ROWS, STRIP))
    for s in range(0, PANEL, STRIP):
        c0 = p * PANEL + s
        for m0 in range(0, M, ROWS):
            for r in range(ROWS):
                for j in range(STRIP):
                    acc[r, j] = 0.0
            for k in range(K):
                x0 = x[m0, k]
                x1 = x[m0 + 1, k]
                x2 = x[m0 + 2, k]
                x3 = x[m0 + 3, k]
                for j in range(STRIP):
                    w = panels[p, k, s + j]
                    acc[0, j] += x0 * w
                    acc[1, j] += x1 * w
                    acc[2, j] += x2 * w
                    acc[3, j] += x3 * w
            for r in range(ROWS):
                for j in range(STRIP):
                    out[m0 + r, c0 + j] = acc[r, j]


@njit(fastmath=True, boundscheck=False, inline="always")
def _panel(x, panels, out, p, blocked):
    """Panel p of ``out = x @ panels``, by row blocks or (few rows) all rows at once."""
    if blocked:
        _row_blocks_panel(x, panels, out, p)
    else:
        _few_rows_panel(x, panels, out, p)


@njit(cache=True, fastmath=True, boundscheck=False)
def _panel_matmul(x, panels, out, blocked):
    """``out[M, P*PANEL] = x[M, K] @ panels`` on the calling thread."""
    for p in range(panels.shape[0]):
        _panel(x, panels, out, p, blocked)


@njit(cache=True, fastmath=True, boundscheck=False, parallel=True)
def _panel_matmul_parallel(x, panels, out, blocked):
    """:func:`_panel_matmul` with the panels split among numba's threads."""
    for p in prange(panels.shape[0]):
        _panel(x, panels, out, p, blocked)


_local = threading.local()


def _set_threads(n: int) -> None:
    """Give the parallel kernel ``n`` threads, at most numba's pool (``NUMBA_NUM_THREADS``, all
    cores by default). numba's setting is per calling thread; the last value is remembered per
    thread, as setting it costs a few microseconds."""
    if getattr(_local, "threads", 0) != n:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _local.threads = n


class PanelLinear:
    """``y = x @ weight.T`` for a float32 CPU weight stored in panels (see the module docstring).

    Args:
        weight: float32[N, K] on the CPU; copied into the panel layout (the argument is not kept).
        batch_invariant: the compiled kernel for every row count (BLAS past ``KERNEL_ROWS`` otherwise).
    """

    kernel_rows = KERNEL_ROWS
    """The most rows the compiled kernel takes (past them BLAS, outside the batch-invariant mode)."""
    few_rows = FEW_ROWS
    """The most rows whose partial sums stay in L1 (past them, blocks of ROWS rows in registers)."""

    def __init__(self, weight: torch.Tensor, batch_invariant: bool = False):
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PanelLinear needs a 2-D float32 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        N, K = weight.shape
        P = -(-N // PANEL)
        padded = torch.zeros(P * PANEL, K, dtype=torch.float32)
        padded[:N] = weight
        self.out_features, self.in_features = N, K
        self.batch_invariant = batch_invariant
        self.panels = padded.view(P, PANEL, K).transpose(1, 2).contiguous()
        self._panels = self.panels.numpy()
        self.num_panels = P

    def float_panels(self) -> torch.Tensor:
        """The weight's panels as float32[P, K, PANEL] (panel p: output columns ``p*PANEL ..``)."""
        return self.panels

    def _product(self, x: np.ndarray, out: np.ndarray, blocked: bool, threads: int) -> None:
        """``out = x @ panels`` by the compiled kernel, on ``threads`` threads."""
        kernel = _panel_matmul_parallel if threads > 1 else _panel_matmul
        kernel(x, self._panels, out, blocked)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32[M, K] on the CPU -> contiguous float32[M, N], on ``torch.get_num_threads()``
        threads."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects float32 (M, {self.in_features}) on the CPU, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        M = x.shape[0]
        width = self.num_panels * PANEL
        threads = torch.get_num_threads()
        if M > self.kernel_rows and not self.batch_invariant:
            out = torch.empty(M, width, dtype=torch.float32)
            panels = self.float_panels()
            for p in range(self.num_panels):
                out[:, p * PANEL:(p + 1) * PANEL] = torch.mm(x, panels[p])
        else:
            blocked = M > self.few_rows
            rows = -(-M // ROWS) * ROWS if blocked else M
            if rows != M:
                x = torch.cat([x, x.new_zeros(rows - M, self.in_features)])
            out = torch.empty(rows, width, dtype=torch.float32)
            if threads > 1:
                _set_threads(threads)
            self._product(x.contiguous().numpy(), out.numpy(), blocked, threads)
            out = out[:M]
        return out if width == self.out_features else out[:, :self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: int64[n] -> float32[n, K] (an embedding lookup in a tied weight)."""
        return self.panels[ids // PANEL, :, ids % PANEL]

    def dense(self) -> torch.Tensor:
        """The weight as float32[N, K] (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()
