"""Test-session set-up shared by every test module."""

import os

import torch

# Without a CUDA device the portable Triton kernels run in Triton's interpreter on CPU tensors.
# Triton decides when a kernel module is imported, so this must precede every such import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
