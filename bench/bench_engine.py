"""Engine benchmark: overlap on vs off, speculation on/off/auto, batch sizes, memory.

The same measurement as ``ngram-hal bench`` (see :func:`ngram_hal.engine.commands.bench_command`),
runnable from a checkout:

    python bench/bench_engine.py --threads 1 --max-new-tokens 48 --requests 4 --batch-sizes 1
    python bench/bench_engine.py --backend cpu --device cuda      # the overlap loop on a GPU

Per run: tokens/s, tokens per verify step, wall time per decode step, the host work done on a
step's results per step, split into the part hidden behind the next step ("hidden": done after
the next step was enqueued) and the part on the critical path, the time blocked waiting for the
device, speedups against plain decode without overlap, and whether the tokens are identical.
JSON (default reports/bench_engine.json) adds the KV cache bytes and the peak RSS.
"""

from __future__ import annotations

import argparse
import sys

from ngram_hal.engine.commands import add_bench_arguments, bench_command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return bench_command(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
