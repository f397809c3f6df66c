"""``ngram-hal run`` and ``ngram-hal bench`` end to end on the real model, with tiny budgets."""

from __future__ import annotations

import json

import pytest

from ngram_hal.cli import main
from ngram_hal.engine.gguf_loader import find_model_file
from ngram_hal.engine.workload import bundled_prompts, load_prompts

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
    with pytest.raises(ValueError, match="p.jsonl:2"):
        load_prompts(path)


def test_run_and_bench_commands(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["run", "--prompt", "Say hello twice: hello hello", "--max-new-tokens", "6", "--compare",
                 "--threads", "1", "--num-slots", "512", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    req = report["run"]["requests"][0]
    assert len(req["token_ids"]) == 6 or req["finish_reason"] == "stop"
    assert req["verify_steps"] >= 1 and isinstance(req["text"], str)
    assert report["same_tokens"] == [True]
    assert report["run"]["totals"]["output_tokens"] == len(req["token_ids"])
    assert report["setup"]["backend"] == "cpu" and report["peak_rss_bytes"] > 0
    printed = capsys.readouterr().out
    assert "summary" in printed and "tok/s" in printed

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
