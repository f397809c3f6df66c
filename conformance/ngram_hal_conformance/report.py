"""Writing the JSON report of a conformance run (schema ``ngram-hal-conformance/1``).

The plugin feeds pytest's per-phase test reports to a :class:`ResultRecorder` and writes a
:class:`~ngram_hal.report_schema.ConformanceReport` at the end of the session with
:func:`build_report` and :func:`write_report`. The models are declared in
:mod:`ngram_hal.report_schema`; :func:`ngram_hal.matrix.load_report` reads a report back. The
schema is documented in the package README.
"""

from __future__ import annotations

import datetime as dt
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ngram_hal.files import write_atomic
from ngram_hal.report_schema import ConformanceReport, Hardware, Outcome, Summary, TestResult, Versions

from . import __version__

PROP_ID = "conformance.id"
PROP_OP = "conformance.op"
PROP_TIER = "conformance.tier"
PROP_STRICT = "conformance.strict"
_OWN_PROPS = (PROP_ID, PROP_OP, PROP_TIER, PROP_STRICT)
_MESSAGE_LIMIT = 2000


def summarize(tests: list[TestResult]) -> Summary:
    """Count outcomes."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "xpassed": 0, "errors": 0}
    for t in tests:
        counts["errors" if t.outcome == "error" else t.outcome] += 1
    return Summary(**counts)


def build_report(backend: str, target: str | None, proxy: bool | None, versions: Versions,
                 device: str | None, strict_modes: list[bool], capabilities: dict[str, Any] | None,
                 tests: list[TestResult], device_name: str | None = None, hardware: Hardware | None = None,
                 scale: str | None = None) -> ConformanceReport:
    """Assemble a report; the summary is counted from ``tests`` and ``created`` is now (UTC).
    ``device_name`` is the hardware behind ``device`` (``"NVIDIA H200"``), ``hardware`` the
    rest of what is known about it; ``scale`` the scale tier's size set."""
    return ConformanceReport(
        backend=backend, target=target, proxy=proxy, versions=versions, device=device, device_name=device_name,
        hardware=hardware, strict_modes=strict_modes, scale=scale, capabilities=capabilities,
        summary=summarize(tests), tests=tests,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(report: ConformanceReport, path: str | Path) -> Path:
    """Write ``report`` as indented JSON, atomically (parent folders created); returns the path.

    Raises:
        ngram_hal.files.WriteError: the file cannot be written (the message names ``path``).
    """
    return write_atomic(path, report.model_dump_json(by_alias=True, indent=2) + "\n")


# ---------------------------------------------------------------- from pytest's reports

class ResultRecorder:
    """Folds pytest's setup/call/teardown reports into one :class:`TestResult` per test.

    Feed it every ``TestReport`` (``pytest_runtest_logreport``) and every failed
    ``CollectReport``. It reads only what travels with a report (nodeid, outcome, longrepr,
    durations, ``user_properties``), so it also works on an xdist controller.
    """

    def __init__(self):
        self._results: dict[str, TestResult] = {}

    def add(self, report) -> None:
        if report.when == "collect":
            if report.failed:
                self._results[report.nodeid] = TestResult(
                    id=report.nodeid or "<collection>", outcome="error", message=_failure_message(report))
            return
        props = dict(report.user_properties)
        key = report.nodeid
        result = self._results.get(key)
        if result is None:
            result = self._results[key] = TestResult(
                id=props.get(PROP_ID, report.nodeid), op=props.get(PROP_OP), tier=props.get(PROP_TIER),
                strict=props.get(PROP_STRICT), outcome="passed")
        result.properties.update({k: v for k, v in props.items() if k not in _OWN_PROPS})
        result.duration_s = round(result.duration_s + report.duration, 6)
        outcome, message = _phase_outcome(report)
        if report.when == "teardown":
            if outcome == "error" and result.outcome == "passed":
                result.outcome, result.message = "error", message
            return
        if outcome != "passed" or report.when == "call":
            result.outcome, result.message = outcome, message

    def results(self) -> list[TestResult]:
        return list(self._results.values())


def _phase_outcome(report) -> tuple[Outcome, str | None]:
    xfail = getattr(report, "wasxfail", None)
    if report.skipped:
        if xfail is not None:
            return "xfailed", _clip(xfail) or None
        return "skipped", _skip_reason(report)
    if report.passed:
        if xfail is not None and report.when == "call":
            return "xpassed", _clip(xfail) or None
        return "passed", None
    if report.when == "call":
        return "failed", _failure_message(report)
    return "error", _failure_message(report)


def _skip_reason(report) -> str | None:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return _clip(str(longrepr[2]).removeprefix("Skipped: "))
    return _clip(str(longrepr)) if longrepr else None


def _failure_message(report) -> str | None:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return _clip(crash.message)
    return _clip(str(report.longrepr)) if report.longrepr else None


def _clip(text: str) -> str:
    return text if len(text) <= _MESSAGE_LIMIT else text[:_MESSAGE_LIMIT] + "..."


# ---------------------------------------------------------------- versions

def collect_versions(backend_package: str | None, device: str | None) -> Versions:
    """Versions of ngram-hal, this suite, the backend's package, torch, Triton and the driver."""
    return Versions(ngram_hal=_dist_version("ngram-hal"), ngram_hal_conformance=__version__,
                    backend_package=backend_package, torch=torch.__version__,
                    triton=next(filter(None, map(_dist_version, ("triton", "pytorch-triton-rocm",
                                                                 "pytorch-triton"))), None),
                    driver=driver_version(device) if device is not None else None)


def driver_version(device: str) -> str | None:
    """The kernel driver of ``device``'s vendor (``"nvidia 550.54.15"``, ``"amdgpu 6.8.5"``,
    ``"ascend 24.1"``), read from files the driver exposes; None on the CPU or when unknown."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.version.hip:
        found = _read_match("/sys/module/amdgpu/version", r"(\S+)")
        return f"amdgpu {found}" if found else None
    if kind == "cuda":
        found = _read_match("/proc/driver/nvidia/version", r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)")
        return f"nvidia {found}" if found else None
    if kind == "npu":
        found = _read_match("/usr/local/Ascend/driver/version.info", r"Version=(\S+)")
        return f"ascend {found}" if found else None
    return None


def _read_match(path: str, pattern: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    match = re.search(pattern, text)
    return match.group(1) if match else None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
