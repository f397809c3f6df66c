"""Portable Triton kernels for the HAL ops, shared by the CUDA and ROCm backends.

One module per op group; each kernel sits beside the wrapper that checks what the kernel relies
on (contiguity, strides, sizes) and launches it. The ops' arguments have already been validated
by :class:`ngram_hal.Backend`; the wrappers add only what the kernels themselves assume. Launch
configuration (warps, block sizes) comes from the backend as a :class:`LaunchConfig`, so the same
kernels serve 32-wide warps and 64-wide wavefronts.

Importing this package does not import Triton; each kernel module does, and :mod:`.ops` (the
mixin a backend lists) imports them all. Triton decides whether to interpret kernels
(``TRITON_INTERPRET=1``, on CPU tensors) when a kernel module is imported, so set that variable
before a Triton backend is loaded.
"""

from .launch import LaunchConfig, interpreting

__all__ = ["LaunchConfig", "interpreting"]
