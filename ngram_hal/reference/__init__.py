"""The reference backend ``cpu``: plain, device-generic torch; the conformance oracle."""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
