"""The vendor guide's example backend (``examples/ngram-hal-numpy``): installed by itself with pip,
found through its entry point alone, and passing the conformance suite run as a vendor runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngram_hal import OPS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ngram-hal-numpy"
BIN = Path(sys.executable).parent
IMPLEMENTED = [op for op in OPS if op not in ("verify_tree_sample", "attention")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees the example installed (into a folder of its own)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def test_listed_through_its_entry_point(installed):
    out = subprocess.run([str(BIN / "ngram-hal"), "backends", "--json"], env=installed, check=True,
                         capture_output=True, text=True).stdout
    info = {row["name"]: row for row in json.loads(out)}
    numpy = info["numpy"]
    assert (numpy["package"], numpy["version"], numpy["available"]) == ("ngram-hal-numpy", "0.1.0", True)
    assert numpy["target"] == "ngram_hal_numpy:NumpyBackend" and numpy["ops"] == IMPLEMENTED
    assert list(info)[:4] == ["npu", "rocm", "cuda", "cpu"]


def test_passes_the_conformance_suite(installed, tmp_path):
    report_path = tmp_path / "numpy.json"
    run = subprocess.run([str(BIN / "ngram-hal"), "conformance", "--backend", "numpy", "--json", str(report_path),
                          "--junit", str(tmp_path / "numpy.xml")], env=installed, cwd=tmp_path,
                         capture_output=True, text=True)
    report = json.loads(report_path.read_text())
    failed = [f"{t['id']}: {t['message']}" for t in report["tests"] if t["outcome"] in ("failed", "error")]
    assert run.returncode == 0 and not failed, "\n".join(failed) or run.stdout[-3000:]
    assert report["versions"]["backend_package"] == "ngram-hal-numpy==0.1.0"
    assert report["proxy"] is False and report["capabilities"]["ops"] == IMPLEMENTED
    passed_ops = {op for t in report["tests"] if t["outcome"] == "passed" for op in (t["op"] or "").split(",")}
    assert set(IMPLEMENTED) <= passed_ops
    # The int64 tests that need a cache past 2**31 elements per layer run only on an accelerator,
    # the scale tier's full set too; the edge tier skips the KV dtypes the backend does not list.
    expected = ("a cache past 2**31 elements", "the backend lists KV dtypes")
    skipped = {t["message"] for t in report["tests"] if t["outcome"] == "skipped"
               and not t["message"].startswith(expected)
               and not t["message"].endswith("scale set (--scale full runs it)")}
    assert skipped <= {"op 'verify_tree_sample' is not implemented by backend 'numpy'",
                       "op 'attention' is not implemented by backend 'numpy'",
                       "value checks run only with strict=True", "value checks run only in strict mode",
                       "backend 'numpy' does not claim batch invariance on cpu"}
