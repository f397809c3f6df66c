"""``RocmBackend``: AMD GPUs through a ROCm (HIP) build of torch and the portable Triton kernels.

ROCm torch exposes its GPUs under torch's ``cuda`` device type, so the default device is ``cuda``
and the runtime (streams, events, pinned buffers, graph capture by HIP graphs) is torch's CUDA API,
which a ROCm build backs with HIP. Every op runs a kernel of :mod:`ngram_hal.kernels.triton`,
launched for the device's wavefronts: 64 lanes on CDNA (Instinct), at most 16 wavefronts (1024
lanes) a program. Options that only Triton's AMD target accepts go into the launch configuration
only when the kernels compile for AMD.

Proxy mode: with ``NGRAM_HAL_ROCM_PROXY=1`` and torch not a ROCm build, the same kernels and
launch settings run elsewhere: interpreted on CPU tensors under ``TRITON_INTERPRET=1``, or
compiled for an NVIDIA GPU. Such a run checks semantics, not AMD hardware, and reports
``proxy=True``; a ROCm build of torch always runs natively.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ngram_hal.backend import Backend
from ngram_hal.kernels.triton import LaunchConfig, interpreting
from ngram_hal.kernels.triton.ops import TritonHalOps
from ngram_hal.proxy import ProxyFlag, requested

PROXY_ENV = "NGRAM_HAL_ROCM_PROXY"
# A HIP workgroup holds at most 1024 lanes.
MAX_LANES = 1024
WAVE64 = LaunchConfig(warp_size=64, num_warps=4, max_num_warps=MAX_LANES // 64)
# Occupancy hint of the AMD target: registers sized for two waves per SIMD.
WAVES_PER_EU = 2
# CDNA's matrix cores: 16x16 MFMA tiles, which suit the small row blocks of decode and tree verify.
MFMA_NONKDIM = 16
# Architectures with MFMA instructions: CDNA 1 to 4 (MI100, MI200, MI300, MI350).
MFMA_ARCHS = ("gfx908", "gfx90a", "gfx94", "gfx95")


def _native() -> bool:
    return torch.version.hip is not None


def hip_launch(props) -> LaunchConfig:
    """Launch settings for an AMD GPU from its torch device properties.

    The wavefront width is the device's (64 on CDNA, 32 on RDNA); warps per program stay within
    1024 lanes. The AMD-only options: ``waves_per_eu`` always, ``matrix_instr_nonkdim`` where the
    architecture (``gcnArchName``) has the MFMA instructions it selects.
    """
    wave = int(getattr(props, "warp_size", 64) or 64)
    options: tuple[tuple[str, int], ...] = (("waves_per_eu", WAVES_PER_EU),)
    if str(getattr(props, "gcnArchName", "")).startswith(MFMA_ARCHS):
        options += (("matrix_instr_nonkdim", MFMA_NONKDIM),)
    return replace(WAVE64, warp_size=wave, max_num_warps=MAX_LANES // wave, kernel_options=options)


def proxy_device() -> str | None:
    """Where a proxy run executes: ``"cpu"`` under ``TRITON_INTERPRET=1``, ``"cuda"`` on an NVIDIA
    GPU, ``None`` when neither is possible."""
    if interpreting():
        return "cpu"
    if torch.version.cuda is not None and torch.cuda.is_available():
        return "cuda"
    return None


class RocmBackend(TritonHalOps, Backend):
    """The ROCm backend: device ``cuda`` (torch's name for HIP devices), every op a Triton kernel."""

    name = "rocm"
    default_device = "cuda"
    proxy = ProxyFlag(PROXY_ENV, _native)
    warp_size = 64
    launch = WAVE64

    def __init__(self, device: torch.device | str | None = None, strict: bool | None = None):
        if device is None and type(self).proxy:
            device = proxy_device()
        super().__init__(device=device, strict=strict)
        if self.device.type == "cpu":
            # Interpreted: split the keys of small batches too, so that the key-split and merge
            # kernels (the decode path on a GPU) run in the proxy's checks.
            self.launch = replace(WAVE64, attn_programs=64, attn_min_split=16, attn_invariant_keys=16)
        elif _native():
            self.launch = hip_launch(torch.cuda.get_device_properties(self.device))
            self.warp_size = self.launch.warp_size

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Native: a ROCm build of torch that sees a device. Proxy (opt-in,
        ``NGRAM_HAL_ROCM_PROXY=1``): ``TRITON_INTERPRET=1`` or an NVIDIA GPU; the reason then says
        it is a proxy. (Without Triton the backend does not load.)"""
        if _native():
            if not torch.cuda.is_available():
                return False, f"torch {torch.__version__} (HIP {torch.version.hip}) sees no ROCm device"
            return True, ""
        if not requested(PROXY_ENV):
            return False, f"torch {torch.__version__} is not a ROCm build; set {PROXY_ENV}=1 for a proxy run"
        device = proxy_device()
        if device is None:
            return False, "proxy run requested but TRITON_INTERPRET is not 1 and there is no CUDA device"
        where = "interpreted on the CPU" if device == "cpu" else "compiled for an NVIDIA GPU"
        return True, f"proxy: no ROCm device; Triton kernels {where}"
