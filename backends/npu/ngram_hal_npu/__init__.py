"""ngram-hal-npu: the Huawei Ascend NPU backend of ngram-hal, registered as ``npu``.

``torch_npu`` is imported only when availability is checked or a backend is created on an
``npu`` device, never at import time.
"""

from .backend import PROXY_ENV, NpuBackend, npu_status

__all__ = ["PROXY_ENV", "NpuBackend", "npu_status"]
__version__ = "0.1.0"
