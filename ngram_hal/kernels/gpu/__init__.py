"""Engine-side Triton kernels for GPUs (CUDA and ROCm): fused model compute, not HAL ops.

Each module holds one kernel beside the wrapper that checks its arguments and launches it. They
replace chains of small torch ops in the model's layers (fewer launches per layer, which is what
a decode step on a GPU is made of) and serve the batch-invariant mode, where a row's result must
not depend on how many rows share the call. Importing this package does not import Triton.
"""
