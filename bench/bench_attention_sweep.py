"""A sweep of the default mode's attention launch settings on the calls a step makes, per case.

Each setting is a ``LaunchConfig`` with some attention fields changed (``attn_block_m``,
``attn_tree_block_m``, ``attn_key_bytes``, ``attn_num_stages``, ``attn_warps``, ``attn_programs``;
``--knob`` sets a field's values); every combination of
the values given runs every case: decode, branching trees and chains of 16 nodes at the batches given, one
layer, SmolLM2-135M heads (9 query, 3 KV, 64 wide), bf16, keys bounded by the request table's width
(2048) with contexts of 300-900 keys, as a captured step calls it (:mod:`bench_attention_verify`'s
calls). Every setting must agree with the default's output within bf16 rounding before it is timed
(graph-replayed device time of the kernels alone). The table shows, per case, the default's time,
the fastest setting and its time; the JSON holds every setting's.

    python bench/bench_attention_sweep.py [--batches 1,4,16,64] [--json reports/bench_attention_sweep.json]
    TRITON_INTERPRET=1 python bench/bench_attention_sweep.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention_verify import add_case_options, cases  # noqa: E402
from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal_cuda import CudaBackend  # noqa: E402

KNOBS = {"attn_block_m": (32, 64), "attn_tree_block_m": (16, 32, 64), "attn_key_bytes": (4096, 8192),
         "attn_num_stages": (1, 2, 3), "attn_warps": (4, 8), "attn_programs": (None, 1, 132, 528)}
"""Each field's values; the sweep runs their product (``attn_programs`` 132 and 528: one and four
times an H200's multiprocessors; None: the backend's default, twice)."""


def int_or_none(text: str) -> int | None:
    return None if text == "none" else int(text)


def parse_knobs(items: list[str]) -> dict[str, tuple]:
    """``FIELD=V1,V2`` items over :data:`KNOBS` (``none`` for None)."""
    knobs = dict(KNOBS)
    for item in items:
        name, _, values = item.partition("=")
        if name not in KNOBS:
            raise SystemExit(f"--knob {item!r}: the field must be one of {', '.join(KNOBS)}")
        knobs[name] = tuple(int_or_none(v) for v in values.split(","))
    return knobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_options(parser, "1,4,16,64", 10, 20, "reports/bench_attention_sweep.json")
    parser.add_argument("--knob", action="append", default=[], metavar="FIELD=V1,V2",
                        help=f"values of one field (default {KNOBS}); --quick takes the first two settings")
    args = parser.parse_args(argv)
    knobs = parse_knobs(args.knob)
    base = CudaBackend(device=args.device)
    made = cases(args, base.device)
    width, contexts = made.width, made.contexts
    combos = [dict(zip(knobs, values)) for values in itertools.product(*knobs.values())]
    if args.quick:
        combos = combos[:2]
    default = base.launch
    console = make_console()
    table = make_table(f"attention of one layer, default mode, {len(combos)} settings, keys bounded by {width}, "
                       f"contexts {contexts[0]}-{contexts[1]}: graph-replayed us per call",
                       ["case", "default us", "fastest us", "fastest / default", "fastest setting"],
                       left=["case", "fastest setting"])
    results = []
    for case, batch, tree_size, chain, a in made.calls:
        def run(launch, a=a):
            """A call of the attention under ``launch`` (its layout built under it too)."""
            base.launch = launch
            layout = base.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                           a["q"].shape[0], a["tree_mask"], a["max_kv_len"])

            def call():
                base.launch = launch
                return base.attention(**a, layout=layout)
            return call

        reference = run(default)()
        times = []
        for combo in combos:
            fn = run(replace(default, **combo))
            err = (fn().float() - reference.float()).abs().max().item()
            if err > 0.02:
                raise SystemExit(f"{case}: {combo} differs from the default by {err:.3g}")
            ms = None if args.quick else graph_ms(fn, base.device, args.calls, args.replays)
            times.append({"setting": combo, "us": None if ms is None else 1e3 * ms, "max_abs_diff": err})
        ms = None if args.quick else graph_ms(run(default), base.device, args.calls, args.replays)
        base.launch = default
        us_default = None if ms is None else 1e3 * ms
        timed = [t for t in times if t["us"] is not None]
        best = min(timed, key=lambda t: t["us"]) if timed else None
        results.append({"case": case, "batch": batch, "tree_size": tree_size, "chain": chain, "default_us": us_default,
                        "fastest": best, "settings": times})
        table.add_row(case, "-" if us_default is None else f"{us_default:.2f}",
                      "-" if best is None else f"{best['us']:.2f}",
                      "-" if best is None else f"{best['us'] / us_default:.2f}x",
                      "-" if best is None else ", ".join(f"{k.removeprefix('attn_')}={v}"
                                                         for k, v in best["setting"].items()))
    console.print(table)
    report = {**report_header("ngram-hal/bench-attention-sweep/1", base), "width": width,
              "contexts": list(contexts), "dtype": str(made.dtype).removeprefix("torch."),
              "knobs": {k: list(v) for k, v in knobs.items()}, "results": results}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
