"""The model on a backend that runs Triton kernels (fused norm, rotary/store, SwiGLU, attention)
against the same weights on the reference backend, and its batch-invariant mode: prefill, decode
and tree-verify logits. Under Triton's interpreter here (float32), compiled on a CUDA device."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from test_model import TINY, Session  # noqa: E402

from ngram_hal.engine.model import LlamaModel, random_weights  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40, 41], [1, 8, 8, 8, 8, 8, 8, 8, 8, 2, 11]]


def _sessions(batch_invariant: bool = False):
    weights = random_weights(TINY, seed=5)
    ref = LlamaModel(TINY, weights, CpuBackend(), torch.float32)
    tri = LlamaModel(TINY, weights, CudaBackend(device=DEVICE), torch.float32, batch_invariant=batch_invariant)
    return Session(ref), Session(tri)


def _close(got, want, what):
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=2e-4, rtol=2e-4, msg=lambda m: f"{what}: {m}")


def test_prefill_decode_and_tree_match_the_reference():
    ref, tri = _sessions()
    requests = list(enumerate(PROMPTS))
    _close(tri.extend(requests), ref.extend(requests), "prefill")
    step = [(0, [3]), (1, [9]), (2, [8])]
    _close(tri.extend(step), ref.extend(step), "decode")
    parents = [-1, 0, 0, 1, 2]
    tokens = [[4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [8, 8, 2, 8, 11]]
    _close(tri.tree([0, 1, 2], tokens, parents), ref.tree([0, 1, 2], tokens, parents), "tree verify")


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    """A decode row of request 0 gives the same logits alone and with two other requests."""
    _, alone = _sessions(batch_invariant=True)
    _, batched = _sessions(batch_invariant=True)
    requests = list(enumerate(PROMPTS))
    alone.extend(requests)
    batched.extend(requests)
    one = alone.extend([(0, [3])])
    many = batched.extend([(1, [9]), (0, [3]), (2, [8])])
    assert torch.equal(one[0], many[1])
