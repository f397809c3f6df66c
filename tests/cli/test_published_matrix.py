"""The published reports under docs/conformance: honestly labelled, merged into the committed
matrix, and a new report (the GPU's cuda run, say) joins the matrix by one documented command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ngram_hal import matrix

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "conformance"
REPORTS = sorted(PUBLISHED.glob("*.json"))


def test_there_is_a_native_reference_report_and_proxy_reports():
    names = [p.name for p in REPORTS]
    assert "cpu-x86_64.json" in names
    assert {"npu-proxy-cpu.json", "rocm-proxy-cpu.json"} <= set(names)


@pytest.mark.parametrize("path", REPORTS, ids=[p.name for p in REPORTS])
def test_file_name_says_backend_and_proxy(path):
    report = matrix.load_report(path)
    backend, _, rest = path.stem.partition("-")
    assert backend == report.backend and rest, f"{path.name}: expected <backend>-<device>.json"
    assert rest.startswith("proxy-") == bool(report.proxy), f"{path.name}: proxy is {report.proxy}"
    assert report.summary.failed == report.summary.errors == 0


def test_committed_matrix_is_the_merge_of_the_reports():
    merged = matrix.merge_files(REPORTS)
    assert (PUBLISHED / "matrix.md").read_text(encoding="utf-8") == matrix.to_markdown(merged), \
        "run `make docs-matrix` after changing a report"
    assert (PUBLISHED / "matrix.html").read_text(encoding="utf-8") == matrix.to_html(merged)
    assert len(merged.columns) == len(REPORTS)
    for column, path in zip(merged.columns, REPORTS):
        assert column.label.startswith(_label(path)), (column.label, path.name)


def _label(path: Path) -> str:
    report = matrix.load_report(path)
    return report.backend + (" (proxy)" if report.proxy else "")


def test_readme_links_the_matrix():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/conformance/matrix.md" in readme and "docs/conformance/matrix.html" in readme


def test_a_new_report_joins_the_matrix_by_make_docs_matrix(tmp_path):
    for path in REPORTS:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    cuda = json.loads((PUBLISHED / "cpu-x86_64.json").read_text())
    cuda.update(backend="cuda", device="cuda:0", device_name="New GPU", proxy=False)
    cuda["hardware"]["name"] = "New GPU"
    (tmp_path / "cuda-newgpu.json").write_text(json.dumps(cuda))
    merged = matrix.merge_files(sorted(tmp_path.glob("*.json")))
    columns, headers = [c.label for c in merged.columns], [matrix.column_header(c) for c in merged.columns]
    # -o: use the environment as it is, never reinstall it from a test.
    run = subprocess.run(["make", "-o", ".venv/.installed", "docs-matrix", f"PUBLISHED={tmp_path}"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    table = (tmp_path / "matrix.md").read_text(encoding="utf-8")
    header = next(line for line in table.splitlines() if line.startswith("| tier |"))
    assert header == "| tier | op | test | " + " | ".join(headers) + " |"
    assert "cuda [New GPU]" in columns
    hardware = matrix.hardware_text(matrix.load_report(tmp_path / "cuda-newgpu.json"))
    assert hardware.startswith("New GPU") and f"| cuda [New GPU] | cuda:0 | {hardware} | no |" in table
    assert "<th>cuda [New GPU]<br>" in (tmp_path / "matrix.html").read_text(encoding="utf-8")
