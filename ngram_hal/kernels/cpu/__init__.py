"""The reference backend's CPU kernels: compiled products (numba) and its model kernels."""

from .layer_kernels import CpuLayerKernels
from .panel_linear import PanelLinear
from .quant_linear import QuantPanelLinear

__all__ = ["CpuLayerKernels", "PanelLinear", "QuantPanelLinear"]
