"""Fixtures of the benchmark scripts' tests."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from ngram_hal.engine.gguf_loader import find_model_file

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def load_bench(monkeypatch):
    """``load_bench(name)``: the script ``bench/<name>.py`` imported afresh, with ``bench/`` on the
    path and none of the bench modules (``common``, ...) cached from another test."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str):
        for module in {name, *(p.stem for p in BENCH.glob("*.py"))}:
            monkeypatch.delitem(sys.modules, module, raising=False)
        return importlib.import_module(name)

    return load


@pytest.fixture
def model_file() -> Path:
    """The bundled model file; the test is skipped where it is not installed."""
    try:
        return find_model_file()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"model file not available: {exc}")


@pytest.fixture
def two_prompts(tmp_path) -> Path:
    """A prompts file of a copy-heavy prompt ("echo") and an open-ended one ("sky")."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"id": "echo", "kind": "copy", "messages": [{"role": "user", "content": "Repeat: red blue red blue red"}]},
        {"id": "sky", "kind": "open", "messages": [{"role": "user", "content": "Why?"}]})))
    return path
