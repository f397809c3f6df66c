"""Reports are written atomically and their destinations checked before a run.

``ngram_hal.files`` on its own (a full disk leaves the old report and no temporary file), then
each writer that uses it: ``ngram-hal matrix``, ``ngram-hal conformance`` and its pytest plugin,
``ngram-hal run``/``bench`` (in ``tests/cli/test_cli_inputs.py``), and the benchmarks' ``write_json``.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from ngram_hal import cli, files, matrix
from ngram_hal.files import WriteError, check_writable, write_atomic

from test_matrix import CPU, write

BENCH = Path(__file__).resolve().parents[2] / "bench"
HAS_CONFORMANCE = importlib.util.find_spec(cli.hal.CONFORMANCE_PACKAGE) is not None


def no_space(fd: int) -> None:
    """``os.fsync`` on a full disk: part of the report reached the file, the rest did not."""
    os.write(fd, b"...")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch):
    """Every write of a report fails as on a full disk."""
    monkeypatch.setattr(files.os, "fsync", no_space)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


def test_write_atomic_writes_creates_folders_and_replaces(tmp_path):
    target = tmp_path / "a" / "b" / "report.json"
    assert write_atomic(target, "first\n") == target
    assert target.read_text() == "first\n"
    write_atomic(target, b"second\n")
    assert target.read_bytes() == b"second\n" and leftovers(target.parent) == []
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_keeps_the_old_report_and_names_the_path(tmp_path, full_disk):
    target = tmp_path / "report.json"
    target.write_text("old\n")
    with pytest.raises(WriteError, match=rf"^{target}: cannot write it \(No space left on device\)$") as info:
        write_atomic(target, "new\n")
    assert info.value.path == target
    assert target.read_text() == "old\n" and leftovers(tmp_path) == []


def test_write_atomic_replaces_what_a_link_points_to(tmp_path):
    real = tmp_path / "real.md"
    real.write_text("old")
    link = tmp_path / "link.md"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_check_writable_refuses_folders_and_files_as_folders_and_creates_nothing(tmp_path):
    with pytest.raises(WriteError, match=rf"^{tmp_path}: is a folder, not a file$"):
        check_writable(tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(WriteError, match=rf"^{blocker}/x/r.json: {blocker} is not a folder$"):
        check_writable(blocker / "x" / "r.json")
    assert check_writable(tmp_path / "new" / "deeper" / "r.json") == tmp_path / "new" / "deeper" / "r.json"
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_check_writable_refuses_a_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(WriteError, match=rf"no permission to create files in {locked}$"):
        check_writable(locked / "r.json")


# ---------------------------------------------------------------- the commands that write reports


def test_matrix_checks_every_destination_before_writing_any(tmp_path, capsys):
    report = write(tmp_path, "cpu.json", CPU)
    md = tmp_path / "m.md"
    assert cli.main(["matrix", str(report), "--markdown", str(md), "--html", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --html {tmp_path}: is a folder, not a file\n" and captured.out == ""
    assert not md.exists()


def test_matrix_on_a_full_disk_keeps_the_old_file(tmp_path, capsys, full_disk):
    report = write(tmp_path, "cpu.json", CPU)
    md = tmp_path / "m.md"
    md.write_text("old matrix\n")
    assert cli.main(["matrix", str(report), "--markdown", str(md)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: --markdown {md}: cannot write it "
                                                         "(No space left on device)")
    assert md.read_text() == "old matrix\n" and leftovers(tmp_path) == []


@pytest.mark.skipif(not HAS_CONFORMANCE, reason="ngram-hal-conformance is not installed (pip install -e conformance)")
@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_conformance_checks_its_destinations_before_the_run(tmp_path, capsys, option):
    assert cli.main(["conformance", "--backend", "cpu", option, str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {option} {tmp_path}: is a folder, not a file\n"
    assert "test session starts" not in captured.out


@pytest.mark.skipif(not HAS_CONFORMANCE, reason="ngram-hal-conformance is not installed (pip install -e conformance)")
def test_conformance_replaces_both_reports_whole(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "out"
    out.mkdir()
    report, junit = out / "cpu.json", out / "cpu.xml"
    report.write_text("stale")
    junit.write_text("stale")
    code = cli.main(["conformance", "--backend", "cpu", "-k", "test_registration and op_present and alloc_extend",
                     "--strict-mode", "off", "--json", str(report), "--junit", str(junit)])
    assert code == 0, capsys.readouterr().out[-3000:]
    assert matrix.load_report(report).tests and junit.read_text().startswith("<?xml")
    assert sorted(p.name for p in out.iterdir()) == ["cpu.json", "cpu.xml"]


@pytest.mark.skipif(not HAS_CONFORMANCE, reason="ngram-hal-conformance is not installed (pip install -e conformance)")
def test_conformance_plugin_checks_and_names_its_report_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--pyargs", "ngram_hal_conformance.test_registration", "-q", "-p", "no:cacheprovider", "--backend", "cpu",
            "--strict-mode", "off", "-k", "op_present and alloc_extend"]
    assert pytest.main([*argv, "--report-json", str(tmp_path)]) == pytest.ExitCode.USAGE_ERROR
    assert f"--report-json {tmp_path}: is a folder, not a file" in capsys.readouterr().err
    target = tmp_path / "report.json"
    target.write_text("old\n")
    assert pytest.main([*argv, "--report-json", str(target)]) == pytest.ExitCode.OK
    assert json.loads(target.read_text())["tests"]
    target.write_text("old\n")
    with monkeypatch.context() as patch:
        patch.setattr(files.os, "fsync", no_space)
        assert pytest.main([*argv, "--report-json", str(target)]) == pytest.ExitCode.INTERNAL_ERROR
    assert f"error: --report-json {target}: cannot write it (No space left on device)" in capsys.readouterr().err
    assert target.read_text() == "old\n" and leftovers(tmp_path) == []


def test_bench_reports_are_written_through_the_same_helper(tmp_path, monkeypatch, full_disk):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    import common

    target = tmp_path / "bench.json"
    target.write_text(json.dumps({"old": True}))
    with pytest.raises(WriteError, match=rf"^{target}: cannot write it"):
        common.write_json(target, {"new": True})
    assert json.loads(target.read_text()) == {"old": True} and leftovers(tmp_path) == []
