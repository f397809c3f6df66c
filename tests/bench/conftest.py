"""Fixtures of the benchmark scripts' tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

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
