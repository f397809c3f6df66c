"""The greedy token of each row of logits: the engine's two-pass Triton argmax against torch's.

Per vocabulary and row count, bfloat16 logits: torch as the model ran it before (the logits
widened to float32, then ``argmax``), torch's ``argmax`` on the bfloat16 logits, and
:func:`ngram_hal.kernels.gpu.argmax.argmax` launched one after another and launched early
(programmatic dependent launch, sm_90 and later). All must give the same tokens before anything
is timed; graph-replayed device time per call.

    python bench/bench_argmax.py [--vocabs 49152,128256] [--rows 1,16,64] [--json reports/bench_argmax.json]
    TRITON_INTERPRET=1 python bench/bench_argmax.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.kernels.gpu.argmax import argmax  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

SETTINGS = ("torch, float32 copy", "torch", "ours", "ours, launched early")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocabs", type=int_list, default=[49152, 128256], metavar="V,...")
    parser.add_argument("--rows", type=int_list, default=[1, 16, 64], metavar="K,...")
    parser.add_argument("--calls", type=int, default=30, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="small shapes, agreement only")
    parser.add_argument("--json", default="reports/bench_argmax.json")
    args = parser.parse_args(argv)
    backend = CudaBackend(device=args.device)
    device = backend.device
    early = backend.launch.pdl
    vocabs, rows = ([1000, 9000], [1, 3]) if args.quick else (args.vocabs, args.rows)
    console = make_console()
    table = make_table("greedy tokens of bfloat16 logits: graph-replayed us per call",
                       ["V", "rows", *SETTINGS, "ours / torch, float32 copy"], left=[])
    results = []
    for vocab in vocabs:
        for k in rows:
            logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(vocab + k)).to(torch.bfloat16)
            logits = logits.to(device)
            calls = {SETTINGS[0]: lambda: logits.float().argmax(-1), SETTINGS[1]: lambda: logits.argmax(-1),
                     SETTINGS[2]: lambda: argmax(logits)}
            if early:
                calls[SETTINGS[3]] = lambda: argmax(logits, pdl=True)
            want = calls[SETTINGS[0]]()
            for name, fn in calls.items():
                if not torch.equal(fn(), want):
                    raise SystemExit(f"V={vocab}, {k} rows: '{name}' gives other tokens than torch")
            us = {name: None if args.quick else graph_ms(fn, device, args.calls, args.replays)
                  for name, fn in calls.items()}
            us = {name: None if us.get(name) is None else 1e3 * us[name] for name in SETTINGS}
            ratio = None if us["ours"] is None else us["ours"] / us[SETTINGS[0]]
            results.append({"vocab": vocab, "rows": k, "us": us, "ours_over_torch_float32": ratio})
            table.add_row(str(vocab), str(k), *("-" if us[n] is None else f"{us[n]:.2f}" for n in SETTINGS),
                          "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    write_report(args.json, {**report_header("ngram-hal/bench-argmax/1", backend), "results": results}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
