"""ngram-hal-numpy: an example third-party backend of ngram-hal, registered as ``numpy``."""

from .backend import NumpyBackend

__all__ = ["NumpyBackend"]
__version__ = "0.1.0"
