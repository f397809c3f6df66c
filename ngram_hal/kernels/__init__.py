"""Kernels the engine uses beside the HAL's ops, one module per kernel with its checking wrapper."""
