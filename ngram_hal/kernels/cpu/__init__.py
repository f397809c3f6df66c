"""Compiled CPU kernels (numba)."""

from .panel_linear import PanelLinear

__all__ = ["PanelLinear"]
