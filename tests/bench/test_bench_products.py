"""``bench/bench_products.py``: the quick CPU run checks every candidate against the steps apart
through the Triton interpreter, and the table it writes from timings picks the fastest."""

from __future__ import annotations

import json

import pytest
import torch

from ngram_hal.kernels.triton import interpreting
from ngram_hal.kernels.triton.products import Tiling, choose, choose_invariant


@pytest.fixture
def bench_products(load_bench):
    pytest.importorskip("triton")
    return load_bench("bench_products")


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_checks_every_product_and_candidate(bench_products, tmp_path):
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 64}))
    out = tmp_path / "products.json"
    bench_products.main(["--device", "cpu", "--shapes", str(shape), "--rows", "1,3", "--quick", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {(r["product"], r["n"], r["k"]) for r in results} == {
        ("qkv", 128, 64), ("o", 64, 64), ("gate_up", 192, 64), ("down", 64, 96), ("lm_head", 96, 64)}
    assert {r["candidate"] for r in results if r["product"] != "qkv"} == {"apart", "16x32x256", "16x16x64",
                                                                        "16x16x64/k2"}
    unrotated = {"16x32x256/rk", "16x16x64/rk"}
    assert {r["candidate"] for r in results if r["product"] == "qkv"} == {"apart", "16x32x256", "16x16x64",
                                                                        "16x16x64/k2"} | unrotated
    assert len(results) == 5 * 2 * 4 + 2 * 2
    assert all(r["max_rel_diff"] < 1e-4 and r["us"] is None for r in results), "float32, and no timings on the CPU"



@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_jobs_run_the_candidates_in_processes_first_and_the_sweep_after_them(bench_products, tmp_path):
    """``--jobs 2``: a process per product and share of the tilings runs them first (at a row count of
    each of Triton's specialisations), then the sweep times every candidate as without it."""
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 64}))
    out = tmp_path / "products.json"
    bench_products.main(["--device", "cpu", "--shapes", str(shape), "--rows", "1,3,16,17", "--quick", "--jobs", "2",
                         "--products", "o,down", "--tilings", "16x16x64,16x16x64/k2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["precompiled"]["processes"] == 4, "two products x two tilings, shared out to twice the jobs"
    assert report["precompiled"]["rows"] == "1,3,16"
    assert {(r["product"], r["candidate"]) for r in report["results"]} == {
        (p, c) for p in ("o", "down") for c in ("apart", "16x16x64", "16x16x64/k2")}
    assert len(report["results"]) == 2 * 4 * 3


def test_one_row_count_a_specialisation_and_jobs_at_least_one(bench_products):
    assert bench_products.specialisations([1, 8, 16, 17, 32, 272]) == [1, 8, 16]
    assert bench_products.specialisations([16, 32]) == [16]
    with pytest.raises(SystemExit):
        bench_products.main(["--device", "cpu", "--jobs", "0"])


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_a_tiling_whose_stages_do_not_fit_the_device_is_skipped_and_listed(bench_products, tmp_path, monkeypatch):
    from triton.runtime.errors import OutOfResources

    real = bench_products.output

    def output(kind, kernels, linear, x, step):
        if kernels.launch.products.shapes[0].by_rows[0].tiling == Tiling(16, 16, 64):
            raise OutOfResources(232448, 232448 // 2, "shared memory")
        return real(kind, kernels, linear, x, step)

    monkeypatch.setattr(bench_products, "output", output)
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 64}))
    out = tmp_path / "products.json"
    bench_products.main(["--device", "cpu", "--shapes", str(shape), "--rows", "1,3", "--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {r["candidate"] for r in report["results"]} == {"apart", "16x32x256", "16x16x64/k2", "16x32x256/rk",
                                                           "16x16x64/rk"}
    assert len(report["skipped"]) == 5 * 2
    assert {tuple(s["tiling"]) for s in report["skipped"]} == {tuple(Tiling(16, 16, 64))}
    assert all("shared memory" in s["reason"] for s in report["skipped"])


def test_a_table_needs_timings(bench_products, tmp_path):
    with pytest.raises(SystemExit, match="--write-table needs timings"):
        bench_products.main(["--device", "cpu", "--shapes", "smollm2-135m", "--rows", "1", "--quick",
                             "--write-table", str(tmp_path / "t.json"), "--json",
                             str(tmp_path / "r.json")])


def _results(times: dict, same_bits: bool = True) -> list[dict]:
    return [{"n": 8, "k": 4, "rows": rows, "tiling": None if t is None else list(t), "us": us,
             "same_bits": None if t is None else same_bits}
            for rows, cands in times.items() for t, us in cands.items()]


A, B = (16, 32, 256, 4, 3), (16, 64, 128, 4, 3)
TIMES = {1: {None: 10.0, A: 5.0, B: 6.0}, 16: {None: 4.0, A: 9.0, B: 6.0}, 64: {None: 8.0, A: 12.0, B: 10.0}}


def test_the_table_takes_the_fastest_per_row_count_and_one_invariant_tiling(bench_products):
    table = bench_products.choose_table(_results(TIMES), "gpu", torch.bfloat16, "test")
    choice = table.lookup(8, 4)
    assert [choose(choice, rows) for rows in (1, 16, 64)] == [Tiling(*A), None, None]
    assert choice.invariant == Tiling(*B), "b: 6/5 + 6/4 + 10/8 against a: 1 + 9/4 + 12/8"
    assert table.device == "gpu" and table.dtype == "bfloat16"


def test_where_the_tilings_agree_the_invariant_mode_takes_the_fastest_fused_tiling_per_row_count(bench_products):
    choice = bench_products.choose_table(_results(TIMES), "gpu", torch.bfloat16, "test").lookup(8, 4)
    assert choice.tilings_agree
    assert [choose_invariant(choice, rows) for rows in (1, 2, 16, 64, 1000)] == [Tiling(*A)] + [Tiling(*B)] * 4
    differ = bench_products.choose_table(_results(TIMES, same_bits=False), "gpu", torch.bfloat16, "test").lookup(8, 4)
    assert not differ.tilings_agree
    assert {choose_invariant(differ, rows) for rows in (1, 16, 64, 1000)} == {Tiling(*B)}, "one tiling for all"


S4, S4B, S2 = (64, 64, 64, 4, 6, 4), (16, 32, 128, 4, 4, 4), (16, 32, 256, 4, 3, 2)
SPLIT_TIMES = {1: {None: 10.0, A: 5.0, B: 6.0, S4: 5.5, S4B: 5.2, S2: 4.0},
               16: {None: 4.0, A: 9.0, B: 6.0, S4: 6.5, S4B: 6.1, S2: 3.5},
               64: {None: 8.0, A: 12.0, B: 10.0, S4: 9.0, S4B: 11.0, S2: 7.0},
               272: {None: 5.0, A: 14.0, B: 12.0, S4: 6.0, S4B: 9.0}}


def _split_results(disagree: tuple = ()) -> list[dict]:
    return [{**r, "k": 1536, "same_bits": r["same_bits"] and tuple(r["tiling"] or ()) not in disagree}
            for r in _results(SPLIT_TIMES)]


def test_the_invariant_mode_keeps_the_runs_of_k_that_sum_least_and_were_timed_at_every_row_count(bench_products):
    """K = 1,536: S4 and S4B walk it in four runs of 384, S2 in two of 768, A and B in one. S2 is
    the fastest up to 64 rows but was not timed at 272, so the invariant mode cannot keep its runs;
    the runs of 384 sum to 5.2/4 + 6.1/3.5 + 9/7 + 6/5 against one walk's 5/4 + 6/3.5 + 10/7 + 12/5."""
    choice = bench_products.choose_table(_split_results(), "gpu", torch.bfloat16, "test").lookup(8, 1536)
    assert [choose(choice, rows) for rows in (1, 16, 64, 272)] == [Tiling(*S2)] * 3 + [None]
    assert choice.tilings_agree and choice.invariant == Tiling(*S4), "S4 sums less than S4B over every row count"
    assert [choose_invariant(choice, rows) for rows in (1, 16, 64, 272, 1000)] == [Tiling(*S4B)] * 2 + [Tiling(*S4)] * 3
    assert all(b.fused.k_split(1536) == 384 for b in choice.by_rows)


def test_where_a_runs_tilings_disagree_its_one_best_tiling_competes_for_every_row_count(bench_products):
    differ = bench_products.choose_table(_split_results(disagree=(S4B,)), "gpu", torch.bfloat16, "test")
    choice = differ.lookup(8, 1536)
    assert not choice.tilings_agree and choice.invariant == Tiling(*S4), "S4 alone: 5.72 against one walk's 6.79"
    assert {choose_invariant(choice, rows) for rows in (1, 16, 64, 272, 1000)} == {Tiling(*S4)}
    both = bench_products.choose_table(_split_results(disagree=(S4B, A)), "gpu", torch.bfloat16, "test")
    assert both.lookup(8, 1536).invariant == Tiling(*S4)


def test_a_new_sweep_keeps_the_shapes_of_the_table_it_did_not_sweep(bench_products):
    old = bench_products.choose_table(_results(TIMES) + [{**r, "n": 16} for r in _results(TIMES)], "gpu",
                                      torch.bfloat16, "old run")
    new = bench_products.choose_table(_results(TIMES, same_bits=False), "gpu", torch.bfloat16, "new run")
    merged = bench_products.keep_others(old, new)
    assert not merged.lookup(8, 4).tilings_agree and merged.lookup(16, 4).tilings_agree
    assert merged.source == "new run; other shapes: old run"
    other = bench_products.choose_table(_results(TIMES), "another gpu", torch.bfloat16, "x")
    with pytest.raises(SystemExit, match="holds a table for gpu bfloat16"):
        bench_products.keep_others(old, other)
