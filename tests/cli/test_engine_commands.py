"""``ngram-hal run`` and ``ngram-hal bench`` end to end on the real model, with tiny budgets."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ngram_hal.cli import main
from ngram_hal.cli import CommandError
from ngram_hal.cli.checks import busy_note, choose_threads, kv_cache_slots, reference_note
from ngram_hal.cli.engine_args import DEFAULT_NUM_SLOTS
from ngram_hal.cli.run import summary_line
from ngram_hal.engine.shapes import PRESETS, kv_bytes, parameter_bytes
from ngram_hal.engine.gguf_loader import find_model_file
from ngram_hal.engine.workload import (PromptSpec, RequestRecord, RunResult, RunTotals, bundled_prompts,
                                       cap_new_tokens, load_prompts)

from test_cli_errors import run_cli

try:
    find_model_file()
except (FileNotFoundError, OSError) as exc:
    pytest.skip(f"model file not available: {exc}", allow_module_level=True)


def test_bundled_prompts_are_valid():
    specs = load_prompts(bundled_prompts())
    kinds = {s.kind for s in specs}
    assert kinds == {"copy", "open"}
    assert all(s.messages and s.messages[-1]["role"] == "user" for s in specs)
    code = next(s for s in specs if s.id == "code-rename").messages[0]["content"]
    assert code.count("\n") > 40


def test_load_prompts_reports_the_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"max_new_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 2: messages: field required"):
        load_prompts(path)
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 0}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 1: max_new_tokens: input should be greater than or equal to 1"):
        load_prompts(path)


def test_max_new_tokens_caps_every_prompt():
    specs = [PromptSpec(messages=[{"role": "user", "content": "a"}], max_new_tokens=n) for n in (256, 40, None)]
    assert [s.max_new_tokens for s in cap_new_tokens(specs, 64)] == [64, 40, 64]


def test_threads_follow_the_load_average():
    assert choose_threads(None, 2, 2, 0.2) == (2, None)
    n, note = choose_threads(None, 2, 2, 3.4)
    assert n == 1 and "load average at 3.4 on 2 cores" in note and "--threads 2" in note
    assert choose_threads(None, 16, 16, 4.0)[0] == 12
    assert choose_threads(2, 2, 2, 9.0) == (2, None)
    assert busy_note(1.9, 2) is None
    assert busy_note(2.5, 2) == "note: busy machine (load average 2.5 on 2 cores): timings are unreliable"


def test_the_reference_on_another_device_is_named_with_what_was_passed_over(monkeypatch):
    """``--backend auto`` that falls to the cpu reference on a device other than the CPU says so
    (a user missing the vendor package would otherwise see reference speed and no reason)."""
    import argparse

    from ngram_hal.reference import CpuBackend
    from ngram_hal.registry import ENV_BACKEND

    monkeypatch.delenv(ENV_BACKEND, raising=False)
    auto, named = argparse.Namespace(backend="auto"), argparse.Namespace(backend="cpu")
    note = reference_note(auto, CpuBackend(device="meta"))
    assert note.startswith("the cpu reference backend runs on meta, at the reference's speed; passed over: npu: ")
    assert "cuda: " in note
    assert reference_note(auto, CpuBackend()) is None
    assert reference_note(named, CpuBackend(device="meta")) is None
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    assert reference_note(auto, CpuBackend(device="meta")) is None


def result(tokens: list[list[int]], wall: float, steps: int) -> RunResult:
    records = [RequestRecord(id=f"r{i}", kind="copy", prompt_tokens=5, text="", token_ids=ids, verify_steps=steps,
                             finish_reason="length", error=None) for i, ids in enumerate(tokens)]
    totals = RunTotals.from_counts(
        requests=len(tokens), output_tokens=sum(len(ids) for ids in tokens),
        decode_tokens=sum(len(ids) - 1 for ids in tokens), verify_steps=steps * len(tokens), wall_s=wall,
        decode_s=0.9 * wall, prefill_steps=1, decode_steps=steps, tree_nodes=steps, launch_s=0.0, wait_s=0.0,
        hidden_host_s=0.0, critical_host_s=0.0, draft_s=0.0, device_busy_s=0.0, device_idle_s=0.0,
        prefill_s=0.0)
    return RunResult(config={}, requests=records, totals=totals)


def test_run_totals_add_up_over_runs():
    one = result([[1, 2, 3, 4, 5]], wall=1.0, steps=2).totals
    two = result([[1, 2, 3], [4, 5, 6]], wall=3.0, steps=2).totals
    both = RunTotals.combine([one, two])
    assert (both.requests, both.output_tokens, both.decode_tokens, both.verify_steps) == (3, 11, 8, 6)
    assert both.wall_s == 4.0 and both.decode_s == pytest.approx(3.6) and both.decode_steps == 4
    assert both.tokens_per_s == 11 / 4.0 and both.decode_tokens_per_s == pytest.approx(8 / 3.6)
    assert both.tokens_per_verify_step == 8 / 6 and both.ms_per_decode_step == 1e3
    assert both.device_idle_fraction == 0.0, "no device timing: no idle fraction"


def test_summary_line_names_the_requests_that_differ():
    spec = result([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], wall=1.0, steps=2)
    plain = result([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]], wall=2.0, steps=4)
    same = [a.token_ids == b.token_ids for a, b in zip(spec.requests, plain.requests)]
    assert summary_line(spec, plain, same, greedy=True, invariant=True) == (
        "speedup 2.00x (10.0 vs 5.0 tok/s), 2.00 tok/verify step, identical tokens: 1/2 (differ: r1)")
    assert summary_line(spec, plain, same, greedy=True).endswith(
        "(differ: r1; these numerics round a row by the rows beside it: --batch-invariant keeps them all)")
    assert summary_line(spec, plain, same, greedy=False).endswith("(differ: r1; expected when sampling)")
    assert summary_line(spec, None, None, greedy=True) == "10 tokens in 1.0 s (10.0 tok/s), 2.00 tok/verify step"


def test_summary_line_fits_80_columns_at_gpu_rates():
    fast = result([list(range(4000))], wall=1.0, steps=1000)
    plain = result([list(range(4000))], wall=3.7, steps=3999)
    line = summary_line(fast, plain, [True], greedy=True)
    assert line == "speedup 3.70x (4000 vs 1081 tok/s), 4.00 tok/verify step, identical tokens: 1/1"
    assert len(line) <= 80


@pytest.mark.parametrize("flag,says", [("--batch-invariant", "batch-invariant"),
                                       ("--no-batch-invariant", "not batch-invariant")])
def test_run_says_which_numerics_ran(flag, says):
    done = run_cli("run", "--prompt", "Say hello twice: hello hello", "--max-new-tokens", "3", flag,
                   "--threads", "1", "--num-slots", "512")
    assert done.returncode == 0, done.stderr[-3000:]
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    assert re.search(rf"using the \S+ backend on \S+, {dtype}, {says}, 1 thread\n", done.stderr), \
        done.stderr[-2000:]


def test_run_compare_as_a_user_runs_it(tmp_path):
    out = tmp_path / "run.json"
    done = run_cli("run", "--prompt", "Say hello twice: hello hello", "--max-new-tokens", "6", "--compare",
                   "--threads", "1", "--num-slots", "512", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    # What it is doing, on stderr: the load, the kernels, one labelled bar per run that ends full.
    where = (r"cuda backend on cuda(:\d)?, bfloat16, batch-invariant" if torch.cuda.is_available()
             else r"cpu backend on cpu, float32")
    # In a pipe (as here) plain time-stamped lines: the load, the one-time work before the timed
    # region, and each run's tokens done against its total, ending full.
    assert re.search(r"loaded \S+\.gguf in [\d.]+ s\n", done.stderr), done.stderr[-2000:]
    assert re.search(rf"using the {where}, 1 thread\n", done.stderr), done.stderr[-2000:]
    assert re.search(r"one-time work done in [\d.]+ s, not timed", done.stderr), done.stderr[-2000:]
    ends = {m.group(1) for m in re.finditer(r"(speculative|plain) (\d+)/\2( tokens)? \(done\)", done.stderr)}
    assert ends == {"speculative", "plain"}, done.stderr[-2000:]
    # The answer, on stdout, as its last line (or the one before a busy-machine note), in 80 columns.
    lines = done.stdout.splitlines()
    if lines[-1].startswith("note: busy machine"):
        lines.pop()
    assert re.fullmatch(r"speedup \d+\.\d\dx \([\d.]+ vs [\d.]+ tok/s\), [\d.]+ tok/verify step, "
                        r"identical tokens: 1/1", lines[-1])
    assert all(len(line) <= 80 for line in lines) and "…" not in done.stdout
    report = json.loads(out.read_text())
    req = report["run"]["requests"][0]
    assert len(req["token_ids"]) == 6 or req["finish_reason"] == "stop"
    assert req["verify_steps"] >= 1 and isinstance(req["text"], str)
    assert report["same_tokens"] == [True]
    assert report["run"]["totals"]["output_tokens"] == len(req["token_ids"])
    backend = "cuda" if torch.cuda.is_available() else "cpu"
    assert report["setup"]["backend"] == backend and report["setup"]["threads"] == 1 and report["peak_rss_bytes"] > 0


def test_bench_command_tables_fit_80_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    bench = tmp_path / "bench.json"
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Count: 1 2 3 4"}]}) + "\n")
    assert main(["bench", "--prompts", str(prompts), "--batch-sizes", "2", "--max-new-tokens", "3",
                 "--threads", "1", "--num-slots", "512", "--json", str(bench)]) == 0
    data = json.loads(bench.read_text())
    assert {(r["batch"], r["run"], r["overlap"]) for r in data["runs"]} == {
        (2, name, ov) for name, ov in (("plain", True), ("plain", False), ("spec", True), ("spec", False),
                                       ("spec-auto", True))}
    assert all(r["same_tokens_as_plain"] for r in data["runs"])
    assert data["kv_cache_bytes"]["2"] > 0 and data["peak_rss_bytes"] > 0
    printed = capsys.readouterr().out
    assert "spec-auto" in printed and "overlap" in printed
    assert all(len(line) <= 80 for line in printed.splitlines()) and "…" not in printed


TINY_SHAPE = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 16}
"""A shape whose vocabulary holds the bundled tokenizer's ids, small enough for a CPU test."""


def test_bench_shape_runs_random_weights_of_that_shape(tmp_path):
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps(TINY_SHAPE))
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Count: 1 2 3 4"}]}) + "\n")
    bench = tmp_path / "bench.json"
    assert main(["bench", "--backend", "cpu", "--shape", str(shape), "--prompts", str(prompts), "--batch-sizes", "1",
                 "--max-new-tokens", "3", "--threads", "1", "--json", str(bench)]) == 0
    data = json.loads(bench.read_text())
    assert data["setup"]["shape"] == "tiny" and data["setup"]["num_slots"] == DEFAULT_NUM_SLOTS
    assert data["shape"]["config"] | TINY_SHAPE == data["shape"]["config"]
    from ngram_hal.engine.config import LlamaConfig

    assert data["shape"]["parameter_bytes"] == parameter_bytes(LlamaConfig(**TINY_SHAPE), torch.float32)
    assert data["shape"]["copy_bandwidth_bytes_per_s"] is None, "no weight-streaming limit on the host"
    assert all("limit_tokens_per_s" not in r for r in data["runs"])
    assert all(r["same_tokens_as_plain"] for r in data["runs"])


def test_a_shape_smaller_than_the_tokenizer_is_refused(tmp_path, capsys):
    shape = tmp_path / "small.json"
    shape.write_text(json.dumps(TINY_SHAPE | {"vocab_size": 1000}))
    assert main(["bench", "--backend", "cpu", "--shape", str(shape), "--batch-sizes", "1"]) == 2
    assert re.search(r"--shape small: vocab_size 1000 is smaller than the model file's tokenizer \(49152 tokens\)",
                     capsys.readouterr().err)


def test_kv_cache_slots_from_the_free_memory():
    import argparse

    config, dtype = PRESETS["llama-8b"], torch.bfloat16
    weights, per_slot = parameter_bytes(config, dtype), kv_bytes(config, dtype, 0)
    free = weights + 10_000 * per_slot
    args = argparse.Namespace(num_slots=None, kv_fraction=1.0, device="cuda")
    assert kv_cache_slots(args, "llama-8b", config, dtype, free) == 10_000 - 1  # the scratch slot's row
    args.kv_fraction = 0.5
    assert kv_cache_slots(args, "llama-8b", config, dtype, 2 * weights) == int(0.5 * weights) // per_slot - 1
    with pytest.raises(CommandError, match=r"--kv-fraction 0.5: llama-8b's 16.06 GB of weights leave no room"):
        kv_cache_slots(args, "llama-8b", config, dtype, weights)
    args = argparse.Namespace(num_slots=None, kv_fraction=None)
    assert kv_cache_slots(args, "llama-8b", config, dtype, None) == DEFAULT_NUM_SLOTS
    assert kv_cache_slots(args, "llama-8b", config, dtype, 2 * weights) == DEFAULT_NUM_SLOTS
    args.num_slots = 20_000
    with pytest.raises(CommandError, match=r"--num-slots 20000: shape llama-8b: 16.06 GB of bfloat16 weights and "
                                           r"2.62 GB of KV cache \(20000 slots\) need more than"):
        kv_cache_slots(args, "llama-8b", config, dtype, free)


def test_defaults_follow_the_device():
    from ngram_hal.cli.engine_args import CPU_TREE_SIZE, GPU_TREE_SIZE
    from ngram_hal.cli.setup import default_drafter, default_tree_size
    from ngram_hal.reference import CpuBackend

    host = CpuBackend()
    assert (default_drafter(host), default_tree_size(host)) == ("trie", CPU_TREE_SIZE)
    if torch.cuda.is_available():
        gpu = CpuBackend(device="cuda")
        assert (default_drafter(gpu), default_tree_size(gpu)) == ("device", GPU_TREE_SIZE)
