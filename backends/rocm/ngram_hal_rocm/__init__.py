"""ngram-hal-rocm: the AMD ROCm backend of ngram-hal, registered as ``rocm``."""

from .backend import PROXY_ENV, RocmBackend, hip_launch, proxy_device

__all__ = ["PROXY_ENV", "RocmBackend", "hip_launch", "proxy_device"]
__version__ = "0.1.0"
