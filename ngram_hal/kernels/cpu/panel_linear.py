"""A float32 linear layer for CPU decoding: weights in column panels, a compiled small-row kernel.

Decoding multiplies a few rows (one per request, or one per draft-tree node) by every weight
matrix. One row is bound by reading the weights from memory; a handful of rows should cost
about the same, yet the BLAS paths that ``F.linear`` reaches for on a few rows read the weights
inefficiently, so that 2 to 8 rows cost about twice one row (``bench/bench_panel_linear.py``
measures both on the whole model's weights).

Layout: the ``[N, K]`` weight is stored as ``P = ceil(N / PANEL)`` panels of ``[K, PANEL]``
(panel p holds output columns ``p*PANEL .. p*PANEL + PANEL-1``, zero-padded), each one
contiguous block. Up to :data:`KERNEL_ROWS` rows a compiled kernel (numba) walks each panel
once per block of rows, in order of k, and adds ``x[m, k] * panel[k, :]`` to the partial sums of
the block's rows, ``[rows, PANEL]`` of them in a stack buffer that the compiler keeps in
registers: blocks of :data:`BLOCK_ROWS` rows (six with AVX-512, else four), and the rows left
over as one more block. A panel
of 64 columns walked whole streams its weights in order, which the memory prefetchers follow
better than column strips of a wider panel walked one after another (the layout before, measured
against this one in ``docs/engine.md``).

On one thread the kernel is a serial build (numba's parallel launch costs more than it gives
there, and its idle pool threads would spin on the other cores); on more, the panels are split
among ``torch.get_num_threads()`` threads. Every path does the same float operations per output
element in the same order (a fused multiply-add per k, from zero), so up to ``KERNEL_ROWS`` an
output row does not depend on the other rows of the batch or on the thread count
(``tests/backends/test_panel_linear.py``). Past that the product is compute-bound and goes to
``torch.matmul`` (BLAS) over the panels (over the whole weight decoded, for the file's codes),
unless the layer is batch-invariant: then every row count runs the kernel, so that no row's
result depends on the rest of the call.

The kernel reads a weight at ``(p, k, j)`` through :func:`weight_at`, which the layer's weight
arrays pick when the kernel is compiled: float32 panels here, block-quantization codes with their
scales in :mod:`~ngram_hal.kernels.cpu.quant_linear`.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from llvmlite import binding
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload
from numba.np.numpy_support import carray

PANEL = 64
CODE_BLOCK = 32
"""Weights of one row that share a scale (and a minimum) in the block-quantization codes (Q4_1,
Q8_0) that :func:`weight_at` decodes."""


def _block_rows() -> int:
    """Rows of a kernel block: 6 where the CPU has AVX-512, whose 32 vector registers hold six rows'
    partial sums for a panel (24 of them), else 4."""
    return 6 if binding.get_host_cpu_features().get("avx512f") else 4


BLOCK_ROWS = _block_rows()
"""Rows of a kernel block; the rows left over (fewer than a block) run as one block of their own
size. On the 2-core AMD EPYC (AVX-512), one SmolLM2 step's projections over the file's codes
(``python bench/bench_panel_linear.py --threads 1``, ``docs/bench/cpu-block-rows/``) took 0.83-0.89x
the time of blocks of four at 9-32 rows and 0.75x at 5 (two threads: 0.89-0.92x and 0.79x), the
same at 1-4 and 8 rows; blocks of eight spill their sums and took 1.16x at 9."""
KERNEL_ROWS = 128
"""Measured on the 2-core CPU, every projection of SmolLM2, 1 and 2 threads (``python
bench/bench_panel_linear.py --kernel-rows 0``, then a large value): at 8-128 rows the kernel took
0.32-0.95x BLAS's time over the file's codes (BLAS after decoding them) and 0.48-0.89x over
float32 panels; at 444 rows 1.00x and 0.80-0.84x. BLAS takes over past it, where more cores
share a prefill better than the kernel's split of the panels would."""


@intrinsic
def _tile(typingctx, rows):
    """A float32[rows * PANEL] buffer on the stack (``rows`` a literal): the compiler can keep it
    in registers, as it knows that no other array aliases it (a heap array gets reloaded after
    every store)."""
    if not isinstance(rows, types.IntegerLiteral):
        raise TypingError("_tile: the row count must be a literal")
    count = rows.literal_value * PANEL

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(types.float32),
                                   size=context.get_constant(types.intp, count))
    return types.CPointer(types.float32)(rows), codegen


def weight_at(weights, p, k, j):
    """The float32 weight at row k, column j of panel p, from a layer's weight arrays (a tuple):
    ``(panels,)`` float32[P, K, PANEL], or block-quantization ``(codes, d, m)`` (see
    :mod:`~ngram_hal.kernels.cpu.quant_linear`). Compiled code only."""
    raise NotImplementedError("weight_at runs inside the compiled kernels")


@overload(weight_at, inline="always", jit_options={"fastmath": True, "boundscheck": False})
def _weight_at(weights, p, k, j):
    if len(weights) == 3:
        def decoded(weights, p, k, j):
            codes, d, m = weights
            b = k // CODE_BLOCK
            return d[p, b, j] * np.float32(codes[p, k, j]) + m[p, b, j]
        return decoded

    def stored(weights, p, k, j):
        return weights[0][p, k, j]
    return stored


@njit(fastmath=True, boundscheck=False, inline="always")
def _block(x, weights, out, p, m0, rows):
    """Panel p of ``out[m0:m0+rows] = x[m0:m0+rows] @ weights``, the partial sums in registers."""
    acc = carray(_tile(rows), (rows, PANEL))
    for r in range(rows):
        for j in range(PANEL):
            acc[r, j] = 0.0
    for k in range(x.shape[1]):
        for j in range(PANEL):
            w = weight_at(weights, p, k, j)
            for r in range(rows):
                acc[r, j] += x[m0 + r, k] * w
    c0 = p * PANEL
    for r in range(rows):
        for j in range(PANEL):
            out[m0 + r, c0 + j] = acc[r, j]


@njit(fastmath=True, boundscheck=False, inline="always")
def _panel(x, weights, out, p):
    """Panel p of ``out = x @ weights``: blocks of BLOCK_ROWS rows, then one of the rows left."""
    M = x.shape[0]
    whole = M - M % BLOCK_ROWS
    for m0 in range(0, whole, BLOCK_ROWS):
        _block(x, weights, out, p, m0, BLOCK_ROWS)
    left = M - whole
    if left == 1:
        _block(x, weights, out, p, whole, 1)
    elif left == 2:
        _block(x, weights, out, p, whole, 2)
    elif left == 3:
        _block(x, weights, out, p, whole, 3)
    elif left == 4:
        _block(x, weights, out, p, whole, 4)
    elif left == 5:
        _block(x, weights, out, p, whole, 5)


@njit(cache=True, fastmath=True, boundscheck=False)
def _matmul(x, weights, out):
    """``out[M, P*PANEL] = x[M, K] @ weights`` on the calling thread."""
    for p in range(weights[0].shape[0]):
        _panel(x, weights, out, p)


@njit(cache=True, fastmath=True, boundscheck=False, parallel=True)
def _matmul_parallel(x, weights, out):
    """:func:`_matmul` with the panels split among numba's threads."""
    for p in prange(weights[0].shape[0]):
        _panel(x, weights, out, p)


_local = threading.local()


def on_torch_threads(serial, parallel):
    """The build of a kernel for ``torch.get_num_threads()``: ``serial`` on one thread, else
    ``parallel`` with that many of numba's threads (at most its pool, ``NUMBA_NUM_THREADS``, all
    cores by default). numba's setting is per calling thread; the last value is remembered per
    thread, as setting it costs a few microseconds."""
    n = torch.get_num_threads()
    if n == 1:
        return serial
    if getattr(_local, "threads", 0) != n:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _local.threads = n
    return parallel


def in_panels(a: np.ndarray, dtype) -> np.ndarray:
    """[N, X] -> [P, X, PANEL] of ``dtype``: column panels of PANEL rows of ``a``, zero-padded."""
    N = a.shape[0]
    P = -(-N // PANEL)
    padded = np.zeros((P * PANEL, a.shape[1]), dtype)
    padded[:N] = a
    return np.ascontiguousarray(padded.reshape(P, PANEL, -1).transpose(0, 2, 1))


class PanelLinear:
    """``y = x @ weight.T`` for a float32 CPU weight stored in panels (see the module docstring).

    Args:
        weight: float32[N, K] on the CPU; copied into the panel layout (the argument is not kept).
        batch_invariant: the compiled kernel for every row count (BLAS past ``kernel_rows`` otherwise).
    """

    kernel_rows = KERNEL_ROWS
    """The most rows the compiled kernel takes (past them BLAS, outside the batch-invariant mode)."""

    def __init__(self, weight: torch.Tensor, batch_invariant: bool = False):
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PanelLinear needs a 2-D float32 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.batch_invariant = batch_invariant
        self.weights = (in_panels(weight.numpy(), np.float32),)
        """The arrays the kernel reads (see :func:`weight_at`)."""

    @property
    def num_panels(self) -> int:
        """P, the weight's panels."""
        return self.weights[0].shape[0]

    def float_panels(self) -> torch.Tensor:
        """The weight's panels as float32[P, K, PANEL] (panel p: output columns ``p*PANEL ..``)."""
        return torch.from_numpy(self.weights[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32[M, K] on the CPU -> contiguous float32[M, N], on ``torch.get_num_threads()``
        threads."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects float32 (M, {self.in_features}) on the CPU, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        M = x.shape[0]
        if M > self.kernel_rows and not self.batch_invariant:
            return self._blas(x)
        width = self.num_panels * PANEL
        out = torch.empty(M, width, dtype=torch.float32)
        on_torch_threads(_matmul, _matmul_parallel)(x.contiguous().numpy(), self.weights, out.numpy())
        return out if width == self.out_features else out[:, :self.out_features].contiguous()

    def _blas(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` through BLAS (rows past ``kernel_rows``): one product per panel."""
        M, width = x.shape[0], self.num_panels * PANEL
        out = torch.matmul(x, self.float_panels()).transpose(0, 1).reshape(M, width)
        return out if width == self.out_features else out[:, :self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: int64[n] -> float32[n, K] (an embedding lookup in a tied weight)."""
        return self.float_panels()[ids // PANEL, :, ids % PANEL]

    def dense(self) -> torch.Tensor:
        """The weight as float32[N, K] (a copy)."""
        return self.float_panels().transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()
