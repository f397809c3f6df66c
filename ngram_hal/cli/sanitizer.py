"""The conformance suite under NVIDIA's compute-sanitizer (``ngram-hal conformance --sanitizer``).

The suite runs in a child process started by ``compute-sanitizer --tool TOOL``. PyTorch's caching
allocator is switched off there (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): otherwise a kernel that
writes past its tensor lands in memory the cache still owns and memcheck cannot see it. The
sanitizer's log gives the error count that goes into the report (:func:`read_log`).

What each tool sees: ``memcheck`` out-of-bounds and misaligned accesses to global and shared
memory and device-side errors; ``racecheck`` hazards between threads of one block on shared
memory (not races on global memory, such as two programs writing one KV row); ``initcheck``
reads of uninitialised global memory; ``synccheck`` invalid barrier use.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
EXECUTABLE = "compute-sanitizer"
ERROR_EXIT_CODE = 86
"""The exit code compute-sanitizer returns when it reported an error (the suite's own otherwise)."""
FIRST_ERRORS = 20
# memcheck, initcheck, synccheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards
# displayed (0 errors, 0 warnings)".
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*\((\d+) errors?")


def find() -> str | None:
    """The compute-sanitizer executable on PATH, or None."""
    return shutil.which(EXECUTABLE)


def command(executable: str, tool: str, log: Path) -> list[str]:
    """The argv prefix that runs a program under ``tool``, its report going to ``log``."""
    return [executable, "--tool", tool, "--log-file", str(log), "--error-exitcode", str(ERROR_EXIT_CODE),
            "--print-limit", "100"]


def environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with PyTorch's CUDA caching allocator off."""
    return {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}


def version(executable: str) -> str | None:
    """compute-sanitizer's version line (``"2025.3.1"``), or None when it does not say."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"Version (\S+)", out)
    return found.group(1) if found else None


def read_log(log: Path) -> tuple[int | None, list[str]]:
    """``(errors, first error lines)`` from a sanitizer log: the error count of its last summary
    line (None when there is none) and up to :data:`FIRST_ERRORS` lines of its reports."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None, []
    counts = [int(m.group(1) or m.group(2)) for m in map(_SUMMARY.search, lines) if m]
    reports = [text for text in (line.removeprefix("=========").strip() for line in lines
                                 if line.startswith("=========") and not _SUMMARY.search(line))
               if text and text != "COMPUTE-SANITIZER"]
    return (counts[-1] if counts else None), reports[:FIRST_ERRORS]
