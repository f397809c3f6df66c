"""PanelLinear: the CPU float32 linear layer the model uses for its projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.kernels.cpu import CpuLayerKernels, PanelLinear
from ngram_hal.model_kernels import DenseLinear
from ngram_hal.reference import CpuBackend
from ngram_hal.kernels.cpu.panel_linear import BLOCK_ROWS, KERNEL_ROWS, PANEL


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    # 2 full panels and a partial one: the padded columns must never show.
    return torch.randn(2 * PANEL + 37, 96, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rows", [0, 1, 2, 3, BLOCK_ROWS, BLOCK_ROWS + 1, 7, KERNEL_ROWS, KERNEL_ROWS + 1, 100])
def test_matches_f_linear(weight, threads, rows):
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = PanelLinear(weight)(x)
    assert got.shape == (rows, weight.shape[0]) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_batch(weight, threads):
    """Within the kernel's range (blocks of up to BLOCK_ROWS rows) a row's floats are the same
    whatever else is in the batch."""
    layer = PanelLinear(weight)
    x = torch.randn(KERNEL_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(1))
    full = layer(x)
    for m in range(1, KERNEL_ROWS + 1):
        assert torch.equal(layer(x[:m]), full[:m]), f"rows differ at batch size {m}"
    assert torch.equal(layer(x[5:6]), full[5:6])


def test_rows_and_dense_give_the_weight_back(weight):
    layer = PanelLinear(weight)
    assert torch.equal(layer.dense(), weight)
    ids = torch.tensor([0, PANEL - 1, PANEL, weight.shape[0] - 1, 3], dtype=torch.int64)
    assert torch.equal(layer.rows(ids), weight[ids])


@pytest.mark.parametrize("rows", [1, 2, BLOCK_ROWS + 3, KERNEL_ROWS])
def test_thread_count_does_not_change_the_result(weight, rows):
    x = torch.randn(rows, weight.shape[1])
    layer = PanelLinear(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("bad, what", [
    (lambda w: torch.randn(2, w.shape[1], dtype=torch.float64), "float64"),
    (lambda w: torch.randn(2, w.shape[1] + 1), "wrong K"),
    (lambda w: torch.randn(w.shape[1]), "1-D"),
])
def test_bad_input_is_named(weight, bad, what):
    with pytest.raises(ValueError, match=r"PanelLinear expects float32 \(M, 96\)"):
        PanelLinear(weight)(bad(weight))


def test_bad_weight_is_named():
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        PanelLinear(torch.randn(4, 4, dtype=torch.float16))


def test_the_cpu_backend_picks_panels_for_float32(weight):
    config = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=48)
    kernels = CpuBackend().layer_kernels(config, torch.float32)
    assert isinstance(kernels, CpuLayerKernels) and isinstance(kernels.linear(weight), PanelLinear)
    half = kernels.linear(weight.to(torch.bfloat16))
    assert isinstance(half, DenseLinear)
    x = torch.randn(2, weight.shape[1], dtype=torch.bfloat16)
    assert torch.equal(half(x), F.linear(x, weight.to(torch.bfloat16)))
    assert torch.equal(half.rows(torch.tensor([1])), weight.to(torch.bfloat16)[1:2])
