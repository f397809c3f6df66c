"""ngram-hal-rocm: the AMD ROCm backend of ngram-hal, registered as ``rocm``."""

from .backend import PROXY_ENV, RocmBackend, proxy_device, proxy_requested

__all__ = ["PROXY_ENV", "RocmBackend", "proxy_device", "proxy_requested"]
__version__ = "0.1.0"
