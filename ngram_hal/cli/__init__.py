"""The ``ngram-hal`` command line.

``ngram-hal backends``     registered backends, their availability and why not
``ngram-hal conformance``  run the conformance suite on one backend (JUnit + JSON report)
``ngram-hal matrix``       merge conformance JSON reports into one backend x test matrix
``ngram-hal run|bench``    the engine's commands (:mod:`ngram_hal.cli.run`, :mod:`ngram_hal.cli.bench`)

Every command reports a bad option, input file or environment the same way: ``error: ...`` on
one line naming what was wrong and what is allowed, a non-zero exit code (2 for a bad option or
input, 1 otherwise) and no traceback; ``--debug`` or ``NGRAM_HAL_DEBUG=1`` shows the traceback
as well, with the same exit code. Report destinations are checked before anything runs, and
reports are written atomically (:mod:`ngram_hal.files`).
"""

from __future__ import annotations

import argparse

from ..options import POSITIVE_INT
from . import bench, run, sanitizer
from .common import DEBUG_ENV, CommandError, Parser, report_errors
from .hal import backends_command, conformance_command, matrix_command

__all__ = ["CommandError", "build_parser", "main", "report_errors"]


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
    p.add_argument("--tiers", metavar="TIER[,TIER...]", help="only the tests of these tiers")
    p.add_argument("--scale", choices=("auto", "reduced", "full"),
                   help="sizes of the scale tier (default auto: full on an accelerator, reduced on the CPU)")
    p.add_argument("--sanitizer", choices=sanitizer.TOOLS,
                   help="run the suite under NVIDIA's compute-sanitizer with this tool (NVIDIA GPUs); the "
                        "report records the errors it found")
    p.set_defaults(func=conformance_command)

    p = sub.add_parser("matrix", parents=[debug], help="merge conformance JSON reports into one backend x test matrix")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--markdown", metavar="PATH", help="write the matrix as markdown")
    p.add_argument("--html", metavar="PATH", help="write the matrix as a self-contained HTML page")
    p.set_defaults(func=matrix_command)

    p = sub.add_parser("run", parents=[debug], help="generate text with the engine")
    run.add_run_arguments(p)
    p.set_defaults(func=run.run_command)
    p = sub.add_parser("bench", parents=[debug], help="benchmark the engine")
    bench.add_bench_arguments(p)
    p.set_defaults(func=bench.bench_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ngram-hal`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return report_errors(args.func, args)

