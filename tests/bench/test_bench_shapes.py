"""``bench/bench_shapes.py`` on the CPU with a tiny shape from a JSON file: every row and target reported."""

from __future__ import annotations

import json

import pytest


def tiny_shape(tmp_path, **fields):
    """A JSON shape file of a tiny Llama with ``fields`` (layers, positions) set."""
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                                 "num_kv_heads": 2, "head_dim": 8, **fields}))
    return shape


def test_a_tiny_shape_reports_plain_and_verify_rows(tmp_path, load_bench):
    bench_shapes = load_bench("bench_shapes")

    shape = tiny_shape(tmp_path, num_layers=2, max_position_embeddings=256)
    out = tmp_path / "shapes.json"
    bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--batch-sizes", "1,2", "--prompt-len", "8",
                       "--new-tokens", "5", "--tree-size", "4", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [s["shape"] for s in report["shapes"]] == ["tiny"] and report["dtype"] == "float32"
    assert [(r["batch"], r["tree_size"]) for r in report["runs"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert {(r["products"], r["pdl"], r["rope"]) for r in report["runs"]} == {("fixed", "off", "off")}
    for row in report["runs"]:
        assert row["decode_tokens_per_s"] > 0 and row["steps"] >= 1
        assert ("step_vs_plain" in row) == (row["tree_size"] == 4)
    assert report["copy_bandwidth_bytes_per_s"] is None, "no weight-streaming limit on the host"
    assert report["matmul_flops_per_s"] is None and not any("bound_by" in r for r in report["runs"])
    assert {t["target"].split(":")[0] for t in report["targets"]} == {"llama-1b", "llama-8b"}
    assert all(t["measured"] is None for t in report["targets"])


def test_an_unknown_shape_is_a_usage_error(load_bench, capsys):
    bench_shapes = load_bench("bench_shapes")

    with pytest.raises(SystemExit) as exit_:
        bench_shapes.main(["--backend", "cpu", "--shapes", "llama-9b"])
    assert exit_.value.code == 2
    assert "shape 'llama-9b': neither a preset" in capsys.readouterr().err


def test_launch_modes_the_backend_lacks_are_refused(tmp_path, load_bench, capsys):
    bench_shapes = load_bench("bench_shapes")

    shape = tiny_shape(tmp_path, num_layers=1, max_position_embeddings=64)
    with pytest.raises(SystemExit, match="--pdl on,off: the cpu backend's model kernels launch without"):
        bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--pdl", "on,off", "--json",
                           str(tmp_path / "out.json")])
    with pytest.raises(SystemExit, match="--rope on: the cpu backend's model kernels have no QKV product that"):
        bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--rope", "on", "--json",
                           str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as exit_:
        bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--pdl", "on,on"])
    assert exit_.value.code == 2 and "expected on or off" in capsys.readouterr().err


def test_products_may_name_a_table_file_to_run_beside_the_backends(tmp_path, load_bench):
    argparse = load_bench("argparse")

    import bench_shapes
    from ngram_hal.kernels.triton.products import SCHEMA, ProductTable

    parse = bench_shapes.modes("table", "fixed", files=True)
    assert parse("table,old.json") == ["table", "old.json"]
    with pytest.raises(argparse.ArgumentTypeError, match="or a .json file"):
        parse("table,old.txt")
    path = tmp_path / "old.json"
    old = ProductTable.model_validate({"schema": SCHEMA, "device": "gpu", "dtype": "bfloat16", "source": "old",
                                       "shapes": [{"n": 4, "k": 8, "invariant": [16, 32, 256],
                                                   "by_rows": [{"max_rows": 1, "tiling": [16, 32, 256, 4, 3, 2]}]}]})
    old.dump(path)

    class Launch:
        products = "the backend's"

    assert bench_shapes.product_table(str(path), Launch) == old
    assert bench_shapes.product_table("table", Launch) == "the backend's"
    assert bench_shapes.product_table("fixed", Launch) is None


def test_launch_fields_apply_to_triton_kernels_only(tmp_path, load_bench):
    bench_shapes = load_bench("bench_shapes")

    shape = tiny_shape(tmp_path, num_layers=1, max_position_embeddings=64)
    with pytest.raises(SystemExit, match="--launch: the cpu backend's model kernels have no Triton launch"):
        bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--launch", "attn_invariant_fill=2",
                           "--json", str(tmp_path / "out.json")])


def test_the_batch_invariant_mode_runs_and_is_reported(tmp_path, load_bench):
    bench_shapes = load_bench("bench_shapes")

    shape = tiny_shape(tmp_path, num_layers=1, max_position_embeddings=64)
    out = tmp_path / "shapes.json"
    bench_shapes.main(["--backend", "cpu", "--shapes", str(shape), "--batch-sizes", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--tree-size", "4", "--batch-invariant", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["options"]["batch_invariant"] is True
    assert [(r["batch"], r["tree_size"]) for r in report["runs"]] == [(2, 1), (2, 4)]
