"""The model on a backend that runs Triton kernels (fused norm, rotary/store, SwiGLU, attention,
fused products)
against the same weights on the reference backend, and its batch-invariant mode: prefill, decode
and tree-verify logits. Under Triton's interpreter here (float32), compiled on a CUDA device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
from numerics import assert_invariant  # noqa: E402
from test_products import TABLE  # noqa: E402
from tiny_model import TINY, Session  # noqa: E402

from ngram_hal.engine.model import LlamaModel, random_weights  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40, 41], [1, 8, 8, 8, 8, 8, 8, 8, 8, 2, 11]]


def _sessions(batch_invariant: bool = False, fused_rows: int | None = None, products=None):
    weights = random_weights(TINY, seed=5)
    ref = LlamaModel(TINY, weights, CpuBackend(), torch.float32)
    backend = CudaBackend(device=DEVICE)
    if fused_rows is not None:
        backend.launch = dataclasses.replace(backend.launch, fused_linear_rows=fused_rows)
    if products is not None:
        backend.launch = dataclasses.replace(backend.launch, products=products)
    tri = LlamaModel(TINY, weights, backend, torch.float32, batch_invariant=batch_invariant)
    return Session(ref), Session(tri)


def _close(got, want, what):
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=2e-4, rtol=2e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("fused_rows, products", [(0, None), (16, None), (None, TABLE)],
                         ids=["apart", "fused-to-16-rows", "product-table"])
def test_prefill_decode_and_tree_match_the_reference(fused_rows, products):
    """Projections with their norm/SwiGLU/residual fused in (up to 16 rows: the decode and tree
    steps, not the 21-row prefill), run apart, or as a product table says per weight shape and row
    bucket (fused, apart, the fixed rule where it is silent): each matches the reference."""
    ref, tri = _sessions(fused_rows=fused_rows, products=products)
    requests = list(enumerate(PROMPTS))
    _close(tri.extend(requests), ref.extend(requests), "prefill")
    step = [(0, [3]), (1, [9]), (2, [8])]
    _close(tri.extend(step), ref.extend(step), "decode")
    parents = [-1, 0, 0, 1, 2]
    tokens = [[4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [8, 8, 2, 8, 11]]
    _close(tri.tree([0, 1, 2], tokens, parents), ref.tree([0, 1, 2], tokens, parents), "tree verify")


@pytest.mark.parametrize("products", [None, TABLE], ids=["fixed-tiling", "product-table"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(products):
    """A decode row of request 0 gives the same logits alone and with two other requests."""
    _, alone = _sessions(batch_invariant=True, products=products)
    _, batched = _sessions(batch_invariant=True, products=products)
    requests = list(enumerate(PROMPTS))
    alone.extend(requests)
    batched.extend(requests)
    one = alone.extend([(0, [3])])
    many = batched.extend([(1, [9]), (0, [3]), (2, [8])])
    assert_invariant(one[0], many[1], "request 0's decode logits alone and in a batch of three")


def test_products_launch_early_up_to_the_weight_bound():
    """With the launch's ``pdl``, a projection's product launches early when its weight holds at
    most ``pdl_max_weight_bytes``; without ``pdl`` none does."""
    backend = CudaBackend(device=DEVICE)
    weights = random_weights(TINY, seed=5)
    layer = LlamaModel(TINY, weights, backend, torch.float32).layers[0]
    small, large = sorted((layer.wo, layer.w_gate_up), key=lambda linear: linear.weight.numel())
    bound = small.weight.numel() * small.weight.element_size()
    for pdl, want in ((True, [True, False]), (False, [False, False])):
        backend.launch = dataclasses.replace(backend.launch, pdl=pdl, pdl_max_weight_bytes=bound)
        kernels = LlamaModel(TINY, weights, backend, torch.float32).kernels
        assert [kernels.pdl(small), kernels.pdl(large)] == want
