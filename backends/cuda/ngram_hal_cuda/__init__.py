"""ngram-hal-cuda: the NVIDIA CUDA backend of ngram-hal, registered as ``cuda``."""

from .backend import PROXY_ENV, CudaBackend

__all__ = ["PROXY_ENV", "CudaBackend"]
__version__ = "0.1.0"
