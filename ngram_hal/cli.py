"""The ``ngram-hal`` command line.

``ngram-hal backends``     registered backends, their availability and why not
``ngram-hal conformance``  run the conformance suite on one backend (JUnit + JSON report)
``ngram-hal matrix``       merge conformance JSON reports into one backend x test matrix
``ngram-hal run|bench``    the engine's commands, registered when ``ngram_hal.engine.commands`` exists

Every command reports a bad option, input file or environment the same way: ``error: ...`` on
one line naming what was wrong and what is allowed, a non-zero exit code (2 for a bad option or
input, 1 otherwise) and no traceback; ``--debug`` or ``NGRAM_HAL_DEBUG=1`` shows the traceback
as well, with the same exit code. Report destinations are checked before anything runs, and
reports are written atomically (:mod:`ngram_hal.files`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import matrix
from .backend import OPS
from .files import WriteError, check_writable, write_atomic
from .options import POSITIVE_INT
from .registry import list_backends

CONFORMANCE_PACKAGE = "ngram_hal_conformance"
CONFORMANCE_PLUGIN = "ngram_hal_conformance.plugin"
ENGINE_COMMANDS = "ngram_hal.engine.commands"
DEBUG_ENV = "NGRAM_HAL_DEBUG"


class CommandError(Exception):
    """What a command reports as ``error: <message>``, exiting with ``code`` (2: a bad option or
    input file; 1: anything else). The message names the option or file and what is allowed."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse in the command's one error style: ``error: ...`` on one line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def check_destination(option: str, path: str | None) -> None:
    """A :class:`CommandError` (exit code 2) naming ``option`` and ``path`` when a report could not
    be written there; nothing when ``path`` is None. Made before the run the report is of."""
    if path is not None:
        try:
            check_writable(path)
        except WriteError as exc:
            raise CommandError(f"{option} {exc}") from exc


def write_output(option: str, path: str, data: str | bytes) -> None:
    """Write the report ``data`` to ``path`` atomically; a :class:`CommandError` (exit code 1)
    naming ``option`` and ``path`` when it cannot be written."""
    try:
        write_atomic(path, data)
    except WriteError as exc:
        raise CommandError(f"{option} {exc}", code=1) from exc


def _yes_no(flag: bool | None) -> Text:
    if flag is None:
        return Text("-", style="dim")
    return Text("yes", style="green") if flag else Text("no", style="red")


def backends_command(args: argparse.Namespace) -> int:
    """List every registered backend: package, version, availability, proxy, ops, and why not."""
    infos = list_backends()
    if args.json:
        print(json.dumps([info.model_dump() for info in infos], indent=2))
        return 0
    table = Table(title="ngram-hal backends")
    for column in ("name", "package", "version", "available", "proxy", "ops"):
        table.add_column(column, no_wrap=True)
    for info in infos:
        table.add_row(info.name, info.package or "?", info.version or "?", _yes_no(info.available),
                      "-" if info.proxy is None else ("yes" if info.proxy else "no"), f"{len(info.ops)}/{len(OPS)}")
    console = Console()
    console.print(table)
    # Reasons are sentences: printed under the table, each wraps at the terminal's width.
    for info in infos:
        if info.reason:
            console.print(Text.assemble((f"{info.name}: ", "bold"), info.reason))
    return 0


def _conformance_summary(report: matrix.Report, console: Console) -> None:
    tiers = sorted({t.tier or "" for t in report.tests}, key=lambda t: matrix.sort_key(t, matrix.TIERS))
    counts = {tier: Counter(t.outcome for t in report.tests if (t.tier or "") == tier) for tier in tiers}
    title = f"conformance: {report.backend} on {report.device or '?'}" + (" (proxy)" if report.proxy else "")
    table = Table(title=title)
    table.add_column("tier")
    for outcome in matrix.OUTCOMES:
        table.add_column(outcome, justify="right")
    total: Counter = Counter()
    for tier in tiers:
        total.update(counts[tier])
        table.add_row(tier or "(none)", *(str(counts[tier][o]) for o in matrix.OUTCOMES))
    table.add_row(Text("total", style="bold"), *(Text(str(total[o]), style="bold") for o in matrix.OUTCOMES))
    console.print(table)
    for t in report.tests:
        if t.outcome in ("failed", "error"):
            console.print(Text(f"{t.outcome.upper()} {t.id}: {matrix.first_line(t.message)}", style="red"))


def _check_conformance_target(args: argparse.Namespace) -> None:
    """The checks the suite's plugin makes, made first, so that a bad ``--backend``, ``--device`` or
    ``--xfails`` is one line instead of an empty run."""
    from ngram_hal_conformance.target import resolve

    try:
        target = resolve(args.backend)
    except (LookupError, RuntimeError) as exc:
        raise CommandError(f"--backend {args.backend}: {exc}") from exc
    if args.device:
        try:
            target.cls(device=args.device, strict=False)
        except Exception as exc:  # any failure to create the backend there
            raise CommandError(f"--device {args.device}: cannot create backend '{args.backend}' there: "
                               f"{type(exc).__name__}: {error_line(exc)}") from exc
    if args.xfails and not Path(args.xfails).is_file():
        raise CommandError(f"--xfails {args.xfails}: no such file")


def conformance_command(args: argparse.Namespace) -> int:
    """Run the conformance suite on ``--backend`` through pytest; returns pytest's exit code.

    pytest writes the JSON report and the JUnit XML into a temporary folder; they replace
    ``--json`` and ``--junit`` (each atomically) after the run, so a run that produces no usable
    report leaves what was there before.
    """
    if importlib.util.find_spec(CONFORMANCE_PACKAGE) is None:
        raise CommandError("the conformance suite is not installed: pip install -e conformance", code=4)
    _check_conformance_target(args)
    check_destination("--json", args.json)
    check_destination("--junit", args.junit)
    import pytest

    with tempfile.TemporaryDirectory() as tmp:
        report_path, junit_path = Path(tmp) / "conformance.json", Path(tmp) / "junit.xml"
        argv = ["--pyargs", CONFORMANCE_PACKAGE, "--backend", args.backend, "--strict-mode", args.strict_mode,
                "--report-json", str(report_path)]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            argv += ["-p", CONFORMANCE_PLUGIN]
        if args.device:
            argv += ["--device", args.device]
        if args.xfails:
            argv += ["--xfails-file", args.xfails]
        if args.junit:
            argv += ["--junitxml", str(junit_path)]
        if args.max_examples is not None:
            argv += ["--max-examples", str(args.max_examples)]
        if args.k:
            argv += ["-k", args.k]
        code = int(pytest.main(argv))
        try:
            report = matrix.load_report(report_path)
        except ValueError as exc:
            kept = [f"{option} {path}" for option, path in (("--json", args.json), ("--junit", args.junit)) if path]
            print(f"error: no usable conformance report (pytest exit code {code}): {exc}"
                  + (f"; {' and '.join(kept)} left as they were" if kept else ""), file=sys.stderr)
            return code or 1
        outputs = [("--json", args.json, report_path), ("--junit", args.junit, junit_path)]
        for option, path, written in outputs:
            if path and written.is_file():
                write_output(option, path, written.read_bytes())
                print(f"wrote {path}", file=sys.stderr)
        if report.tests:
            _conformance_summary(report, Console())
        else:
            print(f"error: no conformance test ran (pytest exit code {code})", file=sys.stderr)
    return code


def matrix_command(args: argparse.Namespace) -> int:
    """Merge conformance reports; write markdown/HTML, or print markdown when neither is asked."""
    outputs = [(option, path, render) for option, path, render in
               (("--markdown", args.markdown, matrix.to_markdown), ("--html", args.html, matrix.to_html)) if path]
    for option, path, _ in outputs:
        check_destination(option, path)
    try:
        merged = matrix.merge_files(args.reports)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    console = Console(stderr=True)
    for option, path, render in outputs:
        write_output(option, path, render(merged))
        console.print(f"wrote {path}", highlight=False, markup=False)
    if not outputs:
        sys.stdout.write(matrix.to_markdown(merged))
    table = Table(title=f"matrix: {len(merged.rows)} tests x {len(merged.columns)} backends")
    table.add_column("backend")
    table.add_column("tests")
    for column in merged.columns:
        table.add_row(column.label, matrix.summary_text(column.counts(merged.test_ids)))
    console.print(table)
    return 0


def _engine_commands() -> ModuleType | None:
    """``ngram_hal.engine.commands`` when it exists, else None."""
    try:
        spec = importlib.util.find_spec(ENGINE_COMMANDS)
    except ModuleNotFoundError:
        return None
    return None if spec is None else importlib.import_module(ENGINE_COMMANDS)


def error_line(exc: BaseException) -> str:
    """The first line of an exception's message (a KeyError's without its quotes)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return matrix.first_line(text) or type(exc).__name__


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    """The ``ngram-hal`` parser; each subcommand sets ``func(args) -> int``."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=f"show the traceback of an error (also {DEBUG_ENV}=1)")
    parser = Parser(prog="ngram-hal", parents=[debug],
                    description="N-gram speculative decoding on any accelerator, through one HAL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("backends", parents=[debug], help="list registered backends and whether they can run here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=backends_command)

    p = sub.add_parser("conformance", parents=[debug], help="run the conformance suite on one backend")
    p.add_argument("--backend", required=True, help="registered backend name (see `ngram-hal backends`)")
    p.add_argument("--device", help="torch device to create the backend on (default: the backend's default)")
    p.add_argument("--xfails", metavar="FILE", help="expected failures: one test id a line, '#' comments")
    p.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (schema ngram-hal-conformance/1)")
    p.add_argument("--strict-mode", choices=("both", "on", "off"), default="both",
                   help="test strict=True instances, strict=False ones, or both (default)")
    p.add_argument("--max-examples", type=POSITIVE_INT, metavar="N", help="hypothesis examples per property test")
    p.add_argument("-k", metavar="EXPR", help="only tests matching this pytest -k expression")
    p.set_defaults(func=conformance_command)

    p = sub.add_parser("matrix", parents=[debug], help="merge conformance JSON reports into one backend x test matrix")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--markdown", metavar="PATH", help="write the matrix as markdown")
    p.add_argument("--html", metavar="PATH", help="write the matrix as a self-contained HTML page")
    p.set_defaults(func=matrix_command)

    engine = _engine_commands()
    if engine is not None:
        p = sub.add_parser("run", parents=[debug], help="generate text with the engine")
        engine.add_run_arguments(p)
        p.set_defaults(func=engine.run_command)
        p = sub.add_parser("bench", parents=[debug], help="benchmark the engine")
        engine.add_bench_arguments(p)
        p.set_defaults(func=engine.bench_command)
    return parser


def report_errors(func, args: argparse.Namespace) -> int:
    """``func(args)``'s exit code, or an error reported in the command's style: ``error: ...`` on
    one line on stderr and the code of the :class:`CommandError` (130 when interrupted, 1 for
    anything else). With ``args.debug`` or ``NGRAM_HAL_DEBUG=1`` the traceback comes before that
    line; the exit code is the same."""
    debug = getattr(args, "debug", False) or env_flag(DEBUG_ENV)
    try:
        return int(func(args))
    except CommandError as exc:
        error, message, code = exc, str(exc), exc.code
    except KeyboardInterrupt as exc:
        error, message, code = exc, "interrupted", 130
    except Exception as exc:  # anything unforeseen still gets one line; --debug shows where
        error, message, code = exc, f"{type(exc).__name__}: {error_line(exc)}", 1
        if not debug:
            message += f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
    if debug:
        traceback.print_exception(error)
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ngram-hal`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return report_errors(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
