"""ngram-hal-cuda: the NVIDIA CUDA backend of ngram-hal, registered as ``cuda``."""

from .backend import CudaBackend

__all__ = ["CudaBackend"]
__version__ = "0.1.0"
