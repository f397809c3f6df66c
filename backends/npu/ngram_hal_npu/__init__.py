"""ngram-hal-npu: the Huawei Ascend NPU backend of ngram-hal, registered as ``npu``.

``torch_npu`` is imported only when availability is checked, never at import time.
"""

from .backend import NpuBackend

__all__ = ["NpuBackend"]
__version__ = "0.1.0"
