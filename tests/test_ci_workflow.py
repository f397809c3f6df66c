"""The cross-platform CI workflow: actionlint (a real GitHub Actions linter, from the test extras)
passes on it, and it has the shape the matrix needs: one job per backend, each uploading its JSON
and JUnit report, hosted runners for cpu and the proxies, self-hosted ones by label for the
vendors, and a final job merging every report with ``ngram-hal matrix``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "conformance.yml"
CONFIG = ROOT / ".github" / "actionlint.yaml"
HOSTED = {"cpu": "test-conformance", "proxy-cuda": "test-proxy-cuda", "proxy-rocm": "test-proxy-rocm",
          "proxy-npu": "test-proxy-npu"}
SELF_HOSTED = {"cuda": "gpu-nvidia", "rocm": "gpu-amd", "npu": "ascend-npu"}


def actionlint() -> str:
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")
    assert found, "actionlint is not installed: pip install -e '.[test]' (it is in the test extras)"
    return found


def lint(repo: Path, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", "-config-file", str(repo / ".github" / "actionlint.yaml"),
                           *map(str, files)], cwd=repo, capture_output=True, text=True)


def test_actionlint_passes_on_every_workflow():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert WORKFLOW in workflows
    result = lint(ROOT, *workflows)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_an_unknown_runner_label_and_variable(tmp_path):
    """The lint above can fail: a misspelt self-hosted label or repository variable is an error."""
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    shutil.copy(CONFIG, tmp_path / ".github" / "actionlint.yaml")
    text = WORKFLOW.read_text().replace("gpu-amd]", "gpu-amdd]").replace(
        "vars.CONFORMANCE_SELF_HOSTED, 'npu'", "vars.CONFORMANCE_SELFHOSTED, 'npu'")
    broken = tmp_path / ".github" / "workflows" / "conformance.yml"
    broken.write_text(text)
    result = lint(tmp_path, broken)
    assert result.returncode == 1
    assert 'label "gpu-amdd" is unknown' in result.stdout
    assert 'undefined configuration variable "conformance_selfhosted"' in result.stdout


@pytest.fixture(scope="module")
def jobs() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def _runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def _uploads(job: dict) -> str:
    steps = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(steps) == 1, f"expected one upload step, got {len(steps)}"
    assert steps[0]["with"]["if-no-files-found"] == "error"
    return steps[0]["with"]["path"]


@pytest.mark.parametrize("name, target", sorted(HOSTED.items()))
def test_hosted_jobs_run_their_make_target_and_upload_both_reports(jobs, name, target):
    job = jobs[name]
    assert job["runs-on"].startswith("ubuntu-")
    assert f"make {target}" in _runs(job)
    path = _uploads(job)
    report = "conformance-cpu" if name == "cpu" else f"conformance-{name.removeprefix('proxy-')}-proxy"
    assert path == f"reports/{report}.*"
    recipe = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert f"--json reports/{report}.json" in recipe.stdout and f"--junit reports/{report}.xml" in recipe.stdout


@pytest.mark.parametrize("name, label", sorted(SELF_HOSTED.items()))
def test_vendor_jobs_run_on_labelled_self_hosted_runners(jobs, name, label):
    job = jobs[name]
    assert job["runs-on"][0] == "self-hosted" and label in job["runs-on"]
    assert f"contains(vars.CONFORMANCE_SELF_HOSTED, '{name}')" in job["if"]
    assert f"--backend {name}" in _runs(job)
    for suffix in ("json", "xml"):
        assert f"reports/conformance-{name}.{suffix}" in _runs(job)
    assert f"reports/conformance-{name}.*" in _uploads(job)


def test_rocm_proxy_also_runs_on_the_nvidia_runner(jobs):
    steps = [s for s in jobs["cuda"]["steps"] if "--backend rocm" in s.get("run", "")]
    assert len(steps) == 1 and steps[0]["env"] == {"NGRAM_HAL_ROCM_PROXY": "1"}
    assert "reports/conformance-rocm-proxy-gpu.*" in _uploads(jobs["cuda"])


def test_matrix_job_merges_every_report(jobs):
    job = jobs["matrix"]
    assert set(job["needs"]) == set(HOSTED) | set(SELF_HOSTED)
    assert job["if"] == "${{ !cancelled() }}"
    download = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/download-artifact@"))
    assert download["with"] == {"pattern": "conformance-*", "path": "reports", "merge-multiple": True}
    assert "ngram-hal matrix reports/conformance-*.json" in _runs(job)
    assert "reports/matrix.html" in _uploads(job)


def test_the_portability_workflow_runs_the_unit_tests_under_every_float_setting():
    """One job per setting that changes the CPU's floating-point results, each running the unit
    tests, and the same settings as ``make test-portability``."""
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "portability.yml").read_text())
    job = workflow["jobs"]["unit"]
    settings = job["strategy"]["matrix"]["setting"]
    assert set(settings) == {"OMP_NUM_THREADS=1", "OMP_NUM_THREADS=2", "ATEN_CPU_CAPABILITY=default",
                             "ATEN_CPU_CAPABILITY=avx2"}
    assert any("make test-unit" in step.get("run", "") for step in job["steps"])
    makefile = (ROOT / "Makefile").read_text()
    assert f"PORTABILITY_SETTINGS := {' '.join(settings)}" in makefile
