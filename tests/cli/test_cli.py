"""The ``ngram-hal`` command line: backends, conformance, matrix and the engine hook."""

from __future__ import annotations

import importlib.util
import json
import re
import xml.etree.ElementTree as ET

import pytest

from ngram_hal import cli, matrix
from ngram_hal.backend import OPS
from ngram_hal.registry import list_backends

from test_matrix import CPU, ROCM, write

HAS_CONFORMANCE = importlib.util.find_spec(cli.hal.CONFORMANCE_PACKAGE) is not None


def subcommands(capsys) -> set[str]:
    """The commands ``ngram-hal`` offers, as its error for an unknown one lists them."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["no-such-command"])
    assert exit_.value.code == 2
    listed = capsys.readouterr().err.split("choose from", 1)[1]
    return set(re.findall(r"'([a-z-]+)'", listed))


def test_backends_json(capsys):
    assert cli.main(["backends", "--json"]) == 0
    infos = {i["name"]: i for i in json.loads(capsys.readouterr().out)}
    assert {"cpu", "cuda", "rocm", "npu"} <= set(infos)
    cpu = infos["cpu"]
    assert (cpu["available"], cpu["package"], cpu["ops"]) == (True, "ngram-hal", list(OPS))
    assert infos["cuda"]["ops"] == list(OPS)
    for name in ("cuda", "rocm", "npu"):
        info = infos[name]
        assert info["package"] == f"ngram-hal-{name}" and info["ops"] == list(OPS)
        assert info["available"] or info["reason"], f"{name} is unavailable without saying why"
    assert set(cpu) == {"name", "target", "package", "version", "available", "reason", "proxy", "ops"}


@pytest.mark.parametrize("columns", [200, 80])
def test_backends_table(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= columns for line in lines) and "…" not in out
    header = next(line for line in lines if "available" in line).split()
    columns_shown = ["name", "package", "version", "available", "proxy", "ops"]
    assert [word for word in header if word in columns_shown] == columns_shown
    for info in list_backends():
        row = next(line for line in lines if line.startswith(f"│ {info.name} "))
        assert f"{len(info.ops)}/{len(OPS)}" in row
    # The reasons come under the table, one per backend, whole.
    npu_reason = next(i.reason for i in list_backends() if i.name == "npu")
    assert f"npu: {npu_reason}" in " ".join(out.split())
    assert "torch_npu" in npu_reason


def test_backends_json_shows_a_rocm_proxy(monkeypatch, capsys):
    monkeypatch.setenv("NGRAM_HAL_ROCM_PROXY", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["backends", "--json"]) == 0
    rocm = next(i for i in json.loads(capsys.readouterr().out) if i["name"] == "rocm")
    if importlib.util.find_spec("triton") is None:
        assert not rocm["available"] and "triton" in rocm["reason"]
    else:
        assert (rocm["available"], rocm["proxy"]) == (True, True) and rocm["reason"].startswith("proxy:")


def test_matrix_writes_markdown_and_html(tmp_path, capsys):
    a, b = write(tmp_path, "cpu.json", CPU), write(tmp_path, "rocm.json", ROCM)
    md, page = tmp_path / "out" / "matrix.md", tmp_path / "out" / "matrix.html"
    assert cli.main(["matrix", str(a), str(b), "--markdown", str(md), "--html", str(page)]) == 0
    merged = matrix.merge_files([a, b])
    assert md.read_text(encoding="utf-8") == matrix.to_markdown(merged)
    assert page.read_text(encoding="utf-8") == matrix.to_html(merged)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "rocm (proxy)" in captured.err and "6 tests x 2 backends" in captured.err


def test_matrix_prints_markdown_without_outputs(tmp_path, capsys):
    a = write(tmp_path, "cpu.json", CPU)
    assert cli.main(["matrix", str(a)]) == 0
    assert capsys.readouterr().out == matrix.to_markdown(matrix.merge_files([a]))


def test_matrix_rejects_a_bad_report(tmp_path, capsys):
    bad = write(tmp_path, "bad.json", {"schema": "other/1"})
    assert cli.main(["matrix", str(bad), "--html", str(tmp_path / "m.html")]) == 2
    assert "bad.json: expected schema" in capsys.readouterr().err
    assert not (tmp_path / "m.html").exists()


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["conformance"], ["matrix"], ["conformance", "--backend", "cpu", "--strict-mode", "sometimes"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2, argv
    assert "the following arguments are required: --backend" in capsys.readouterr().err


def test_every_command_is_registered(monkeypatch, capsys):
    """The engine's commands sit beside the HAL's, dispatched to :mod:`ngram_hal.cli.run` and
    :mod:`ngram_hal.cli.bench`."""
    assert {"backends", "conformance", "matrix", "run", "bench"} == subcommands(capsys)
    calls = []
    monkeypatch.setattr(cli.run, "run_command", lambda args: calls.append(("run", args.prompt)) or 0)
    monkeypatch.setattr(cli.bench, "bench_command", lambda args: calls.append(("bench", args.batch_sizes)) or 3)
    assert cli.main(["run", "--prompt", "hi"]) == 0
    assert cli.main(["bench", "--batch-sizes", "16"]) == 3
    assert calls == [("run", "hi"), ("bench", [16])]


@pytest.mark.skipif(not HAS_CONFORMANCE, reason="ngram-hal-conformance is not installed (pip install -e conformance)")
def test_conformance_on_cpu_writes_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    report, junit = tmp_path / "r" / "cpu.json", tmp_path / "r" / "cpu.xml"
    code = cli.main(["conformance", "--backend", "cpu", "--device", "cpu", "-k", "registration",
                     "--strict-mode", "on", "--max-examples", "2", "--json", str(report), "--junit", str(junit)])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    data = matrix.load_report(report)
    assert data.backend == "cpu" and not data.proxy
    assert data.tests and {t.outcome for t in data.tests} <= {"passed", "skipped"}
    assert {t.tier for t in data.tests} == {"registration"}
    assert all(t.strict is not False for t in data.tests)
    assert sum(1 for _ in ET.parse(junit).getroot().iter("testcase")) == len(data.tests)
    assert "conformance: cpu on cpu" in out and "total" in out


@pytest.mark.skipif(not HAS_CONFORMANCE, reason="ngram-hal-conformance is not installed (pip install -e conformance)")
def test_conformance_exit_code_is_pytests(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the plugin is then named with -p
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("# nothing expected to fail\n")
    stale = write(tmp_path, "r.json", CPU)
    code = cli.main(["conformance", "--backend", "cpu", "-k", "no_test_matches_this_expression",
                     "--xfails", str(xfails), "--json", str(stale)])
    captured = capsys.readouterr()
    assert code == 5, captured.out[-3000:]
    assert not stale.exists() or matrix.load_report(stale).tests == []
    # No summary table for a run in which no test ran: one error line instead.
    assert "conformance: cpu" not in captured.out
    assert captured.err.strip().splitlines()[-1] == "error: no conformance test ran (pytest exit code 5)"
