"""ngram_hal.matrix: merging conformance reports into a backend x test matrix."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest

from ngram_hal import matrix
from ngram_hal.report_schema import REPORT_SCHEMA, ConformanceReport


def make_report(backend, tests, proxy=False, device="cpu"):
    """A report in the conformance suite's JSON schema; tests are (id, op, tier, outcome[, message])."""
    rows = []
    for t in tests:
        test_id, op, tier, outcome = t[:4]
        rows.append({"id": test_id, "op": op, "tier": tier, "strict": "strict" in test_id, "outcome": outcome,
                     "duration_s": 0.25, "message": t[4] if len(t) > 4 else None})
    summary = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "skipped", "xfailed", "xpassed")}
    summary["errors"] = sum(r["outcome"] == "error" for r in rows)
    return {"schema": REPORT_SCHEMA, "backend": backend, "target": f"ngram_hal_{backend}:Backend", "proxy": proxy,
            "device": device, "versions": {"ngram_hal": "0.1.0", "ngram_hal_conformance": "0.1.0",
                                           "backend_package": "0.1.0", "torch": "2.13.0", "triton": None,
                                           "driver": None},
            "strict_modes": [True, False], "capabilities": None, "summary": summary, "tests": rows,
            "created": "2026-11-30T09:00:00+00:00"}


CPU = make_report("cpu", [
    ("test_sem.py::test_move_kv[strict]", "move_kv", "semantics", "passed"),
    ("test_reg.py::test_ops_present", None, "registration", "passed"),
    ("test_con.py::test_alloc_int32[strict]", "alloc_extend", "contract", "passed"),
    ("test_con.py::test_move_kv_int32[strict]", "move_kv", "contract", "passed"),
    ("test_perf.py::test_move_kv_speed", "move_kv", "performance", "skipped"),
])
ROCM = make_report("rocm", [
    ("test_sem.py::test_move_kv[strict]", "move_kv", "semantics", "failed", "rows differ at slot 3\ntraceback..."),
    ("test_reg.py::test_ops_present", None, "registration", "passed"),
    ("test_con.py::test_alloc_int32[strict]", "alloc_extend", "contract", "xfailed"),
    ("test_con.py::test_move_kv_int32[strict]", "move_kv", "contract", "error", "fixture <kv> | broke"),
    ("test_extra.py::test_vendor_only", "store_kv", "semantics", "xpassed"),
], proxy=True, device="cuda:0")


def write(tmp_path, name, report):
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


def test_rows_grouped_by_tier_then_op_and_columns_labelled():
    m = matrix.build_matrix([ConformanceReport.model_validate(CPU), ConformanceReport.model_validate(ROCM)])
    assert [c.label for c in m.columns] == ["cpu", "rocm (proxy)"]
    assert [(r.tier, r.op) for r in m.rows] == [
        ("registration", ""),
        ("contract", "alloc_extend"),
        ("contract", "move_kv"),
        ("semantics", "store_kv"),
        ("semantics", "move_kv"),
        ("performance", "move_kv"),
    ]
    vendor_only = next(r for r in m.rows if r.op == "store_kv")
    assert m.cell(vendor_only, m.columns[0]) is None
    assert m.cell(vendor_only, m.columns[1]).outcome == "xpassed"


def test_summary_counts_each_column_including_tests_it_did_not_run():
    m = matrix.build_matrix([ConformanceReport.model_validate(CPU), ConformanceReport.model_validate(ROCM)])
    cpu, rocm = (c.counts(m.test_ids) for c in m.columns)
    assert cpu == {"passed": 4, "skipped": 1, matrix.NOT_RUN: 1}
    assert rocm == {"passed": 1, "failed": 1, "error": 1, "xfailed": 1, "xpassed": 1, matrix.NOT_RUN: 1}
    assert matrix.summary_text(rocm) == "1 passed, 1 failed, 1 error, 1 xfailed, 1 xpassed, 1 not run"


def test_markdown_table(tmp_path):
    m = matrix.merge_files([write(tmp_path, "a.json", CPU), write(tmp_path, "b.json", ROCM)])
    md = matrix.to_markdown(m)
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| tier |"))
    assert header == "| tier | op | test | cpu | rocm (proxy) |"
    body = lines[lines.index(header) + 2:]
    rows = [line for line in body if line.startswith("| ") and "summary" not in line]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [
        "registration", "contract", "contract", "semantics", "semantics", "performance"]
    move_sem = next(row for row in rows if "test_move_kv[strict]" in row)
    assert move_sem.endswith("| ✅ passed | ❌ failed |")
    summary = next(line for line in lines if line.startswith("| **summary**"))
    assert "**4 passed, 1 skipped, 1 not run**" in summary
    assert "**1 passed, 1 failed, 1 error, 1 xfailed, 1 xpassed, 1 not run**" in summary
    # a pipe inside a message is escaped; only a message's first line is shown
    assert "- **rocm (proxy)** `test_con.py::test_move_kv_int32[strict]`: fixture <kv> \\| broke" in md
    assert "- **rocm (proxy)** `test_sem.py::test_move_kv[strict]`: rows differ at slot 3" in lines
    # every row of the test table has the same number of cells
    table = [line for line in lines[lines.index(header):] if line.startswith("|")]
    assert len({len(re.split(r"(?<!\\)\|", line)) for line in table}) == 1


def test_hardware_heads_each_column_and_a_sanitized_run_is_its_own_column(tmp_path):
    h200 = {**CPU, "backend": "cuda", "device": "cuda",
            "hardware": {"name": "NVIDIA H200", "architecture": "sm_90", "memory_bytes": 150 * 2**30,
                         "multiprocessors": 132, "runtime": "cuda 13.0"}, "capabilities": {"collectives": "nccl", "batch_invariant": True}}
    sanitized = {**h200, "sanitizer": {"tool": "memcheck", "errors": 0, "exit_code": 0}}
    m = matrix.merge_files([write(tmp_path, "a.json", h200), write(tmp_path, "b.json", sanitized),
                            write(tmp_path, "c.json", CPU)])
    assert [c.label for c in m.columns] == ["cuda", "cuda under memcheck", "cpu"]
    md = matrix.to_markdown(m)
    header = next(line for line in md.splitlines() if line.startswith("| tier |"))
    hw = "NVIDIA H200, sm_90, 150 GiB, 132 SMs, cuda 13.0"
    assert header == f"| tier | op | test | cuda<br>{hw} | cuda under memcheck<br>{hw} | cpu |"
    assert f"| cuda under memcheck | cuda | {hw} | no | 2.13.0 | ? | 0.1.0 | nccl | yes | memcheck: 0 errors |" in md
    assert "| cpu | cpu | " in md and "| 0.1.0 | ? | ? | - |" in md, "a report without the capabilities: '?'"
    page = matrix.to_html(m)
    assert f'<th>cuda under memcheck<br><span class="t">{hw}</span></th>' in page and "<th>cpu</th>" in page


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.cells, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "td":
            self._cell = [dict(attrs), ""]

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.cells.append(tuple(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1] += data


def test_html_is_self_contained_coloured_and_escaped(tmp_path):
    m = matrix.merge_files([write(tmp_path, "a.json", CPU), write(tmp_path, "b.json", ROCM)])
    page = matrix.to_html(m)
    parsed = _Collector()
    parsed.feed(page)
    tags = {t for t, _ in parsed.tags}
    assert "style" in tags and "link" not in tags and "script" not in tags and "img" not in tags
    assert not re.search(r"(src|href)=", page)
    outcome_cells = [(attrs["class"], text) for attrs, text in parsed.cells if "o" in attrs.get("class", "").split()]
    assert ("o o-failed", "failed") in outcome_cells
    assert ("o o-xfailed", "xfailed") in outcome_cells
    assert ("o o-not-run", "not run") in outcome_cells
    assert len(outcome_cells) == len(m.rows) * len(m.columns)
    for cls in {c.split()[1] for c, _ in outcome_cells}:
        assert re.search(rf"\.{cls} \{{ background: #[0-9a-f]{{6}}", page), cls
    # the message is a tooltip, escaped; '<kv>' never becomes a tag
    error = next(attrs for attrs, text in parsed.cells if text == "error")
    assert error["title"] == "0.250 s | fixture <kv> | broke"
    assert "kv" not in {t for t, _ in parsed.tags}
    # op cells span their tests; tier header rows split the groups
    spans = [int(attrs["rowspan"]) for t, attrs in parsed.tags if t == "td" and "rowspan" in attrs]
    assert sum(spans) == len(m.rows)
    tiers = re.findall(r'<tr class="tier"><th colspan="4">(\w+)</th>', page)
    assert tiers == ["registration", "contract", "semantics", "performance"]
    assert "<td>4 passed, 1 skipped, 1 not run</td>" in page.split("<tfoot>")[1]


def test_performance_timings_show_in_both_formats(tmp_path):
    cuda, cpu = (make_report(name, [("test_performance.py::test_op_time[move_kv]", "move_kv", "performance", "passed"),
                                    ("test_kv.py::test_move_kv[strict-on]", "move_kv", "semantics", "passed")])
                 for name in ("cuda", "cpu"))
    cuda["tests"][0]["properties"] = {"eager_ms": 0.41234, "graph_ms": 0.0512, "workload": "512 pairs"}
    cpu["tests"][0]["properties"] = {"eager_ms": 31.2, "graph_error": "RuntimeError: sync during capture"}
    m = matrix.merge_files([write(tmp_path, "cuda.json", cuda), write(tmp_path, "cpu.json", cpu)])
    row = next(line for line in matrix.to_markdown(m).splitlines() if "test_op_time[move_kv]" in line)
    assert row.endswith("| ✅ passed (0.412 ms, graph 0.0512 ms) | ✅ passed (31.2 ms, graph: failed) |")
    semantics = next(line for line in matrix.to_markdown(m).splitlines() if "test_move_kv[strict-on]" in line)
    assert semantics.endswith("| ✅ passed | ✅ passed |")
    parsed = _Collector()
    parsed.feed(matrix.to_html(m))
    cells = [(attrs.get("title", ""), text) for attrs, text in parsed.cells if "o-passed" in attrs.get("class", "")]
    assert ("0.250 s | 512 pairs", "passed0.412 ms, graph 0.0512 ms") in cells
    assert ("0.250 s | RuntimeError: sync during capture", "passed31.2 ms, graph: failed") in cells


def test_duplicate_backends_get_distinct_labels():
    runs = [("passed", "cpu"), ("failed", "cuda:0"), ("passed", "cuda:0")]
    a, b, c = (ConformanceReport.model_validate(make_report("rocm", [("t", "move_kv", "semantics", outcome)],
                                                            device=device, proxy=True)) for outcome, device in runs)
    labels = [col.label for col in matrix.build_matrix([a, b, c]).columns]
    assert labels == ["rocm (proxy) [cpu]", "rocm (proxy) [cuda:0] #1", "rocm (proxy) [cuda:0] #2"]
    h100, h200 = ({**make_report("cuda", [("t", "move_kv", "semantics", "passed")], device="cuda"), "device_name": name}
                  for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    reports = [ConformanceReport.model_validate(r) for r in (h100, h200)]
    assert [col.label for col in matrix.build_matrix(reports).columns] == ["cuda [NVIDIA H100 80GB HBM3]",
                                                                           "cuda [NVIDIA H200]"]


def test_rejects_what_is_not_a_report(tmp_path):
    wrong = write(tmp_path, "wrong.json", {**CPU, "schema": "something-else/2"})
    with pytest.raises(ValueError, match=r"wrong\.json: expected schema 'ngram-hal-conformance/1'"):
        matrix.load_report(wrong)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: cannot read"):
        matrix.load_report(broken)
    missing = write(tmp_path, "missing.json", {k: v for k, v in CPU.items() if k != "tests"})
    with pytest.raises(ValueError, match=r"missing\.json: not a valid conformance report"):
        matrix.load_report(missing)
    with pytest.raises(ValueError, match="no reports"):
        matrix.build_matrix([])
