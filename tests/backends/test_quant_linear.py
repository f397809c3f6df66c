"""QuantPanelLinear: weights kept as their Q4_1 / Q8_0 codes give PanelLinear's floats bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.kernels.cpu import CpuLayerKernels, PanelLinear, QuantPanelLinear
from ngram_hal.kernels.cpu.panel_linear import KERNEL_ROWS, PANEL
from ngram_hal.kernels.cpu.quant_linear import quantize_exactly
from ngram_hal.reference import CpuBackend

FORMATS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def dequantized(fmt: str, rows: int = 2 * PANEL + 37, cols: int = 96, seed: int = 0) -> torch.Tensor:
    """A float32 weight that is exactly a ``fmt`` tensor dequantized by the gguf package (as the
    model loader reads a file); 2 full panels and a partial one by default."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = FORMATS[fmt]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind),
                                                 dtype=np.float32))


@pytest.fixture(params=sorted(FORMATS))
def fmt(request) -> str:
    return request.param


def test_an_exact_dequantization_is_recognised_and_nothing_else(fmt):
    weight = dequantized(fmt)
    found, codes, d, m = quantize_exactly(weight)
    assert found == fmt
    blocks = codes.reshape(weight.shape[0], -1, 32)
    rebuilt = d[..., None] * blocks + m[..., None] if fmt == "q4_1" else blocks * d[..., None]
    assert np.array_equal(rebuilt.reshape(weight.shape), weight.numpy())
    nudged = weight.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(np.inf))
    assert quantize_exactly(nudged) is None, "one weight off by one ulp is no longer that tensor"
    assert quantize_exactly(torch.randn(8, 64)) is None
    assert quantize_exactly(dequantized(fmt, cols=96)[:, :80]) is None, "K not a multiple of the block"


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 100, KERNEL_ROWS, KERNEL_ROWS + 1, 200])
def test_bit_for_bit_panel_linear(fmt, threads, rows):
    """Up to ``kernel_rows`` bit for bit PanelLinear's kernel; past them BLAS over the decoded
    weight, one product where PanelLinear runs one per panel: the same sums, in an order BLAS
    chooses."""
    weight = dequantized(fmt)
    layer = QuantPanelLinear(*quantize_exactly(weight))
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = layer(x)
    assert got.shape == (rows, weight.shape[0]) and got.dtype == torch.float32 and got.is_contiguous()
    want = PanelLinear(weight)(x)
    if rows <= KERNEL_ROWS:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.get_num_threads() == threads, "one thread runs the serial kernels: numba's pool must not start"


def test_rows_and_dense_give_the_weight_back(fmt):
    weight = dequantized(fmt)
    layer = QuantPanelLinear(*quantize_exactly(weight))
    assert torch.equal(layer.dense(), weight)
    ids = torch.tensor([0, PANEL - 1, PANEL, weight.shape[0] - 1, 3, PANEL], dtype=torch.int64)
    assert torch.equal(layer.rows(ids), weight[ids])


def test_the_cpu_backend_keeps_file_weights_as_codes(fmt):
    weight = dequantized(fmt)
    config = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=48)
    for invariant in (False, True):
        kernels = CpuLayerKernels(config, CpuBackend(), torch.float32, batch_invariant=invariant)
        layer = kernels.linear(weight)
        assert isinstance(layer, QuantPanelLinear) and layer.format == fmt and layer.batch_invariant == invariant
    assert type(kernels.linear(torch.randn(8, 96))) is PanelLinear


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match=r"format 'q5_0' \(expected one of q4_1, q8_0\)"):
        QuantPanelLinear("q5_0", np.zeros((4, 32), np.float32), np.zeros((4, 1), np.float32),
                         np.zeros((4, 1), np.float32))
