"""Run an ``ngram-hal`` command with Triton's compiler counted: each compile is printed to stderr
as ``COMPILE <seconds since start> <seconds it took> <kernel>``, and a summary by kernel at the end.

A compile that starts after the command's "one-time work done" line happened inside the timed
region, which is what a user's first run must not pay. Usage::

    python bench/count_compiles.py run --prompts bench/data/workload-check.jsonl --compare --quiet

(the arguments are ``ngram-hal``'s). Needs Triton; on a GPU, where kernels compile.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import triton
import triton.compiler.compiler as compiler

START = time.perf_counter()
COUNTS: Counter[str] = Counter()


def _counted(compile_fn):
    def compile_and_log(src, *args, **kwargs):
        began = time.perf_counter()
        out = compile_fn(src, *args, **kwargs)
        name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
        COUNTS[name] += 1
        print(f"COMPILE {began - START:8.2f} {time.perf_counter() - began:5.2f} {name}", file=sys.stderr, flush=True)
        return out
    return compile_and_log


if __name__ == "__main__":
    # Before any kernel module is imported: a Triton kernel binds the compile function when made.
    compiler.compile = triton.compiler.compile = _counted(compiler.compile)
    from ngram_hal.cli import main

    try:
        rc = main(sys.argv[1:])
    finally:
        for name, n in COUNTS.most_common():
            print(f"compiles {n:4d} {name}", file=sys.stderr)
    sys.exit(rc)
