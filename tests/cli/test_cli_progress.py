"""What ``ngram-hal run`` shows while it works: rich spinners and bars on a terminal, plain
time-stamped lines in a pipe, every status line within 80 columns."""

from __future__ import annotations

import os
import pty
import re
import sys

import pytest

from ngram_hal.engine.progress import WIDTH, PlainProgress, Status

from test_cli_errors import run_cli
from test_cli_inputs import model_available


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


STAMP = r"\[\d+\.\ds\] "


def test_plain_lines_are_stamped_and_wrapped_to_80_columns(capsys):
    clock = Clock()
    status = Status(plain=True, clock=clock)
    clock.now += 12.34
    status.print("loading the model ...")
    status.print("note: " + " ".join(["word"] * 40))
    with status.status("compiling ..."):
        clock.now += 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[12.3s] loading the model ..."
    assert lines[1].startswith("[12.3s] note: word") and lines[2].startswith(" " * 8 + "  word")
    assert lines[-1] == "[12.3s] compiling ..."
    assert all(len(line) <= WIDTH for line in lines)
    # A path longer than a line stays whole, beside the word before it.
    path = "/a" * 50 + "/run.json"
    status.print(f"wrote {path}")
    assert capsys.readouterr().err == f"[13.3s] wrote {path}\n"


def test_plain_progress_reports_every_few_seconds_and_when_a_run_ends(capsys):
    clock = Clock()
    status = Status(plain=True, clock=clock, every_s=5.0)
    with status.progress() as progress:
        assert isinstance(progress, PlainProgress)
        spec, plain = progress.add_task("speculative", total=1520), progress.add_task("plain", total=1520)
        progress.advance(spec, 1)                       # the first tokens: a line
        clock.now += 1
        progress.advance(spec, 100)                     # 1 s later: none
        clock.now += 4
        progress.advance(plain, 1)                      # 5 s after the last one: a line
        clock.now += 1
        progress.advance(spec, 1000)                    # 1 s later: none
        progress.update(spec, total=1101)               # a request stopped early: the run is done, a line
        clock.now += 4
        progress.advance(plain, 20)                     # 4 s after the last one: none
        clock.now += 1
        progress.advance(plain, 10)                     # 5 s: a line, without the finished run
        progress.advance(plain, 1489)                   # done too: a line
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[0.0s] generating: speculative 1/1520 tokens, plain 0/1520",
                     "[5.0s] generating: speculative 101/1520 tokens, plain 1/1520",
                     "[6.0s] generating: speculative 1101/1101 tokens (done), plain 1/1520",
                     "[11.0s] generating: plain 31/1520 tokens",
                     "[11.0s] generating: plain 1520/1520 tokens (done)"]


def test_plain_progress_splits_a_long_line_by_run(capsys):
    status = Status(plain=True, clock=Clock())
    progress = status.progress()
    for label in ("B=16 spec-auto", "B=16 spec -ovl", "B=16 plain -ovl"):
        progress.add_task(label, total=123456)
    progress.advance(0, 7)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[0.0s] generating: B=16 spec-auto 7/123456 tokens",
                     "[0.0s] generating: B=16 spec -ovl 0/123456 tokens",
                     "[0.0s] generating: B=16 plain -ovl 0/123456 tokens"]


def test_status_is_plain_unless_stdout_and_stderr_are_terminals(monkeypatch, tmp_path):
    leader, follower = pty.openpty()
    with open(follower, "w", closefd=True) as terminal, open(tmp_path / "log", "w") as log:
        for stdout, stderr, plain in ((terminal, terminal, False), (log, terminal, True), (terminal, log, True),
                                      (log, log, True)):
            monkeypatch.setattr(sys, "stdout", stdout)
            monkeypatch.setattr(sys, "stderr", stderr)
            assert Status().plain is plain
    os.close(leader)


@pytest.mark.skipif(not model_available(), reason="the model file is not installed")
def test_run_in_a_pipe_shows_stamped_status_lines_within_80_columns(tmp_path):
    done = run_cli("run", "--prompt", "Say hello twice: hello hello", "--max-new-tokens", "4", "--compare",
                   "--threads", "1", "--num-slots", "512", "--quiet", "--json", "reports/run.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr.splitlines()
    expected = [r"reading the tokenizer of \S+\.gguf \.\.\.", r"loading \S+\.gguf \(about 10 s\) \.\.\.",
                r"loaded \S+\.gguf in [\d.]+ s", r"using the cpu backend on cpu, float32, 1 thread",
                r"one-time work \(numba kernels, .*\) \.\.\.",
                r"one-time work done in [\d.]+ s, not timed: kernels compiled",
                r"generating: speculative \d+/\d+ tokens, plain \d+/\d+",
                r"wrote reports/run\.json"]
    for pattern in expected:
        assert any(re.fullmatch(STAMP + pattern, line) for line in err), (pattern, err)
    for label in ("speculative", "plain"):
        assert any(re.fullmatch(rf"{STAMP}generating: (.*, )?{label} (\d+)/\2( tokens)? \(done\)(, .*)?", line)
                   for line in err), (label, err)
    assert all(len(line) <= WIDTH for line in err + done.stdout.splitlines()), err
    assert "━" not in done.stderr and "\r" not in done.stderr
    assert (tmp_path / "reports" / "run.json").is_file()
