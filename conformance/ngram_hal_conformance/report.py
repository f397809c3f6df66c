"""The JSON report of a conformance run (schema ``ngram-hal-conformance/1``).

The plugin feeds pytest's per-phase test reports to a :class:`ResultRecorder` and writes a
:class:`ConformanceReport` at the end of the session. :func:`load_report` and
:func:`write_report` are what other tools (the CLI, the matrix) reuse. The schema is documented
in the package README.
"""

from __future__ import annotations

import datetime as dt
import re
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import REPORT_SCHEMA, __version__

Outcome = Literal["passed", "failed", "skipped", "xfailed", "xpassed", "error"]

PROP_ID = "conformance.id"
PROP_OP = "conformance.op"
PROP_TIER = "conformance.tier"
PROP_STRICT = "conformance.strict"
_OWN_PROPS = (PROP_ID, PROP_OP, PROP_TIER, PROP_STRICT)
_MESSAGE_LIMIT = 2000


class TestResult(BaseModel):
    """One test: its stable id, what it covers, and how it ended."""

    __test__ = False  # not a pytest test class

    id: str
    op: str | None = None
    tier: str | None = None
    strict: bool | None = None
    outcome: Outcome
    duration_s: float = 0.0
    message: str | None = None
    properties: dict[str, Any] = {}


class Summary(BaseModel):
    """Counts of outcomes; ``errors`` counts setup/teardown and collection errors."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    xpassed: int = 0
    errors: int = 0


class Versions(BaseModel):
    """Versions of everything that decides the result; None when unknown or absent."""

    ngram_hal: str | None
    ngram_hal_conformance: str
    backend_package: str | None
    torch: str
    triton: str | None
    driver: str | None


class Hardware(BaseModel):
    """The device a run used (``ngram_hal.runtime.Runtime.hardware``); None where unknown."""

    name: str | None = None
    architecture: str | None = None
    memory_bytes: int | None = None
    multiprocessors: int | None = None
    runtime: str | None = None


class Sanitizer(BaseModel):
    """A run under NVIDIA's compute-sanitizer: the tool, the errors it counted (its ``ERROR
    SUMMARY``; None when it printed none, e.g. it did not start), its version and the first lines
    of its error reports."""

    tool: str
    errors: int | None
    version: str | None = None
    exit_code: int
    first_errors: list[str] = []


class ConformanceReport(BaseModel):
    """A whole run against one backend."""

    model_config = ConfigDict(populate_by_name=True)

    schema_: str = Field(REPORT_SCHEMA, alias="schema")
    backend: str
    target: str | None
    proxy: bool | None
    versions: Versions
    device: str | None
    device_name: str | None = None
    hardware: Hardware | None = None
    strict_modes: list[bool]
    scale: str | None = None
    sanitizer: Sanitizer | None = None
    capabilities: dict[str, Any] | None
    summary: Summary
    tests: list[TestResult]
    created: str


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
    from ngram_hal.files import write_atomic  # here: importing ngram_hal imports torch

    return write_atomic(path, report.model_dump_json(by_alias=True, indent=2) + "\n")


def load_report(path: str | Path) -> ConformanceReport:
    """Read and validate a report; ``ValueError`` when it is not schema ``ngram-hal-conformance/1``."""
    report = ConformanceReport.model_validate_json(Path(path).read_text())
    if report.schema_ != REPORT_SCHEMA:
        raise ValueError(f"{path}: schema '{report.schema_}', expected '{REPORT_SCHEMA}'")
    return report


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
    import torch  # here, not at module level: the plugin imports this module in every pytest run

    return Versions(ngram_hal=_dist_version("ngram-hal"), ngram_hal_conformance=__version__,
                    backend_package=backend_package, torch=torch.__version__,
                    triton=next(filter(None, map(_dist_version, ("triton", "pytorch-triton-rocm",
                                                                 "pytorch-triton"))), None),
                    driver=driver_version(device) if device is not None else None)


def driver_version(device: str) -> str | None:
    """The kernel driver of ``device``'s vendor (``"nvidia 550.54.15"``, ``"amdgpu 6.8.5"``,
    ``"ascend 24.1"``), read from files the driver exposes; None on the CPU or when unknown."""
    import torch

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
