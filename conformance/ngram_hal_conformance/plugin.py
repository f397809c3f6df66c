"""The pytest plugin: options, the ``conformance`` marker, fixtures and the JSON report.

Loaded through the ``pytest11`` entry point (or ``-p ngram_hal_conformance.plugin``). It stays
inert for tests that carry no ``conformance`` marker, so it is harmless in other test runs.

Options (stable; the ``ngram-hal conformance`` command passes them through):
    --backend NAME|module:Class   backend under test (default ``cpu``)
    --device DEVICE               device to create it on (default: the backend's default)
    --strict-mode {both,on,off}   run every test with strict=True and/or strict=False
    --xfails-file FILE            test ids expected to fail (one a line, ``#`` comments)
    --max-examples N              hypothesis examples per property test (default 25)
    --report-json PATH            write the JSON report
    --scale {auto,reduced,full}   sizes of the scale tier (default auto: full on an accelerator,
                                  reduced on the CPU, where Triton kernels run interpreted)
    --tiers TIER[,TIER...]        run only the tests of these tiers (default: every tier)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from ngram_hal.report_schema import TIERS

from .report import PROP_ID, PROP_OP, PROP_STRICT, PROP_TIER, ResultRecorder

MARKER = "conformance"
STRICT_MODES = {"both": (True, False), "on": (True,), "off": (False,)}
SCALE_SETS = ("auto", "reduced", "full")
DEFAULT_MAX_EXAMPLES = 25
_PACKAGE_DIR = Path(__file__).resolve().parent
_SUITE_KEY = pytest.StashKey["Suite"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ngram-hal-conformance")
    group.addoption("--backend", default="cpu", metavar="NAME",
                    help="backend under test: a name registered under 'ngram_hal.backends', or "
                         "module:Class (default: cpu)")
    group.addoption("--device", default=None, metavar="DEVICE",
                    help="torch device for the backend (default: the backend's own default)")
    group.addoption("--strict-mode", choices=sorted(STRICT_MODES), default="both",
                    help="run each test against strict=True ('on'), strict=False ('off') or both "
                         "(default: both)")
    group.addoption("--xfails-file", default=None, metavar="FILE",
                    help="file of test ids expected to fail, one a line, '#' starts a comment")
    group.addoption("--max-examples", type=int, default=DEFAULT_MAX_EXAMPLES, metavar="N",
                    help=f"hypothesis examples per property test (default: {DEFAULT_MAX_EXAMPLES})")
    group.addoption("--report-json", default=None, metavar="PATH",
                    help="write the conformance report (schema ngram-hal-conformance/1) here")
    group.addoption("--scale", choices=SCALE_SETS, default="auto",
                    help="sizes of the scale tier: 'full', 'reduced' (every tile boundary, smaller "
                         "maxima) or 'auto' (full on an accelerator, reduced on the CPU; default)")
    group.addoption("--tiers", default=None, metavar="TIER[,TIER...]",
                    help=f"run only these tiers (of {', '.join(TIERS)}); the others are deselected")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(op, tier): an ngram-hal conformance test of op (a name from "
                   f"ngram_hal.backend.OPS, a list of them, or None) at tier (one of {', '.join(TIERS)})")
    if config.getoption("max_examples") < 1:
        raise pytest.UsageError("--max-examples must be >= 1")
    config.stash[_SUITE_KEY] = Suite(config)
    path = config.getoption("report_json")
    if path:
        from ngram_hal.files import WriteError, check_writable

        try:
            check_writable(path)
        except WriteError as exc:
            raise pytest.UsageError(f"--report-json {exc}") from None
        config.pluginmanager.register(ReportWriter(config, path), "ngram_hal_conformance.report_writer")


class Suite:
    """The backend under test, resolved once, on first need."""

    def __init__(self, config: pytest.Config):
        self.spec: str = config.getoption("backend")
        self.device_option: str | None = config.getoption("device")
        self.strict_modes: tuple[bool, ...] = STRICT_MODES[config.getoption("strict_mode")]
        self.max_examples: int = config.getoption("max_examples")
        self.scale_option: str = config.getoption("scale")
        self.tiers: tuple[str, ...] | None = _tiers(config)
        self._target = None
        self._probe = None

    @property
    def scale(self) -> str:
        """The scale tier's size set that runs: ``"full"`` or ``"reduced"``."""
        if self.scale_option != "auto":
            return self.scale_option
        return "reduced" if self.probe.runtime.is_host else "full"

    @property
    def target(self):
        if self._target is None:
            from ngram_hal.registry import resolve

            try:
                self._target = resolve(self.spec)
            except (LookupError, RuntimeError) as exc:
                raise pytest.UsageError(f"ngram-hal conformance: {exc}") from exc
        return self._target

    def make(self, strict: bool):
        """A fresh instance of the backend under test."""
        return self.target.cls(device=self.device_option, strict=strict)

    @property
    def probe(self):
        """One instance, to read capabilities and the device from."""
        if self._probe is None:
            target = self.target
            try:
                self._probe = self.make(strict=False)
            except Exception as exc:  # e.g. a device that does not exist here
                raise pytest.UsageError(f"ngram-hal conformance: cannot create backend '{target.spec}' on "
                                        f"device {self.device_option or target.cls.default_device}: "
                                        f"{type(exc).__name__}: {exc}") from exc
        return self._probe


def _tiers(config: pytest.Config) -> tuple[str, ...] | None:
    """The tiers ``--tiers`` names (None: every tier); a usage error names an unknown one."""
    value = config.getoption("tiers")
    if value is None:
        return None
    names = tuple(t.strip() for t in value.split(",") if t.strip())
    unknown = [t for t in names if t not in TIERS]
    if unknown or not names:
        raise pytest.UsageError(f"--tiers {value!r}: {unknown[0] if unknown else 'no tier'} is not one of "
                                f"{', '.join(TIERS)}")
    return names


def _meta(item: pytest.Item) -> tuple[object, str | None] | None:
    """(op, tier) from the item's conformance markers, the closest one winning per field."""
    marks = list(item.iter_markers(MARKER))
    if not marks:
        return None
    op = next((m.kwargs["op"] for m in marks if "op" in m.kwargs), None)
    tier = next((m.kwargs["tier"] for m in marks if "tier" in m.kwargs), None)
    return op, tier


def _ops(op) -> tuple[str, ...]:
    if op is None:
        return ()
    return (op,) if isinstance(op, str) else tuple(op)


def stable_id(item: pytest.Item) -> str:
    """The test id used in reports and xfails files: the path inside this package (or the
    nodeid for tests elsewhere) and the test name with its parameters, independent of rootdir."""
    try:
        rel = Path(item.path).resolve().relative_to(_PACKAGE_DIR).as_posix()
    except ValueError:
        return item.nodeid
    return rel + "::" + item.nodeid.split("::", 1)[1]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_strict" not in metafunc.fixturenames:
        return
    modes = metafunc.config.stash[_SUITE_KEY].strict_modes
    metafunc.parametrize("conformance_strict", modes, indirect=True, scope="session",
                         ids=["strict-on" if m else "strict-off" for m in modes])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    from ngram_hal.backend import OPS

    marked = []
    for item in items:
        meta = _meta(item)
        if meta is not None:
            marked.append((item, meta))
        elif _inside_package(item):
            raise pytest.UsageError(f"{item.nodeid}: every conformance test needs "
                                    f"@pytest.mark.{MARKER}(op=..., tier=...)")
    tiers = config.stash[_SUITE_KEY].tiers
    if tiers is not None:
        kept = [(item, meta) for item, meta in marked if meta[1] in tiers]
        dropped = [item for item, meta in marked if meta[1] not in tiers]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            gone = set(dropped)
            items[:] = [item for item in items if item not in gone]
        marked = kept
    if not marked:
        return
    suite = config.stash[_SUITE_KEY]
    capabilities = suite.probe.capabilities()
    xfails = _read_xfails(config.getoption("xfails_file"))
    matched: set[str] = set()
    for item, (op, tier) in marked:
        ops = _ops(op)
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tier {tier!r} is not one of {', '.join(TIERS)}")
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: op {unknown[0]!r} is not in ngram_hal.backend.OPS")
        sid = stable_id(item)
        callspec = getattr(item, "callspec", None)
        strict = callspec.params.get("conformance_strict") if callspec is not None else None
        props = [(PROP_ID, sid), (PROP_OP, ",".join(ops) or None), (PROP_TIER, tier), (PROP_STRICT, strict)]
        item.user_properties.extend((name, value) for name, value in props if value is not None)
        missing = [o for o in ops if o not in capabilities.ops]
        if missing and tier != "registration":
            item.add_marker(pytest.mark.skip(
                reason=f"op '{missing[0]}' is not implemented by backend '{capabilities.name}'"))
        base = sid.split("[", 1)[0]
        for key in (sid, base):
            if key in xfails:
                matched.add(key)
                item.add_marker(pytest.mark.xfail(strict=False, reason=f"listed in {xfails[key]}"))
                break
        _apply_hypothesis_settings(item, suite.max_examples)
    for key in sorted(set(xfails) - matched):
        warnings.warn(pytest.PytestWarning(f"{xfails[key]}: '{key}' matches no collected test"))


def _inside_package(item: pytest.Item) -> bool:
    try:
        Path(item.path).resolve().relative_to(_PACKAGE_DIR)
    except ValueError:
        return False
    return True


def _read_xfails(path: str | None) -> dict[str, str]:
    """``{test id: "FILE:LINE"}`` from an xfails file."""
    if not path:
        return {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise pytest.UsageError(f"--xfails-file: {exc}") from exc
    found = {}
    for number, line in enumerate(lines, 1):
        test_id = line.split("#", 1)[0].strip()
        if test_id:
            found[test_id] = f"{path}:{number}"
    return found


def _apply_hypothesis_settings(item: pytest.Item, max_examples: int) -> None:
    """Give a property test ``--max-examples`` and no deadline (timings on shared or emulated
    hardware are noise), keeping its other settings. Hypothesis fixes a test's settings when it
    is decorated, so they are replaced on the decorated test, as ``@settings`` itself does."""
    from hypothesis import HealthCheck, is_hypothesis_test, settings

    fn = getattr(item, "obj", None)
    fn = getattr(fn, "__func__", fn)
    if fn is None or not is_hypothesis_test(fn):
        return
    current = getattr(fn, "_hypothesis_internal_use_settings", None)
    checks = set(current.suppress_health_check if current is not None else ()) | {HealthCheck.too_slow}
    fn._hypothesis_internal_use_settings = settings(current, max_examples=max_examples, deadline=None,
                                                    suppress_health_check=sorted(checks, key=lambda c: c.value))


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def conformance_strict(request: pytest.FixtureRequest) -> bool:
    """The strict mode of this test's backend instance (parametrized by --strict-mode)."""
    return getattr(request, "param", request.config.stash[_SUITE_KEY].strict_modes[0])


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest, conformance_strict: bool):
    """The backend instance under test (one per strict mode)."""
    return request.config.stash[_SUITE_KEY].make(strict=conformance_strict)


@pytest.fixture(scope="session")
def unchecked_backend(request: pytest.FixtureRequest):
    """The backend under test with ``strict=False``, whatever ``--strict-mode`` says: what the
    performance tier times (strict value checks read data, a host sync per op)."""
    return request.config.stash[_SUITE_KEY].make(strict=False)


@pytest.fixture(scope="session")
def scale(request: pytest.FixtureRequest) -> str:
    """The scale tier's size set: ``"full"`` or ``"reduced"`` (``--scale``)."""
    return request.config.stash[_SUITE_KEY].scale


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    """The torch device the backend under test runs on."""
    return request.config.stash[_SUITE_KEY].probe.device


@pytest.fixture(scope="session")
def reference(device):
    """The reference ``cpu`` backend on the same device: the oracle (strict=False)."""
    from ngram_hal.reference import CpuBackend

    return CpuBackend(device=device, strict=False)


# ---------------------------------------------------------------- report

class ReportWriter:
    """Collects every test's outcome and writes the JSON report when the session ends.

    The report replaces the file atomically. When it cannot be written, one ``error:`` line on
    stderr names the path, and a session that had passed exits with pytest's internal-error code.
    """

    def __init__(self, config: pytest.Config, path: str):
        self.config = config
        self.path = path
        self.recorder = ResultRecorder()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorder.add(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.recorder.add(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from ngram_hal.files import WriteError
        from ngram_hal.report_schema import Hardware

        from .report import build_report, collect_versions, write_report

        suite = self.config.stash[_SUITE_KEY]
        target = capabilities = device_name = hardware = scale = None
        try:
            target = suite.target
            capabilities = suite.probe.capabilities()
            device_name = suite.probe.runtime.device_name
            hardware = Hardware(**suite.probe.runtime.hardware())
            scale = suite.scale
        except pytest.UsageError:
            pass
        report = build_report(
            backend=suite.spec, target=target.target if target else None,
            proxy=capabilities.proxy if capabilities else None,
            versions=collect_versions(target.package if target else None,
                                      capabilities.device if capabilities else None),
            device=capabilities.device if capabilities else None,
            strict_modes=list(suite.strict_modes),
            capabilities=capabilities.model_dump() if capabilities else None,
            tests=self.recorder.results(), device_name=device_name, hardware=hardware, scale=scale)
        try:
            write_report(report, self.path)
        except WriteError as exc:
            sys.stderr.write(f"error: --report-json {exc}\n")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
