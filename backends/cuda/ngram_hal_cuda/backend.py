"""``CudaBackend``: NVIDIA GPUs through a CUDA build of torch.

No op is implemented yet (``capabilities().ops`` is empty); discovery already reports
honestly whether a CUDA device can be used here.
"""

from __future__ import annotations

import torch

from ngram_hal.backend import Backend


class CudaBackend(Backend):
    """The CUDA backend: device ``cuda``, 32-lane warps."""

    name = "cuda"
    default_device = "cuda"
    proxy = False
    warp_size = 32

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Needs a CUDA (not ROCm) build of torch and a visible CUDA device."""
        if torch.version.hip is not None:
            return False, f"torch {torch.__version__} is a ROCm build (HIP {torch.version.hip}); use the rocm backend"
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is not a CUDA build"
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        return True, ""
