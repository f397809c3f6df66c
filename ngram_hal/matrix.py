"""Merge conformance reports into one backend x test matrix, as markdown and as HTML.

A report is the JSON that the conformance suite writes, a :class:`~ngram_hal.report_schema.ConformanceReport`
(schema ``ngram-hal-conformance/1``).
Rows are tests grouped by tier, then op; columns are backends, labelled ``(proxy)`` when the
run was a proxy; each cell is the test's outcome on that backend (``not run`` when the report
lacks the test) and, for the performance tier, the timings the test recorded (eager, graph
replay, layout build). A summary row counts the outcomes of each column.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from pydantic import ValidationError

from .backend import OPS
from .report_schema import REPORT_SCHEMA, TIERS, ConformanceReport, Hardware, TestResult

OUTCOMES = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
NOT_RUN = "not run"

_MARKS = {"passed": "✅", "failed": "❌", "error": "💥", "xfailed": "⚠️", "xpassed": "❗",
          "skipped": "⏭️", NOT_RUN: "·"}


def hardware_text(report: ConformanceReport) -> str:
    """The device a run used, in words: ``"NVIDIA H200, sm_90, 140 GiB, 132 SMs, cuda 13.0"``
    (what the report knows of it; its device name alone for an older report; ``""`` for none)."""
    hw = report.hardware or Hardware()
    parts = [hw.name or report.device_name, hw.architecture,
             f"{hw.memory_bytes / 2**30:.0f} GiB" if hw.memory_bytes else None,
             f"{hw.multiprocessors} {'CPUs' if report.device == 'cpu' else 'SMs'}" if hw.multiprocessors else None,
             hw.runtime]
    return ", ".join(str(p) for p in parts if p)


def column_header(column: "Column") -> str:
    """A column's header in the markdown test table: its label, then its hardware after a line break."""
    hardware = hardware_text(column.report)
    return column.label + (f"<br>{hardware}" if hardware else "")


def collectives_text(report: ConformanceReport) -> str:
    """The ``torch.distributed`` backend the run's capabilities name (``gloo``), ``none``, or ``?``
    for a report made before the capability existed."""
    caps = report.capabilities or {}
    if "collectives" not in caps:
        return "?"
    return caps["collectives"] or "none"


def invariance_text(report: ConformanceReport) -> str:
    """Whether the run's backend claims batch invariance (``capabilities().batch_invariant``, which the
    invariance tests check where claimed): ``yes``, ``no``, or ``?`` for a report made before the
    capability existed."""
    caps = report.capabilities or {}
    if "batch_invariant" not in caps:
        return "?"
    return "yes" if caps["batch_invariant"] else "no"


def sanitizer_text(report: ConformanceReport) -> str:
    """``"memcheck: 0 errors"`` for a run under compute-sanitizer, ``""`` otherwise."""
    found = report.sanitizer
    if found is None:
        return ""
    return f"{found.tool}: " + (f"{found.errors} errors" if found.errors is not None else "no error summary")


def load_report(path: str | Path) -> ConformanceReport:
    """Read and validate one report; ``ValueError`` naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a JSON report: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: expected schema '{REPORT_SCHEMA}', found {found!r}")
    try:
        return ConformanceReport.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path}: not a valid conformance report: {exc}") from exc


@dataclass
class Column:
    """One backend run: its label, its report and its result for each test id."""

    label: str
    report: ConformanceReport
    results: dict[str, TestResult]

    def counts(self, test_ids: list[str]) -> Counter:
        """Outcome counts over ``test_ids`` (tests missing from this run count as not run)."""
        return Counter(self.results[t].outcome if t in self.results else NOT_RUN for t in test_ids)


@dataclass
class Row:
    """One test: its tier, op and id."""

    tier: str
    op: str
    test_id: str


@dataclass
class Matrix:
    """Backends as columns, tests as rows in tier, op, id order."""

    columns: list[Column]
    rows: list[Row]

    @property
    def test_ids(self) -> list[str]:
        """Every test id, in row order."""
        return [r.test_id for r in self.rows]

    def cell(self, row: Row, column: Column) -> TestResult | None:
        """The result of ``row``'s test in ``column``'s run, or None when it was not run."""
        return column.results.get(row.test_id)


def _labels(reports: list[ConformanceReport]) -> list[str]:
    """A label per report: backend, ``(proxy)``, ``under`` its sanitizer; where two share that, the
    hardware's name in brackets (the device where a report has none), then ``#n`` where still equal."""
    base = [r.backend + (" (proxy)" if r.proxy else "") + (f" under {r.sanitizer.tool}" if r.sanitizer else "")
            for r in reports]
    labels = [b if base.count(b) == 1 else f"{b} [{r.device_name or r.device}]"
              for b, r in zip(base, reports, strict=True)]
    seen: Counter = Counter()
    out = []
    for label in labels:
        seen[label] += 1
        out.append(label if labels.count(label) == 1 else f"{label} #{seen[label]}")
    return out


def sort_key(value: str, known: tuple[str, ...]) -> tuple[int, str]:
    """Order ``known`` values as listed, any other value after them alphabetically."""
    return (known.index(value), "") if value in known else (len(known), value)


def build_matrix(reports: list[ConformanceReport]) -> Matrix:
    """Merge ``reports`` (one column each, in the order given) into a :class:`Matrix`."""
    if not reports:
        raise ValueError("no reports to merge")
    columns = [Column(label, r, {t.id: t for t in r.tests}) for label, r in zip(_labels(reports), reports, strict=True)]
    rows: dict[str, Row] = {}
    for r in reports:
        for t in r.tests:
            rows.setdefault(t.id, Row(tier=t.tier or "", op=t.op or "", test_id=t.id))
    ordered = sorted(rows.values(), key=lambda w: (sort_key(w.tier, TIERS), sort_key(w.op, OPS), w.test_id))
    return Matrix(columns=columns, rows=ordered)


def summary_text(counts: Counter) -> str:
    """``"12 passed, 1 failed"``: nonzero counts in :data:`OUTCOMES` order, then not run."""
    keys = [k for k in OUTCOMES if counts[k]] + [k for k in sorted(counts) if k not in OUTCOMES and counts[k]]
    return ", ".join(f"{counts[k]} {k}" for k in keys) or "no tests"


def first_line(text: str | None, limit: int = 300) -> str:
    """The first non-blank line of a test message, at most ``limit`` characters."""
    lines = (text or "").strip().splitlines()
    return lines[0][:limit] if lines else ""


# Timing properties of the performance tier, in display order, with their labels.
TIMINGS = (("eager_ms", ""), ("graph_ms", "graph "), ("layout_ms", "layout "))


def timing_text(result: TestResult | None) -> str:
    """The timings a test recorded, e.g. ``"0.412 ms, graph 0.051 ms"`` (``"graph: failed"`` when
    graph capture raised); empty when it recorded none."""
    if result is None:
        return ""
    props = result.properties
    parts = [f"{label}{props[key]:.3g} ms" for key, label in TIMINGS if isinstance(props.get(key), (int, float))]
    if props.get("graph_error"):
        parts.append("graph: failed")
    return ", ".join(parts)


def _md(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _version(report: ConformanceReport, key: str) -> str:
    return str(getattr(report.versions, key) or "?")


def to_markdown(matrix: Matrix) -> str:
    """The matrix as GitHub-flavoured markdown: a table of runs, the test table, then failures."""
    ids = matrix.test_ids
    lines = ["# ngram-hal conformance matrix", "",
             "| backend | device | hardware | proxy | torch | driver | package | collectives | batch invariant "
             "| sanitizer | tests |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for col in matrix.columns:
        r = col.report
        fields = [col.label, r.device or "?", hardware_text(r) or "?", "yes" if r.proxy else "no", _version(r, "torch"),
                  _version(r, "driver"), _version(r, "backend_package"), collectives_text(r),
                  invariance_text(r), sanitizer_text(r) or "-", summary_text(col.counts(ids))]
        lines.append("| " + " | ".join(_md(f) for f in fields) + " |")
    header = ["tier", "op", "test"] + [_md(column_header(c)) for c in matrix.columns]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    failures = []
    for row in matrix.rows:
        cells = []
        for col in matrix.columns:
            result = matrix.cell(row, col)
            outcome = result.outcome if result else NOT_RUN
            timing = timing_text(result)
            cells.append(f"{_MARKS.get(outcome, '?')} {outcome}" + (f" ({_md(timing)})" if timing else ""))
            if outcome in ("failed", "error"):
                failures.append(f"- **{_md(col.label)}** `{_md(row.test_id)}`: "
                                f"{_md(first_line(result.message) or outcome)}")
        lines.append(f"| {_md(row.tier)} | {_md(row.op)} | `{_md(row.test_id)}` | " + " | ".join(cells) + " |")
    totals = [summary_text(c.counts(ids)) for c in matrix.columns]
    lines.append("| **summary** | | | " + " | ".join(f"**{t}**" for t in totals) + " |")
    if failures:
        lines += ["", "## Failures", "", *failures]
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1d1d1f; }
table { border-collapse: collapse; margin-bottom: 2em; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 4px 8px; text-align: left; vertical-align: top; }
thead th { background: #f0f0f0; position: sticky; top: 0; }
tr.tier th { background: #e4e8f0; text-align: left; font-size: 14px; }
td.id { font-family: ui-monospace, monospace; }
td.o { text-align: center; white-space: nowrap; }
td.nowrap { white-space: nowrap; }
span.t { font-size: 11px; color: #333; }
.o-passed { background: #c8f0c8; }
.o-failed { background: #f8b4b4; font-weight: bold; }
.o-error { background: #e06060; color: #ffffff; font-weight: bold; }
.o-xfailed { background: #fde7a6; }
.o-xpassed { background: #d9c6f5; }
.o-skipped { background: #e8e8e8; color: #666; }
.o-not-run { background: #ffffff; color: #aaaaaa; }
tfoot td { background: #f7f7f7; font-weight: bold; }
.legend span { display: inline-block; padding: 2px 8px; margin-right: 4px; border: 1px solid #d0d0d0; }
"""


def _cls(outcome: str) -> str:
    return "o-" + outcome.replace(" ", "-")


def _html_cell(result: TestResult | None) -> str:
    if result is None:
        return f'<td class="o {_cls(NOT_RUN)}">{NOT_RUN}</td>'
    parts = [f"{result.duration_s:.3f} s", result.message or "",
             str(result.properties.get("workload", "")), str(result.properties.get("graph_error", ""))]
    tip = " | ".join(p for p in parts if p)
    title = f' title="{html.escape(tip)}"' if tip else ""
    timing = timing_text(result)
    extra = f'<br><span class="t">{html.escape(timing)}</span>' if timing else ""
    return f'<td class="o {_cls(result.outcome)}"{title}>{html.escape(result.outcome)}{extra}</td>'


def to_html(matrix: Matrix, title: str = "ngram-hal conformance matrix") -> str:
    """The matrix as one self-contained HTML page (inline CSS, no external assets).

    Timings of the performance tier show in the cell; test messages, durations and workloads
    as the cell's tooltip.
    """
    e = html.escape
    ids = matrix.test_ids
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
           '<p class="legend">' + "".join(f'<span class="{_cls(o)}">{e(o)}</span>' for o in (*OUTCOMES, NOT_RUN))
           + "</p>",
           "<table><thead><tr><th>backend</th><th>device</th><th>hardware</th><th>proxy</th><th>versions</th>"
           "<th>collectives</th><th>batch invariant</th><th>sanitizer</th><th>created</th><th>tests</th></tr></thead><tbody>"]
    for col in matrix.columns:
        r = col.report
        versions = ", ".join(f"{k} {v}" for k, v in r.versions.model_dump().items() if v)
        fields = [col.label, r.device or "?", hardware_text(r) or "?", "yes" if r.proxy else "no", versions,
                  collectives_text(r), invariance_text(r), sanitizer_text(r) or "-"]
        out.append("<tr>" + "".join(f"<td>{e(f)}</td>" for f in fields)
                   + f'<td class="nowrap">{e(r.created)}</td><td>{e(summary_text(col.counts(ids)))}</td></tr>')
    out.append("</tbody></table>")
    out.append("<table><thead><tr><th>op</th><th>test</th>"
               + "".join(f"<th>{e(c.label)}" + (f'<br><span class="t">{e(hardware_text(c.report))}</span>'
                                                  if hardware_text(c.report) else "") + "</th>"
                         for c in matrix.columns) + "</tr></thead><tbody>")
    width = 2 + len(matrix.columns)
    for tier, tier_rows in groupby(matrix.rows, key=lambda r: r.tier):
        out.append(f'<tr class="tier"><th colspan="{width}">{e(tier or "(no tier)")}</th></tr>')
        for op, op_rows in groupby(tier_rows, key=lambda r: r.op):
            op_rows = list(op_rows)
            for j, row in enumerate(op_rows):
                cells = [f'<td rowspan="{len(op_rows)}">{e(op or "(no op)")}</td>'] if j == 0 else []
                cells.append(f'<td class="id">{e(row.test_id)}</td>')
                cells += [_html_cell(matrix.cell(row, col)) for col in matrix.columns]
                out.append("<tr>" + "".join(cells) + "</tr>")
    out.append('</tbody><tfoot><tr><td colspan="2">summary</td>'
               + "".join(f"<td>{e(summary_text(c.counts(ids)))}</td>" for c in matrix.columns)
               + "</tr></tfoot></table></body></html>")
    return "\n".join(out) + "\n"


def merge_files(paths: list[str | Path]) -> Matrix:
    """Load the reports at ``paths`` and merge them."""
    return build_matrix([load_report(p) for p in paths])
