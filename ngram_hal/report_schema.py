"""The conformance report (schema ``ngram-hal-conformance/1``), declared once.

The conformance suite (``ngram_hal_conformance``) writes a :class:`ConformanceReport` at the end
of a run; :mod:`ngram_hal.matrix` and ``ngram-hal conformance`` read it. Both sides use these
models, and the core declares them because the core never imports the suite. The JSON is the
models' dump by alias (``schema_`` is written ``schema``), documented field by field in the suite's
README. Fields may be added within a schema version, with defaults so that older reports still
load; readers ignore fields they do not know. A change to an existing field's meaning bumps
:data:`REPORT_SCHEMA`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

REPORT_SCHEMA = "ngram-hal-conformance/1"
"""The ``schema`` field of every report of this layout."""

TIERS: tuple[str, ...] = ("registration", "contract", "semantics", "scale", "edge", "model", "engine", "collectives",
                          "performance")
"""The conformance tiers, in the order a backend usually clears them."""

Outcome = Literal["passed", "failed", "skipped", "xfailed", "xpassed", "error"]
"""How a test ended; ``error`` is a failure outside the test's call (setup, teardown, collection)."""


class TestResult(BaseModel):
    """One test of a run."""

    __test__ = False  # not a pytest test class

    id: str
    """The stable test id: the path inside the suite and the parameters (a collection error has
    the collector's node id)."""
    op: str | None = None
    """The op covered (a name from ``ngram_hal.backend.OPS``), several joined with ``,``, or None."""
    tier: str | None = None
    """One of :data:`TIERS`, or None for a collection error."""
    strict: bool | None = None
    """The strict mode of the backend instance, or None when the test uses none."""
    outcome: Outcome
    duration_s: float = 0.0
    """Setup + call + teardown, seconds."""
    message: str | None = None
    """The first line of the failure, the skip reason or the xfail reason; None on a pass."""
    properties: dict[str, Any] = {}
    """Figures the test recorded with ``record_property``; the performance tier records
    ``workload`` (the sizes, in words), ``eager_ms``, ``graph_ms`` or ``graph_error``, and for
    attention ``layout_ms``."""


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
    """``dist==version`` of the distribution that provides the backend; None when it comes from
    no installed distribution."""
    torch: str
    triton: str | None
    driver: str | None
    """The kernel driver: ``nvidia <ver>``, ``amdgpu <ver>`` or ``ascend <ver>``; None on the CPU
    or when unknown."""


class Hardware(BaseModel):
    """The device a run used (``ngram_hal.runtime.Runtime.hardware``); None where unknown."""

    name: str | None = None
    """The processor or accelerator (``NVIDIA H200``)."""
    architecture: str | None = None
    """``sm_90`` for CUDA, the ``gcnArchName`` on ROCm, the machine type on the CPU."""
    memory_bytes: int | None = None
    """Device memory; the host's on the CPU."""
    multiprocessors: int | None = None
    """SMs or compute units; logical CPUs on the CPU."""
    runtime: str | None = None
    """``cuda 13.0``, ``hip 6.2``; None on the CPU."""


class Sanitizer(BaseModel):
    """A run under NVIDIA's compute-sanitizer."""

    tool: str
    """``memcheck``, ``racecheck``, ..."""
    errors: int | None
    """The errors of its ``ERROR SUMMARY``; None when it printed none (e.g. it did not start)."""
    version: str | None = None
    exit_code: int
    first_errors: list[str] = []
    """The first lines of its error reports."""


class ConformanceReport(BaseModel):
    """A whole run of the suite against one backend."""

    model_config = ConfigDict(populate_by_name=True)

    schema_: str = Field(REPORT_SCHEMA, alias="schema")
    """The layout of the report: :data:`REPORT_SCHEMA`."""
    backend: str
    """The ``--backend`` value."""
    target: str | None
    """``module:Class`` of the backend class; None if it could not be loaded."""
    proxy: bool | None
    """``capabilities().proxy``: true when the run checks semantics on a stand-in device, not the
    vendor's hardware; None if the backend could not be created."""
    versions: Versions
    device: str | None
    """The device the backend ran on."""
    device_name: str | None = None
    """The processor or accelerator behind ``device`` (``NVIDIA H200``)."""
    hardware: Hardware | None = None
    strict_modes: list[bool]
    """The strict modes that ran."""
    scale: str | None = None
    """The scale tier's size set that ran: ``full`` or ``reduced``."""
    sanitizer: Sanitizer | None = None
    """None, or the sanitizer the run was under."""
    capabilities: dict[str, Any] | None
    """``capabilities().model_dump()``; None if the backend could not be created."""
    summary: Summary
    tests: list[TestResult]
    created: str
    """When the report was written, ISO 8601, UTC."""
