"""``CudaBackend``: NVIDIA GPUs through a CUDA build of torch and the portable Triton kernels.

Every op runs a kernel of :mod:`ngram_hal.kernels.triton` with 32-lane warp launch settings.
The generic runtime (streams, events, pinned buffers, graph capture) reaches the GPU through
``torch.cuda``.

Proxy mode: with ``NGRAM_HAL_CUDA_PROXY=1``, ``TRITON_INTERPRET=1`` and no CUDA device, the same
kernels run in Triton's interpreter on CPU tensors. Such a run checks the kernels' index math,
not a GPU (no speed, no races), and reports ``proxy=True``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ngram_hal.backend import Backend
from ngram_hal.kernels.triton import LaunchConfig, interpreting
from ngram_hal.kernels.triton.ops import TritonHalOps
from ngram_hal.kernels.triton.products import table_for
from ngram_hal.proxy import ProxyFlag, requested

PROXY_ENV = "NGRAM_HAL_CUDA_PROXY"
# Product tables swept per GPU model (bench/bench_products.py); a native device runs by the one of
# its model, if any: in both modes every row count runs the product the sweep found fastest, and
# the batch-invariant mode its fastest fused tiling where the sweep found the tilings' bits equal
# (without a table: the fixed rule, and one tiling for every row count). On the H200 the table's
# decode steps took 0.85-1.04x the fixed rule's (docs/bench/h200-invariant/).
PRODUCT_TABLES = Path(__file__).parent / "products"
# Programmatic dependent launch (the model's layer kernels overlap each other's launch) needs
# sm_90 (Hopper) or later.
PDL_CAPABILITY = (9, 0)


def _native() -> bool:
    return torch.version.cuda is not None and torch.version.hip is None and torch.cuda.is_available()


class CudaBackend(TritonHalOps, Backend):
    """The CUDA backend: device ``cuda``, 32-lane warps, every op a Triton kernel."""

    name = "cuda"
    default_device = "cuda"
    proxy = ProxyFlag(PROXY_ENV, _native)
    warp_size = 32
    launch = LaunchConfig(warp_size=32, num_warps=4, max_num_warps=32)

    def __init__(self, device: torch.device | str | None = None, strict: bool | None = None):
        if device is None and type(self).proxy:
            device = "cpu"
        super().__init__(device=device, strict=strict)
        if self.device.type == "cpu":
            # Interpreted on the CPU: split the keys of small batches too, so that the key-split and
            # merge kernels (the GPU's decode path) run in the proxy's checks.
            self.launch = replace(self.launch, attn_programs=64, attn_min_split=16, attn_invariant_keys=16)
        else:
            table = table_for(PRODUCT_TABLES, torch.cuda.get_device_name(self.device))
            pdl = torch.cuda.get_device_capability(self.device) >= PDL_CAPABILITY
            self.launch = replace(self.launch, products=table, pdl=pdl)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Native: a CUDA (not ROCm) build of torch that sees a device. Proxy (opt-in,
        ``NGRAM_HAL_CUDA_PROXY=1``): ``TRITON_INTERPRET=1``. (Without Triton the backend does not
        load.)"""
        if _native():
            return True, ""
        if requested(PROXY_ENV):
            if not interpreting():
                return False, "proxy run requested but TRITON_INTERPRET is not 1 and there is no CUDA device"
            return True, "proxy: no CUDA device; Triton kernels interpreted on the CPU"
        if torch.version.hip is not None:
            return False, f"torch {torch.__version__} is a ROCm build (HIP {torch.version.hip}); use the rocm backend"
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is not a CUDA build; set {PROXY_ENV}=1 for a proxy run"
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
