"""The ``ngram-hal`` command as a user runs it: every mistake is one line, ``error: ...``.

Each case runs the installed console script in a subprocess and checks that it exits non-zero
with a single line on stderr naming the option or file and what is allowed, no traceback, and
nothing on stdout (no table for a run that did not happen). The cases fail before the model is
loaded, which is why nothing else is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ngram_hal.cli import CommandError, main, report_errors

NGRAM_HAL = shutil.which("ngram-hal", path=str(Path(sys.executable).parent)) or shutil.which("ngram-hal")


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    assert NGRAM_HAL, "the ngram-hal console script is not installed"
    full_env = {k: v for k, v in os.environ.items() if k not in ("NGRAM_HAL_DEBUG", "NGRAM_HAL_BACKEND")}
    full_env.update({"COLUMNS": "80", **(env or {})})
    return subprocess.run([NGRAM_HAL, *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def bad_prompts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompts")
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    files = {"wrong-type": f'{good}\n{{"messages": "oops"}}\n', "not-json": f"{good}\n\nnot json\n", "empty": "\n"}
    for name, text in files.items():
        (root / f"{name}.jsonl").write_text(text)
    return {name: root / f"{name}.jsonl" for name in files}


# The cases a newcomer met, each run as a user runs it.
USER_CASES = {
    "unknown-backend": (["run", "--backend", "nosuch"], r"--backend nosuch: no backend named 'nosuch'; registered: .*cpu"),
    "unavailable-backend": (["run", "--backend", "npu"], r"--backend npu: .*not available.*torch_npu"),
    "missing-prompts": (["run", "--prompts", "/no/such/prompts.jsonl"],
                        r"--prompts /no/such/prompts.jsonl: cannot read it \(No such file or directory\)"),
    "wrong-type-line": (["run", "--prompts", "{wrong-type}"], r"--prompts .*wrong-type.jsonl line 2: messages: input "
                                                              r"should be a valid list"),
    "zero-new-tokens": (["run", "--max-new-tokens", "0"], r"argument --max-new-tokens: '0': input should be greater "
                                                          r"than or equal to 1"),
    "negative-temperature": (["run", "--temperature", "-1"], r"argument --temperature: '-1': input should be greater "
                                                             r"than or equal to 0"),
    "zero-tree-size": (["run", "--tree-size", "0"], r"argument --tree-size: '0': input should be greater"),
    "huge-tree-size": (["run", "--tree-size", "100000"], r"--tree-size 100000: at most 682 with --max-context-len "
                                                           r"2048"),
    "conformance-unknown-backend": (["conformance", "--backend", "nosuch"], r"--backend nosuch: no backend named"),
}

# More of the same, run in this process (the same code path, without a new interpreter each).
MORE_CASES = {
    "not-json-line": (["run", "--prompts", "{not-json}"], r"--prompts .*not-json.jsonl line 3: not JSON"),
    "empty-prompts": (["run", "--prompts", "{empty}"], r"--prompts .*empty.jsonl: no prompts"),
    "empty-prompt": (["run", "--prompt", " "], r"--prompt: the text is empty"),
    "nan-temperature": (["run", "--temperature", "nan"], r"argument --temperature: 'nan': input should be a finite"),
    "top-p-zero": (["run", "--top-p", "0"], r"argument --top-p: '0': input should be greater than 0"),
    "zero-threads": (["run", "--threads", "0"], r"argument --threads: '0': input should be greater than or equal to 1"),
    "compare-without-spec": (["run", "--compare", "--no-spec"], r"--compare .*drop --no-spec"),
    "missing-model": (["run", "--model", "/no/such/model.gguf"], r"--model /no/such/model.gguf: no such file"),
    "bad-device": (["run", "--device", "nodevice"], r"--device nodevice: not a torch device"),
    "unusable-device": (["run", "--device", "cuda:99"], r"--device cuda:99: cannot allocate there"),
    "bad-batch-sizes": (["bench", "--batch-sizes", "1,x"], r"argument --batch-sizes: 'x': input should be a valid "
                                                          r"integer"),
    "unknown-shape": (["bench", "--shape", "llama-3b"], r"--shape: shape 'llama-3b': neither a preset \(smollm2-135m, "
                                                        r"llama-1b, llama-8b, llama-70b-slice\) nor a JSON file"),
    "kv-fraction-zero": (["run", "--kv-fraction", "0"], r"argument --kv-fraction: '0': input should be greater than 0"),
    "kv-fraction-and-slots": (["run", "--kv-fraction", "0.5", "--num-slots", "4096"],
                              r"--num-slots 4096 and --kv-fraction 0.5: give one of them"),
    "kv-fraction-on-the-host": (["run", "--backend", "cpu", "--kv-fraction", "0.5"],
                                r"--kv-fraction 0.5: the host device does not report its free memory; give --num-slots"),
    "conformance-unavailable-backend": (["conformance", "--backend", "npu"], r"--backend npu: .*not available here"),
    "conformance-missing-xfails": (["conformance", "--backend", "cpu", "--xfails", "/no/such/xfails.txt"],
                                   r"--xfails /no/such/xfails.txt: no such file"),
    "conformance-zero-examples": (["conformance", "--backend", "cpu", "--max-examples", "0"],
                                  r"argument --max-examples: '0': input should be greater"),
    "matrix-missing-report": (["matrix", "/no/such/report.json"], r"/no/such/report.json: cannot read"),
}


def check_one_error_line(code: int, out: str, err: str, message: str) -> None:
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert out == ""


@pytest.mark.parametrize("case", list(USER_CASES))
def test_a_mistake_is_one_error_line(case, bad_prompts):
    args, message = USER_CASES[case]
    done = run_cli(*(a.format(**bad_prompts) for a in args))
    check_one_error_line(done.returncode, done.stdout, done.stderr, message)


@pytest.mark.parametrize("case", list(MORE_CASES))
def test_more_mistakes_are_one_error_line(case, bad_prompts, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NGRAM_HAL_BACKEND", raising=False)
    args, message = MORE_CASES[case]
    try:
        code = main([a.format(**bad_prompts) for a in args])
    except SystemExit as exit_info:  # argparse's own errors end the program
        code = exit_info.code
    captured = capsys.readouterr()
    check_one_error_line(code, captured.out, captured.err, message)


def test_debug_env_shows_the_traceback_and_keeps_the_exit_code():
    done = run_cli("run", "--backend", "nosuch", env={"NGRAM_HAL_DEBUG": "1"})
    assert done.returncode == 2, done.stderr
    assert "Traceback (most recent call last)" in done.stderr and "no backend named 'nosuch'" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: --backend nosuch: no backend named 'nosuch'")


@pytest.mark.parametrize("argv", [["run", "--backend", "nosuch", "--debug"],
                                  ["--debug", "conformance", "--backend", "cpu", "--xfails", "/no/such/xfails.txt"]],
                         ids=["run", "conformance"])
def test_debug_flag_shows_the_traceback_and_keeps_the_exit_code(argv, capsys, monkeypatch):
    monkeypatch.delenv("NGRAM_HAL_DEBUG", raising=False)
    monkeypatch.delenv("NGRAM_HAL_BACKEND", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "CommandError" in err
    assert err.splitlines()[-1].startswith("error: --")


def test_debug_keeps_the_exit_code_of_other_failures(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("disk on fire")

    def mistaken(args):
        raise CommandError("--x 1: at most 0")

    monkeypatch.delenv("NGRAM_HAL_DEBUG", raising=False)
    args = argparse.Namespace(debug=True)
    assert report_errors(broken, args) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1] == "error: RuntimeError: disk on fire"
    args.debug = False
    assert report_errors(broken, args) == 1
    assert capsys.readouterr().err == ("error: RuntimeError: disk on fire "
                                       "(--debug or NGRAM_HAL_DEBUG=1 shows the traceback)\n")
    args.debug = True
    assert report_errors(mistaken, args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: --x 1: at most 0"


@pytest.mark.parametrize("tool_on_path", [False, True], ids=["not-installed", "cpu-backend"])
def test_sanitizer_needs_the_tool_and_an_nvidia_gpu(tool_on_path, tmp_path, capsys, monkeypatch):
    """--sanitizer refuses in one line where compute-sanitizer is not on PATH, and for a backend
    that does not run on an NVIDIA GPU (here an executable of that name stands in for the tool:
    the backend check comes before it would run)."""
    if tool_on_path:
        tool = tmp_path / "compute-sanitizer"
        tool.write_text("#!/bin/sh\nexit 1\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}")
    code = main(["conformance", "--backend", "cpu", "--sanitizer", "memcheck"])
    captured = capsys.readouterr()
    message = (r"--sanitizer memcheck: compute-sanitizer checks NVIDIA GPUs; backend 'cpu' runs on cpu" if tool_on_path
               else r"--sanitizer memcheck: compute-sanitizer is not on PATH")
    check_one_error_line(code, captured.out, captured.err, message)
