"""``ngram-hal backends``, ``conformance`` and ``matrix``: the HAL's backends, the suite that
checks them, and the matrix of its reports."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import matrix
from ..backend import OPS
from ..registry import list_backends, resolve
from ..report_schema import TIERS, ConformanceReport
from . import sanitizer
from .common import CommandError, check_destination, error_line, write_output

CONFORMANCE_PACKAGE = "ngram_hal_conformance"
CONFORMANCE_PLUGIN = "ngram_hal_conformance.plugin"


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


def _conformance_summary(report: ConformanceReport, console: Console) -> None:
    tiers = sorted({t.tier or "" for t in report.tests}, key=lambda t: matrix.sort_key(t, TIERS))
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
    if args.sanitizer:
        if sanitizer.find() is None:
            raise CommandError(f"--sanitizer {args.sanitizer}: {sanitizer.EXECUTABLE} is not on PATH (it comes with "
                               "the CUDA toolkit)")
        device = target.cls(device=args.device, strict=False).device
        if device.type != "cuda" or torch.version.hip:
            raise CommandError(f"--sanitizer {args.sanitizer}: compute-sanitizer checks NVIDIA GPUs; backend "
                               f"'{args.backend}' runs on {device}" + (" (ROCm)" if torch.version.hip else ""))


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
        if args.tiers:
            argv += ["--tiers", args.tiers]
        if args.scale:
            argv += ["--scale", args.scale]
        if args.sanitizer:
            code = _run_sanitized(args.sanitizer, argv, Path(tmp), report_path)
        else:
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


def _run_sanitized(tool: str, argv: list[str], tmp: Path, report_path: Path) -> int:
    """Run pytest with ``argv`` in a child process under compute-sanitizer's ``tool`` and add what
    it found to the report at ``report_path``; returns the child's exit code."""
    executable, log = sanitizer.find(), tmp / "sanitizer.log"
    child = [*sanitizer.command(executable, tool, log), sys.executable, "-m", "pytest", *argv]
    print(f"conformance under compute-sanitizer --tool {tool} (much slower than a plain run)", file=sys.stderr)
    code = subprocess.run(child, env=sanitizer.environment(dict(os.environ))).returncode
    errors, first = sanitizer.read_log(log)
    if report_path.is_file():
        data = json.loads(report_path.read_text())
        data["sanitizer"] = {"tool": tool, "errors": errors, "version": sanitizer.version(executable),
                             "exit_code": code, "first_errors": first}
        report_path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"compute-sanitizer {tool}: " + (f"{errors} errors" if errors is not None else "no error summary"),
          file=sys.stderr)
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


