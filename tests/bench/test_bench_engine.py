"""``bench/bench_engine.py``: the quick matrix on the CPU end to end, and the parts that only a GPU
run reaches (profiler counts, targets met or missed) on data built here."""

from __future__ import annotations

import json

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.model import LlamaModel
from ngram_hal.reference import CpuBackend

ROW_KEYS = {"batch", "run", "tree_size", "policy", "graphs", "overlap", "invariant", "drafter", "status", "error",
            "warmup_s", "passes_tokens_per_s", "paired_plain_tokens_per_s", "vs_plain_paired",
            "peak_device_memory_bytes", "totals", "steps_by_tree_size", "mean_tree_nodes", "host_ms_per_step",
            "requests", "kinds", "finish_reasons", "verify_steps", "request_errors", "token_ids", "by_kind",
            "same_as_warmup", "graphs_used", "graph_captures", "graph_captures_timed", "kv_cache_bytes", "step_costs",
            "profile", "vs_plain", "vs_old", "same_tokens_as_plain"}
TOTALS_KEYS = {"requests", "output_tokens", "decode_tokens", "verify_steps", "tokens_per_verify_step", "wall_s",
               "tokens_per_s", "decode_s", "decode_tokens_per_s", "prefill_steps", "decode_steps", "tree_nodes",
               "ms_per_decode_step", "launch_s", "wait_s", "hidden_host_s", "critical_host_s", "draft_s", "device_busy_s",
               "device_idle_s", "device_idle_fraction", "prefill_s"}


@pytest.fixture
def bench_engine(load_bench):
    return load_bench("bench_engine")


def test_quick_matrix_on_the_cpu(bench_engine, model_file, two_prompts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_engine.main(["--backend", "cpu", "--quick", "--threads", "1", "--repeats", "2",
                              "--max-context-len", "256",
                              "--prompts", str(two_prompts), "--json", str(out)]) == 0
    report = json.loads(out.read_text())

    assert report["schema"] == "ngram-hal-bench-engine/2"
    assert report["backend"] == "cpu" and report["device_name"] and report["setup"]["dtype"] == "float32"
    assert {"torch", "triton", "driver", "cuda", "python"} <= set(report["versions"])
    assert report["options"]["batch_sizes"] == [1, 2] and report["options"]["tree_sizes"] == [4]
    assert report["options"]["repeats"] == 2
    assert [p["id"] for p in report["prompts"]] == ["echo", "sky"]
    names = ["plain", "plain-nooverlap", "plain-nographs", "plain-nographs-nooverlap", "spec4", "spec4-device",
             "spec4-nooverlap", "auto4", "auto4-device", "invariant-plain", "invariant-spec4", "invariant-spec4-device",
             "invariant-auto4-device"]
    assert [c["name"] for c in report["configurations"]] == names
    assert [(r["batch"], r["run"]) for r in report["runs"]] == [(b, n) for b in (1, 2) for n in names]

    ran = [r for r in report["runs"] if not r["run"].startswith("invariant")]
    for row in ran:
        assert row["status"] == "ok", row.get("traceback")
        assert set(row) == ROW_KEYS and set(row["totals"]) == TOTALS_KEYS
        assert set(row["host_ms_per_step"]) == {"launch", "wait", "hidden", "critical", "draft"}
        assert row["host_ms_per_step"]["launch"] > 0, "every step is launched by the host"
        t = row["totals"]
        assert t["requests"] == 2, "each prompt alone at B = 1, two requests at B = 2"
        assert t["tokens_per_s"] > 0 and t["decode_s"] < t["wall_s"]
        assert len(row["passes_tokens_per_s"]) == 2 and t["tokens_per_s"] in row["passes_tokens_per_s"]
        if row["run"] == "plain":
            assert row["paired_plain_tokens_per_s"] is None and row["vs_plain_paired"] is None
        else:
            assert len(row["paired_plain_tokens_per_s"]) == 2 and row["vs_plain_paired"] > 0
        assert t["decode_tokens"] == sum(len(ids) - 1 for ids in row["token_ids"])
        assert row["peak_device_memory_bytes"] is None and row["profile"] is None, "nothing to profile on the CPU"
        assert t["device_busy_s"] == 0 and row["graphs_used"] is False
        assert row["vs_plain"] > 0 and row["vs_old"] > 0 and row["same_as_warmup"]
        assert row["same_tokens_as_plain"] == {"same": 2, "of": 2, "differ": []}
        assert set(row["by_kind"]) == {"copy", "open", "copy-heavy"}
        assert row["by_kind"]["copy-heavy"]["output_tokens"] == row["by_kind"]["copy"]["output_tokens"]
        tok_s = [row["by_kind"][k]["tokens_per_s"] for k in ("copy", "open")]
        assert all(v > 0 for v in tok_s) if row["batch"] == 1 else tok_s == [None, None]
        assert sum(row["steps_by_tree_size"].values()) == t["decode_steps"]
    assert all(r["requests"] == ["echo", "sky"] for r in ran)
    spec = next(r for r in ran if r["run"] == "spec4" and r["batch"] == 1)
    assert spec["steps_by_tree_size"] == {"4": spec["totals"]["decode_steps"]}
    invariant = [row for row in report["runs"] if row["run"].startswith("invariant")]
    assert invariant and all(row["status"] == "ok" and row["invariant"] for row in invariant), \
        "the cpu backend runs the batch-invariant mode (float32)"

    assert {(e["batch"], e["run"]) for e in report["exactness"]} == {
        (b, n) for b in (1, 2) for n in ("spec4", "spec4-device", "spec4-nooverlap", "auto4", "auto4-device",
                                         "invariant-spec4", "invariant-spec4-device", "invariant-auto4-device")}
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["plain decode, batch 1 (tok/s)"]["met"] is False
    assert targets["plain decode, batch 64 (tok/s)"]["measured"] is None
    assert targets["device idle between steps, plain, batch 1 (graphs, overlap)"]["measured"] is None
    assert targets["tokens with speculation == without, default mode (requests)"]["measured"] == "20/20"
    invariant_exact = targets["tokens with speculation == without, invariant mode (requests)"]
    assert invariant_exact["measured"] == "12/12" and invariant_exact["met"] is True
    printed = capsys.readouterr().out
    assert "targets (measured; not an exit code)" in printed and "invariant-plain" in printed


def test_seeded_sampling_counts_the_same_tokens(bench_engine, model_file, tmp_path):
    """``--temperature`` samples every request with ``--seed``; speculation commits the tokens plain
    decoding samples (the cpu reference's invariant mode), and the report records the sampling."""
    out = tmp_path / "bench.json"
    assert bench_engine.main(["--backend", "cpu", "--quick", "--threads", "1", "--batch-sizes", "2",
                              "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "7",
                              "--runs", "invariant-plain,invariant-spec4-device", "--max-context-len", "256",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["options"]["temperature"] == 0.9 and report["options"]["seed"] == 7
    [check] = report["exactness"]
    assert check["run"] == "invariant-spec4-device" and check["same"] == check["of"] > 0


def test_launch_modes_a_backend_lacks_are_errors(bench_engine, model_file, capsys):
    """``--pdl on`` where the backend never launches early, and ``--products table`` where it has no
    product table, name the backend; nothing is measured."""
    assert bench_engine.main(["--backend", "cpu", "--quick", "--threads", "1", "--pdl", "on"]) == 2
    assert "error: --pdl on: the cpu backend does not launch kernels early on this device" in capsys.readouterr().err
    assert bench_engine.main(["--backend", "cpu", "--quick", "--threads", "1", "--products", "table"]) == 2
    assert "error: --products table: the cpu backend has no product table for this device" in capsys.readouterr().err


def test_launch_overrides_replace_fields_of_both_launch_configurations(bench_engine, capsys):
    """``--launch FIELD=VALUE,...`` replaces those fields in the backend's and the model kernels'
    launch configurations; an unknown field, a bad value or a backend without Triton launches is a
    CommandError naming it, and nothing is changed."""
    from types import SimpleNamespace

    from ngram_hal.cli import CommandError
    from ngram_hal.kernels.triton.launch import LaunchConfig

    args = bench_engine.parse_args(["--launch", "attn_invariant_block_m=64, attn_warps=none,attn_even_split=false"])
    assert args.launch == {"attn_invariant_block_m": 64, "attn_warps": None, "attn_even_split": False}
    model = SimpleNamespace(backend=SimpleNamespace(name="triton", launch=LaunchConfig()),
                            kernels=SimpleNamespace(launch=LaunchConfig(attn_block_m=32)))
    bench_engine.launch_modes(model, args)
    assert model.backend.launch.attn_invariant_block_m == model.kernels.launch.attn_invariant_block_m == 64
    assert model.kernels.launch.attn_block_m == 32 and model.backend.launch.attn_even_split is False
    for bad, message in ((["--launch", "attn_invariant_block_m=48"], "expected a power of two, got 48"),
                         (["--launch", "attn_nothing=1"], "--launch attn_nothing: no such LaunchConfig field"),
                         (["--launch", "pdl=true"], "--launch pdl: no such LaunchConfig field")):
        before = (model.backend.launch, model.kernels.launch)
        with pytest.raises(CommandError, match=message):
            bench_engine.launch_modes(model, bench_engine.parse_args(bad))
        assert (model.backend.launch, model.kernels.launch) == before
    with pytest.raises(CommandError, match="the cpu backend has no Triton launch configuration"):
        bench_engine.launch_modes(SimpleNamespace(backend=SimpleNamespace(name="cpu"), kernels=None),
                                  bench_engine.parse_args(["--launch", "attn_warps=4"]))
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--launch", "attn_warps=four"])
    assert "'attn_warps=four': expected an int, true, false or none" in capsys.readouterr().err


def test_unknown_run_is_an_error_before_anything_loads(bench_engine, capsys):
    assert bench_engine.main(["--backend", "cpu", "--runs", "plain,spec9", "--tree-sizes", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --runs spec9: no such run with --tree-sizes 8 (choose from plain, ")


def test_profiler_counts_per_step(bench_engine):
    from step_profile import count_events

    def event(name, start, end, device=DeviceType.CPU, **kw):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device, **kw)

    cuda = DeviceType.CUDA
    events = [event("cudaGraphLaunch", 0, 5), event("cuLaunchKernel", 5, 6), event("cuLaunchKernel", 6, 7),
              event("cudaLaunchKernel", 7, 8), event("cudaMemcpyAsync", 8, 9), event("aten::add", 0, 9),
              event("triton_norm", 10, 14, cuda), event("gemv", 14, 30, cuda), event("fill", 30, 32, cuda),
              event("Memcpy DtoH (Device -> Pinned)", 40, 44, cuda),
              event("step", 0, 50, cuda, is_user_annotation=True)]
    got = count_events(events, steps=2)
    assert got["gpu_kernels_per_step"] == 1.5 and got["gpu_copies_per_step"] == 0.5
    assert got["host_launch_calls_per_step"] == 2.0 and got["host_copy_calls_per_step"] == 0.5
    assert got["gpu_busy_ms_per_step"] == pytest.approx(0.011) and got["gpu_copy_ms_per_step"] == pytest.approx(0.002)
    assert got["runtime_calls"] == {"cuLaunchKernel": 2, "cudaGraphLaunch": 1, "cudaLaunchKernel": 1,
                                    "cudaMemcpyAsync": 1}
    assert got["top_kernels"] == [{"name": "gemv", "per_step": 0.5, "us_per_step": 8.0},
                                  {"name": "triton_norm", "per_step": 0.5, "us_per_step": 2.0},
                                  {"name": "fill", "per_step": 0.5, "us_per_step": 1.0}]
    with pytest.raises(ValueError, match="steps: expected at least 1, got 0"):
        count_events(events, steps=0)


@pytest.mark.parametrize("tree_size", [1, 4])
def test_profiled_steps_leave_the_engine_empty(bench_engine, tree_size):
    from step_profile import profile_steps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, tie_word_embeddings=False, eos_token_id=None)
        model = LlamaModel.random(cfg, CpuBackend(), seed=1)
        engine = Engine(model, None, EngineConfig(tree_size=tree_size, num_slots=2048, max_context_len=256))
        prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
        got = profile_steps(engine, prompts, bench_engine.profile_budget(3, tree_size), steps=3)
    finally:
        torch.set_num_threads(threads)
    assert got["decode_steps"] == 3 and got["prefill_steps"] == 0 and got["graph_captures"] is None
    assert got["gpu_kernels_per_step"] == 0 and got["host_launch_calls_per_step"] == 0 and got["wall_ms_per_step"] > 0
    assert not engine.has_unfinished() and engine.sched.slots.available() == 2048
    assert engine.stats.decode_steps >= 6, "three unprofiled steps come first"


def _row(batch, run, tok_s, tree_size=1, invariant=False, copy_tok_s=None, busy=0.0, idle=0.0, tokens=(1, 2)):
    return {"batch": batch, "run": run, "status": "ok", "tree_size": tree_size, "invariant": invariant,
            "totals": {"tokens_per_s": tok_s, "device_busy_s": busy, "device_idle_fraction": idle / (busy + idle or 1)},
            "by_kind": {"copy-heavy": {"tokens_per_s": copy_tok_s}}, "requests": ["a", "b"],
            "token_ids": [[t] for t in tokens]}


def test_targets_from_gpu_shaped_rows(bench_engine):
    configs = bench_engine.run_configs([8, 16])
    rows = [_row(1, "plain", 1200.0, busy=0.95, idle=0.05), _row(1, "plain-nographs-nooverlap", 100.0),
            _row(1, "spec8", 2000.0, 8, copy_tok_s=2400.0, busy=0.8, idle=0.2, tokens=(1, 3)),
            _row(1, "spec16", 2100.0, 16, copy_tok_s=2600.0), _row(1, "auto8", 1150.0, 8),
            _row(1, "spec8-device", 2500.0, 8, copy_tok_s=3100.0, busy=0.95, idle=0.05),
            _row(1, "auto16-device", 2450.0, 16, copy_tok_s=4100.0),
            _row(1, "invariant-plain", 900.0, invariant=True), _row(1, "invariant-spec8", 1800.0, 8, True),
            _row(64, "plain", 21000.0), _row(64, "auto8", 19000.0, 8),
            {"batch": 64, "run": "spec8", "status": "error", "error": "OutOfMemoryError: ...", "tree_size": 8,
             "invariant": False}]
    rows[-2]["vs_plain_paired"] = 0.97  # B=64 auto8: paired with plain passes, 0.90x median against median
    report = {"runs": rows}
    bench_engine.derive(report, configs, [1, 64])
    got = {t["target"]: (t["measured"], t["met"], t["run"]) for t in report["targets"]}
    assert got["plain decode, batch 1 (tok/s)"] == (1200.0, True, "B=1 plain")
    assert got["speculation, copy-heavy prompts, batch 1 (tok/s)"] == (4100.0, True, "B=1 auto16-device")
    assert got["device idle between steps, plain, batch 1 (graphs, overlap)"][:2] == (pytest.approx(0.05), True)
    assert got["device idle between steps, spec8, batch 1 (graphs, overlap)"][:2] == (pytest.approx(0.2), False)
    assert got["device idle between steps, spec8-device, batch 1 (graphs, overlap)"][:2] == (pytest.approx(0.05), True)
    assert got["plain decode, batch 64 (tok/s)"] == (21000.0, True, "B=64 plain")
    assert got["auto8 / plain, batch 1"][:2] == (pytest.approx(1150 / 1200), False)
    assert got["auto8 / best fixed size (spec16), batch 1"][:2] == (pytest.approx(1150 / 2100), False)
    assert got["auto16-device / best fixed size (spec8-device), batch 1"][:2] == (pytest.approx(2450 / 2500), True)
    assert got["auto16-device, copy-heavy prompts, batch 1 (tok/s)"] == (4100.0, True, "B=1 auto16-device")
    assert got["auto8 / best fixed size (-), batch 64"][:2] == (None, None)
    assert got["auto8 / plain, batch 64"] == (0.97, True, "B=64 auto8 (passes paired with plain passes)")
    assert rows[-2]["vs_plain"] == pytest.approx(19000 / 21000)
    assert got["tokens with speculation == without, default mode (requests)"][:2] == ("11/12", False)
    assert got["tokens with speculation == without, invariant mode (requests)"][:2] == ("2/2", True)
    assert rows[2]["same_tokens_as_plain"] == {"same": 1, "of": 2, "differ": ["b"]}
    assert rows[2]["vs_plain"] == pytest.approx(2000 / 1200) and rows[2]["vs_old"] == pytest.approx(20.0)
    assert "vs_plain" not in rows[-1]


def test_reports_keep_lists_of_values_on_one_line(tmp_path, load_bench):
    write_json = load_bench("common").write_json

    report = {"runs": [{"run": "plain", "token_ids": [[1, 2, 3], [4]], "passes": [1.5, 2.0]}], "empty": {}, "none": []}
    path = tmp_path / "r.json"
    write_json(path, report)
    text = path.read_text()
    assert json.loads(text) == report
    assert '"passes": [1.5, 2.0]' in text and "      [1, 2, 3],\n" in text and '"none": []' in text
