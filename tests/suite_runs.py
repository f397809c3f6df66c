"""Running the conformance suite from a test: in this process, as a vendor's CI would from an
empty folder, with the JSON report read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def run_suite(tmp_path: Path, monkeypatch, backend: str, *args: str,
              modules: tuple[str, ...] = ("ngram_hal_conformance",)) -> tuple[int, dict | None]:
    """``pytest --pyargs MODULES --backend BACKEND ARGS`` from ``tmp_path``, with ``tests/`` on the
    path (so ``--backend mutants:<Class>`` resolves); returns (exit code, JSON report or None).
    ``--max-examples 5`` comes first, so a later one in ``args`` wins."""
    report = tmp_path / f"report-{backend.replace(':', '-')}.json"
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.chdir(tmp_path)
    rc = pytest.main(["--pyargs", *modules, "-q", "-p", "no:cacheprovider", "--backend", backend,
                      "--max-examples", "5", "--report-json", str(report), *args])
    return int(rc), json.loads(report.read_text()) if report.exists() else None


def outcomes(report: dict) -> dict[str, str]:
    """Test id -> outcome."""
    return {t["id"]: t["outcome"] for t in report["tests"]}


def failed(report: dict) -> set[str]:
    """Ids of the tests that failed or errored."""
    return {i for i, o in outcomes(report).items() if o in ("failed", "error")}


def failures(report: dict) -> str:
    """One line per failed or errored test: its id and message."""
    return "\n".join(f"{t['id']}: {t['message']}" for t in report["tests"] if t["outcome"] in ("failed", "error"))
