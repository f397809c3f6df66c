"""What every ``ngram-hal`` command shares: one-line errors with their exit codes, the parser
that exits 2 on a bad option, the checked, atomic writing of reports, and ratios of rates."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ..files import WriteError, check_writable, write_atomic
from ..matrix import first_line

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


def error_line(exc: BaseException) -> str:
    """The first line of an exception's message (a KeyError's without its quotes)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return first_line(text) or type(exc).__name__


def ratio(a: float, b: float) -> float | None:
    """``a / b``, or None where ``b`` is 0 (a speedup against a run that made nothing)."""
    return a / b if b else None


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


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
