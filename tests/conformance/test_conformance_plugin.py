"""The conformance plugin as a vendor meets it: the reference passes, an xfails file turns known
failures into xfailed/xpassed, a partial backend's missing ops are skipped, ``--max-examples``
reaches the property tests, an unknown backend is a usage error, the plugin loads with ``-p`` in
a fresh interpreter, and a third-party backend registered by entry point alone runs.

Runs go through ``pytest.main`` in this process (one, the plugin loaded with ``-p`` and autoload
off, in a fresh interpreter) and assert on the JSON report. Test doubles come from
``tests/mutants.py`` (``--backend mutants:<Class>``); ``tests/conformance/test_mutants.py`` checks that the
suite catches each planted fault.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from suite_runs import TESTS, failed, failures, outcomes, run_suite

from ngram_hal import matrix, report_schema
from ngram_hal.reference import CpuBackend
from ngram_hal.registry import get_backend, list_backends
from ngram_hal_conformance import plugin
from ngram_hal_conformance import report as writer

TOY = TESTS / "thirdparty"
MODES = ("strict-on", "strict-off")


def both_modes(test_id: str) -> set[str]:
    name, _, params = test_id.partition("[")
    return {f"{name}[{mode}-{params}" if params else f"{name}[{mode}]" for mode in MODES}


OWN_MODULES = tuple(f"ngram_hal_conformance.test_{m}" for m in ("registration", "contract", "alloc", "kv"))


def test_reference_backend_passes(tmp_path, monkeypatch):
    # The registration module and those of the allocation, cache-location and KV ops (`make
    # test` runs the whole suite on cpu), in strict mode only: it runs every test the default
    # mode runs plus the value checks; the other runs here use strict=False.
    rc, report = run_suite(tmp_path, monkeypatch, "cpu", "--strict-mode", "on", modules=OWN_MODULES)
    assert rc == 0, failures(report)
    assert report["schema"] == "ngram-hal-conformance/1" and report["backend"] == "cpu"
    assert report["summary"]["failed"] == report["summary"]["errors"] == 0
    assert not [t["id"] for t in report["tests"] if "not implemented" in (t["message"] or "")]
    assert report["summary"]["passed"] > 150
    assert {"registration", "contract", "semantics"} <= {t["tier"] for t in report["tests"]}
    assert report["strict_modes"] == [True] and {t["strict"] for t in report["tests"]} == {True}
    assert report["versions"]["backend_package"].startswith("ngram-hal==")
    assert report["capabilities"]["name"] == "cpu" and report["proxy"] is False
    assert report["device"] == "cpu" and report["device_name"] == CpuBackend().runtime.device_name != ""
    hardware = report["hardware"]
    assert hardware["name"] == report["device_name"] and hardware["memory_bytes"] > 2**30
    assert hardware["multiprocessors"] == os.cpu_count() and hardware["runtime"] is None
    assert report["scale"] == "reduced" and report["sanitizer"] is None


def test_tiers_option_runs_only_those_tiers(tmp_path, monkeypatch):
    rc, report = run_suite(tmp_path, monkeypatch, "cpu", "--strict-mode", "off", "--tiers", "edge",
                           modules=("ngram_hal_conformance.test_edge", "ngram_hal_conformance.test_kv"))
    assert rc == pytest.ExitCode.OK, failures(report)
    assert {t["tier"] for t in report["tests"]} == {"edge"} and len(report["tests"]) >= 10


def test_unknown_tier_is_a_usage_error(tmp_path, monkeypatch, capsys):
    rc, _ = run_suite(tmp_path, monkeypatch, "cpu", "--tiers", "contract,speed")
    assert rc == pytest.ExitCode.USAGE_ERROR
    assert "--tiers 'contract,speed': speed is not one of registration" in capsys.readouterr().err


@pytest.mark.parametrize("scale", ["reduced", "full"])
def test_scale_option_picks_the_sizes(tmp_path, monkeypatch, scale):
    rc, report = run_suite(tmp_path, monkeypatch, "cpu", "--strict-mode", "off", "--scale", scale, "-k",
                           "test_move_kv_at_scale and 16384 and cycle", modules=("ngram_hal_conformance.test_scale",))
    assert rc == pytest.ExitCode.OK, failures(report)
    (test,) = report["tests"]
    assert report["scale"] == scale
    assert test["outcome"] == ("passed" if scale == "full" else "skipped")


def test_xfails_file_marks_known_failures(tmp_path, monkeypatch):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("# known: int32 slot ids\n"
                      "test_alloc.py::test_alloc_extend_matches   # every strict mode\n"
                      "test_contract.py::test_outputs[strict-off-alloc_extend]\n"
                      "test_registration.py::test_op_present[strict-off-alloc_extend]  # passes: xpassed\n")
    rc, report = run_suite(tmp_path, monkeypatch, "mutants:AllocInt32Slots", "--xfails-file", str(xfails), "-k",
                           "alloc_extend and (outputs or op_present or matches or partial_page_first)")
    assert rc == pytest.ExitCode.TESTS_FAILED
    got = outcomes(report)
    assert failed(report) == (both_modes("test_alloc.py::test_alloc_extend_fills_partial_page_first")
                              | {"test_contract.py::test_outputs[strict-on-alloc_extend]",
                                 "test_registration.py::test_op_present[strict-on-alloc_extend]"})
    assert got["test_contract.py::test_outputs[strict-off-alloc_extend]"] == "xfailed"
    assert all(got[i] == "xfailed" for i in both_modes("test_alloc.py::test_alloc_extend_matches"))
    # Strict mode checks outputs at run time: the ContractError names the op and the output.
    message = next(t["message"] for t in report["tests"]
                   if t["id"] == "test_registration.py::test_op_present[strict-on-alloc_extend]")
    assert "alloc_extend: output 'slots'" in message and "torch.int32" in message
    assert got["test_registration.py::test_op_present[strict-off-alloc_extend]"] == "xpassed"
    assert report["summary"]["xfailed"] == 3 and report["summary"]["xpassed"] == 1
    assert matrix.load_report(tmp_path / "report-mutants-AllocInt32Slots.json").summary.failed == 4


def test_the_matrix_reads_the_report_through_the_models_the_plugin_writes_it_with(tmp_path, monkeypatch):
    """One declaration of the schema: the writer, the plugin and the matrix share
    ``ngram_hal.report_schema``, and a report read back by the matrix dumps to the very bytes written."""
    for name in ("ConformanceReport", "TestResult", "Summary", "Versions", "Hardware"):
        assert getattr(writer, name) is getattr(report_schema, name), name
    assert matrix.ConformanceReport is report_schema.ConformanceReport and matrix.TestResult is report_schema.TestResult
    assert plugin.TIERS is matrix.TIERS is report_schema.TIERS
    rc, _ = run_suite(tmp_path, monkeypatch, "cpu", "--strict-mode", "off", "-k", "op_present and alloc_extend",
                      modules=("ngram_hal_conformance.test_registration",))
    assert rc == pytest.ExitCode.OK
    path = tmp_path / "report-cpu.json"
    read = matrix.load_report(path)
    assert type(read) is report_schema.ConformanceReport and read.tests
    assert read.model_dump_json(by_alias=True, indent=2) + "\n" == path.read_text()


def test_honest_partial_backend_is_skipped_not_failed(tmp_path, monkeypatch):
    rc, report = run_suite(tmp_path, monkeypatch, "mutants:HonestPartialBackend", "-k", "move_kv",
                           "--strict-mode", "off")
    assert rc == pytest.ExitCode.OK, failures(report)
    assert outcomes(report)["test_registration.py::test_op_present[strict-off-move_kv]"] == "passed"
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    assert skipped and all(t["message"] == "op 'move_kv' is not implemented by backend 'partial-no-move'"
                           for t in skipped)
    assert report["strict_modes"] == [False] and "move_kv" not in report["capabilities"]["ops"]


def test_max_examples_reaches_property_tests(tmp_path, monkeypatch, capsys):
    rc, _ = run_suite(tmp_path, monkeypatch, "cpu", "--strict-mode", "off", "--max-examples", "3",
                      "-k", "test_alloc_extend_matches", "--hypothesis-show-statistics")
    assert rc == pytest.ExitCode.OK
    assert re.search(r"settings\.max_examples=3\b", capsys.readouterr().out)


def test_unknown_backend_is_a_usage_error(tmp_path, monkeypatch, capsys):
    rc, _ = run_suite(tmp_path, monkeypatch, "no-such-backend")
    assert rc == pytest.ExitCode.USAGE_ERROR
    assert "no backend named 'no-such-backend'" in capsys.readouterr().err


def test_plugin_by_dash_p_in_a_fresh_process(tmp_path):
    """A vendor's CI view: a new interpreter, plugin autoload off, the plugin named with -p."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ngram_hal_conformance.plugin", "--pyargs",
         "ngram_hal_conformance.test_registration", "-q", "-p", "no:cacheprovider", "--backend", "cpu",
         "--report-json", str(report)],
        cwd=tmp_path, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["summary"]["passed"] == len(data["tests"]) > 0


# ---------------------------------------------------------------- a third-party backend

def register_distribution(project: Path, site: Path) -> str:
    """Make ``project`` (a pyproject.toml package) discoverable the way an install does: write its
    ``<name>-<version>.dist-info`` (METADATA, entry_points.txt, top_level.txt) into ``site``,
    which goes on the path next to the project's source folder. Returns the distribution name."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    lines = []
    for group, entries in meta.get("entry-points", {}).items():
        lines += [f"[{group}]"] + [f"{name} = {target}" for name, target in entries.items()] + [""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    packages = sorted(p.name for p in project.iterdir() if (p / "__init__.py").exists())
    (info / "top_level.txt").write_text("\n".join(packages) + "\n")
    return meta["name"]


def test_thirdparty_backend_by_entry_point(tmp_path, monkeypatch):
    site = tmp_path / "site"
    dist = register_distribution(TOY, site)
    monkeypatch.syspath_prepend(str(TOY))
    monkeypatch.syspath_prepend(str(site))
    info = {i.name: i for i in list_backends()}
    assert info["toy"].package == dist and info["toy"].version == "0.1.0" and info["toy"].available
    assert info["toy"].ops == ["assign_req_to_token", "gather_cache_locs", "store_kv", "move_kv"]
    assert get_backend("toy").capabilities().name == "toy"

    rc, report = run_suite(tmp_path, monkeypatch, "toy", "--strict-mode", "off")
    assert rc == pytest.ExitCode.OK, failures(report)
    assert report["versions"]["backend_package"] == "ngram-hal-toy==0.1.0"
    assert report["target"] == "ngram_hal_toy:ToyBackend"
    got = outcomes(report)
    assert got["test_kv.py::test_move_kv_matches[strict-off]"] == "passed"
    assert got["test_contract.py::test_dtype_rejected[strict-off-store_kv-locs-int32]"] == "passed"
    assert got["test_registration.py::test_op_present[strict-off-alloc_extend]"] == "passed"
    assert got["test_alloc.py::test_alloc_extend_matches[strict-off]"] == "skipped"
    reasons = {t["message"] for t in report["tests"] if t["outcome"] == "skipped" and t["op"] == "attention"}
    assert reasons == {"op 'attention' is not implemented by backend 'toy'"}


def test_sanitizer_log_gives_the_error_count_and_the_first_reports(tmp_path):
    from ngram_hal.cli import sanitizer

    log = tmp_path / "sanitizer.log"
    log.write_text("========= COMPUTE-SANITIZER\n"
                   "========= Invalid __global__ write of size 8 bytes\n"
                   "=========     at move_kv_kernel+0x1d0\n"
                   "=========\n"
                   "========= ERROR SUMMARY: 1 error\n")
    assert sanitizer.read_log(log) == (1, ["Invalid __global__ write of size 8 bytes", "at move_kv_kernel+0x1d0"])
    log.write_text("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    assert sanitizer.read_log(log) == (0, [])
    log.write_text("========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    assert sanitizer.read_log(log) == (0, [])
    log.write_text("========= Error: Race reported between Write access at move_kv_kernel+0x90\n"
                   "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert sanitizer.read_log(log) == (1, ["Error: Race reported between Write access at move_kv_kernel+0x90"])
    assert sanitizer.read_log(tmp_path / "missing.log") == (None, [])
