"""Product tables: their validation and the choice they make per weight shape and row count (the
model run by one: ``test_model_triton.py``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("triton")
from numerics import assert_invariant  # noqa: E402
from tiny_model import TINY  # noqa: E402

from ngram_hal.kernels.gpu.layer_kernels import TritonLayerKernels, TritonLinear  # noqa: E402
from ngram_hal.kernels.gpu.matmul import SMALL_ROWS  # noqa: E402
from ngram_hal.kernels.triton import LaunchConfig  # noqa: E402
from ngram_hal.kernels.triton.products import SCHEMA, ProductTable, Tiling, choose, table_for  # noqa: E402
from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.model_kernels import DenseLinear  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QKV = ((TINY.num_heads + 2 * TINY.num_kv_heads) * TINY.head_dim, TINY.hidden_size)
GATE_UP = (2 * TINY.intermediate_size, TINY.hidden_size)  # the LM head's shape too: one choice serves both


def shape(n, k, by_rows, invariant=(16, 32, 256)):
    return {"n": n, "k": k, "invariant": list(invariant),
            "by_rows": [{"max_rows": rows, "tiling": tiling} for rows, tiling in by_rows]}


def table(*shapes, device="test-gpu") -> ProductTable:
    return ProductTable.model_validate({"schema": SCHEMA, "device": device, "dtype": "float32", "source": "test",
                                        "shapes": list(shapes)})


TABLE = table(shape(*QKV, [(1, [16, 16, 64]), (8, None), (64, [16, 64, 128, 8, 2])]),
              shape(*GATE_UP, [(4, [32, 16, 64]), (16, None), (64, [16, 32, 128])], invariant=(16, 16, 64, 2, 2)))


def test_the_choice_follows_the_row_buckets_and_more_rows_run_apart():
    qkv = TABLE.lookup(*QKV)
    assert choose(qkv, 1) == Tiling(16, 16, 64)
    assert choose(qkv, 2) is None and choose(qkv, 8) is None
    assert choose(qkv, 9) == Tiling(16, 64, 128, 8, 2) and choose(qkv, 64).label == "16x64x128/w8/s2"
    assert choose(qkv, 65) is None
    assert TABLE.lookup(7, 7) is None
    split = table(shape(*QKV, [(1, [16, 32, 256, 4, 3, 4])])).lookup(*QKV)
    assert choose(split, 1).split_k == 4 and choose(split, 1).label == "16x32x256/k4"


def test_a_tilings_runs_of_k_are_whole_block_k_steps_and_one_run_is_all_of_k():
    assert Tiling(64, 64, 64, split_k=4).k_split(1536) == 384 == Tiling(16, 32, 128, split_k=4).k_split(1536)
    assert Tiling(16, 32, 256, split_k=4).k_split(1536) == 512, "ceil(384 / 256) steps of 256"
    assert Tiling(64, 64, 64, split_k=4).k_split(576) == 192 and Tiling(16, 32, 128, split_k=4).k_split(576) == 256
    assert Tiling(16, 32, 256).k_split(576) == 576 and Tiling(16, 32, 512, split_k=2).k_split(576) == 512
    assert Tiling(16, 32, 512, split_k=2).k_split(512) == 512, "one run of 512: all of K"
    assert Tiling(16, 16, 32, split_k=64).k_split(200) == 32


def test_kernels_take_the_table_where_it_lists_the_shape_and_the_fixed_rule_elsewhere():
    backend = CudaBackend(device=DEVICE)
    backend.launch = dataclasses.replace(backend.launch, products=TABLE)
    kernels = TritonLayerKernels(TINY, backend, torch.float32)
    listed, unlisted = DenseLinear(torch.zeros(QKV)), DenseLinear(torch.zeros(TINY.hidden_size, TINY.hidden_size))
    assert kernels.tiling(1, listed) == Tiling(16, 16, 64) and kernels.tiling(5, listed) is None
    assert kernels.tiling(5, unlisted) == SMALL_ROWS
    assert kernels.tiling(backend.launch.fused_linear_rows + 1, unlisted) is None
    invariant = TritonLayerKernels(TINY, backend, torch.float32, batch_invariant=True)
    assert invariant.tiling(5, listed) == Tiling(16, 32, 256) and invariant.tiling(500, unlisted) == SMALL_ROWS


def test_a_qkv_tiling_that_does_not_rotate_leaves_the_rotation_to_the_rotary_kernel():
    """``rotate`` False (``/rk``): the table's tiling reaches the kernels as it is, and the QKV step
    (the product in that tiling, then the rotary kernel) gives the rotating product's bits where the
    kernels compile (within tolerance under the interpreter, whose products may round otherwise)."""
    tiling, unrotated = Tiling(16, 16, 64), Tiling(16, 16, 64, rotate=False)
    assert unrotated.label == "16x16x64/rk" and list(unrotated) == [16, 16, 64, 4, 3, 1, False]
    backend = CudaBackend(device=DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(3)
    x = torch.randn(5, TINY.hidden_size, generator=gen, device=DEVICE)
    weight = 0.1 * torch.randn(QKV, generator=gen, device=DEVICE)
    positions = torch.tensor([0, 3, 9, 40, 2], device=DEVICE)
    locs = torch.tensor([4, -1, 0, 7, 2], device=DEVICE)
    results = {}
    for t in (tiling, unrotated):
        backend.launch = dataclasses.replace(backend.launch, products=table(shape(*QKV, [(8, list(t))])))
        kernels = TritonLayerKernels(TINY, backend, torch.float32)
        assert kernels.tiling(5, DenseLinear(weight)) == t
        kv = KVCache(1, 8, TINY.num_kv_heads, TINY.head_dim, torch.float32, DEVICE)
        q = kernels.norm_rope_store(x, None, TritonLinear(weight, kernels), positions, kv, 0, locs)
        results[t.rotate] = (q, kv.k[0], kv.v[0])
    for name, a, b in zip(("queries", "K", "V"), results[True], results[False]):
        assert_invariant(b, a, f"the {name} of the rotary kernel against the rotating product's")
    assert results[True][1][4].any() and not results[True][1][[1, 3, 5, 6]].any(), "stored where the slots say"


@pytest.mark.parametrize("bad, message", [
    (shape(4, 8, [(1, [16, 24, 64])]), "block_n must be a positive power of two, got 24"),
    (shape(4, 8, [(8, None), (2, None)]), "by_rows bounds must increase"),
    (shape(4, 8, [(1, None)], invariant=(16, 16, 16, 4, 0)), "num_stages must be a positive int"),
    (shape(4, 8, [(1, [16, 16, 64, 4, 3, 0])]), "split_k must be a positive int"),
    ({**shape(4, 256, [(1, None)], invariant=(16, 16, 64, 4, 3, 2)),
      "by_rows": [{"max_rows": 1, "tiling": None, "fused": [16, 16, 64]}]},
     r"tilings must walk K in the same runs: 16x16x64 walks 256, 16x16x64/k2 128"),
])
def test_a_bad_table_is_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        table(bad)


def test_a_shape_listed_twice_or_another_schema_is_refused(tmp_path):
    with pytest.raises(ValueError, match="listed twice"):
        table(shape(4, 8, [(1, None)]), shape(4, 8, [(2, None)]))
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**TABLE.model_dump(mode="json", by_alias=True), "schema": "ngram-hal/product-table/0"}))
    with pytest.raises(ValueError, match="(?s)old.json.*expected 'ngram-hal/product-table/1'"):
        ProductTable.load(path)
    with pytest.raises(ValueError, match="products: expected a ProductTable"):
        LaunchConfig(products={"shapes": []})


def test_the_backend_finds_the_table_of_its_device_by_name(tmp_path):
    TABLE.dump(tmp_path / "a.json")
    table(shape(4, 8, [(1, None)]), device="other-gpu").dump(tmp_path / "b.json")
    assert table_for(tmp_path, "test-gpu") == TABLE
    assert table_for(tmp_path, "other-gpu").lookup(4, 8) is not None
    assert table_for(tmp_path, "unlisted-gpu") is None
