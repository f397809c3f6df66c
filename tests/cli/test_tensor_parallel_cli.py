"""``--tp N`` on the command line: N ranks on the CPU (gloo), one that prints, the whole model's
tokens; what cannot split is refused before anything loads."""

from __future__ import annotations

import json
import re

import pytest

from ngram_hal.engine.gguf_loader import find_model_file

from test_cli_errors import run_cli

try:
    find_model_file()
except (FileNotFoundError, OSError) as exc:
    pytest.skip(f"model file not available: {exc}", allow_module_level=True)

PROMPT = ("--prompt", "Repeat exactly: the quick brown fox jumps over the lazy dog.", "--max-new-tokens", "8",
          "--backend", "cpu", "--threads", "1", "--num-slots", "512")


def test_run_over_three_ranks_prints_once_and_decodes_as_one(tmp_path):
    whole, split = tmp_path / "whole.json", tmp_path / "split.json"
    one = run_cli("run", *PROMPT, "--spec-policy", "always", "--json", str(whole))
    assert one.returncode == 0, one.stderr[-3000:]
    three = run_cli("run", *PROMPT, "--tp", "3", "--compare", "--json", str(split), timeout=600)
    assert three.returncode == 0, three.stderr[-3000:]
    assert re.search(r"using the cpu backend on cpu, float32, 1 thread\n.*tensor parallel: 3 ranks over gloo, rank 0 "
                     r"prints\n", three.stderr), three.stderr[-2000:]
    # One rank prints: the summary once, as the last line (or the one before a busy-machine note).
    lines = [line for line in three.stdout.splitlines() if not line.startswith("note: busy machine")]
    assert sum(line.startswith("speedup ") for line in lines) == 1 and lines[-1].startswith("speedup ")
    assert lines[-1].endswith("identical tokens: 1/1")
    report, reference = json.loads(split.read_text()), json.loads(whole.read_text())
    assert report["setup"]["tensor_parallel"] == 3 and reference["setup"]["tensor_parallel"] == 1
    assert report["run"]["config"]["spec_policy"] == "always", "the default under --tp"
    assert report["run"]["requests"][0]["token_ids"] == reference["run"]["requests"][0]["token_ids"]


@pytest.mark.parametrize("args,message", [
    (("--tp", "2"), r"--tp 2: tensor parallelism over 2 ranks: num_kv_heads 3 is not a multiple of 2"),
    (("--tp", "3", "--spec-policy", "auto"), r"--spec-policy auto with --tp 3: each rank would choose tree sizes"),
    (("--tp", "0"), r"--tp: .*0"),
])
def test_what_cannot_split_is_refused_before_anything_loads(args, message):
    done = run_cli("run", *PROMPT, *args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "loading" not in done.stderr


TINY_SHAPE = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 16}
"""Seeded random weights that split over two ranks, with the bundled tokenizer's vocabulary."""


def test_bench_over_two_ranks_runs_every_fixed_policy(tmp_path):
    shape, prompts, out = tmp_path / "tiny.json", tmp_path / "one.jsonl", tmp_path / "bench.json"
    shape.write_text(json.dumps(TINY_SHAPE))
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Count: 1 2 3 4"}]}) + "\n")
    done = run_cli("bench", "--tp", "2", "--backend", "cpu", "--shape", str(shape), "--prompts", str(prompts),
                   "--batch-sizes", "2", "--max-new-tokens", "3", "--threads", "1", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["setup"]["tensor_parallel"] == 2 and data["setup"]["shape"] == "tiny"
    # spec-auto is left out: each rank would choose its own tree sizes.
    assert {(r["run"], r["overlap"]) for r in data["runs"]} == {
        ("plain", True), ("plain", False), ("spec", True), ("spec", False)}
    assert all(r["same_tokens_as_plain"] for r in data["runs"])
