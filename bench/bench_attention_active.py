"""A verify step's attention with every node active against the device drafter's active nodes.

The device drafter marks how many nodes of each chain a verify step checks (its *active* nodes,
:func:`ngram_hal.speculative.lookup.active_nodes`): the root alone with no match, every node
after a match. The attention layout's ``q_active`` leaves the others out, so their tiles walk no
key. This times one layer's attention of chains of 16 nodes, SmolLM2-135M heads (9 query, 3 KV,
64 wide), bf16, keys bounded by 2,048 positions, contexts of 300-900 keys, graph-replayed device
time of the kernels alone, three ways on the same call:

- **all active**: ``q_active`` None (every node, as before it existed);
- **workload mix**: each request's match length drawn from the device drafter's shares of
  positions on the workload's check half (no match 31 %, one token 41 %, longer 28 %;
  ``bench/bench_active_replay.py``), its active nodes from :func:`active_nodes`;
- **no match anywhere**: every request at its root alone (the floor: an open-ended batch).

The default mode and the batch-invariant mode, at batch 1, 16 and 64. The active rows must equal
the all-active call's bit for bit before anything is timed.

    python bench/bench_attention_active.py [--json reports/bench_attention_active.json]
    TRITON_INTERPRET=1 python bench/bench_attention_active.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal.speculative.lookup import active_nodes  # noqa: E402
from ngram_hal_conformance.test_attention import attention_call  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

MIX = ((0, 0.31), (1, 0.41), (2, 0.28))
"""(match length, share of positions): no match, one token, longer."""
SETTINGS = ("all active", "workload mix", "no match anywhere")


def active_counts(rng: random.Random, batch: int, tree_size: int, setting: str) -> list[int] | None:
    """Each request's active nodes under ``setting`` (None: no ``q_active``)."""
    if setting == "all active":
        return None
    if setting == "no match anywhere":
        return [1] * batch
    lengths, shares = zip(*MIX)
    return active_nodes(torch.tensor(rng.choices(lengths, weights=shares, k=batch)), tree_size).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tree-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=30, help="calls per captured graph (a step's layers)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="small shapes, agreement only")
    parser.add_argument("--json", default="reports/bench_attention_active.json")
    args = parser.parse_args(argv)
    backend = CudaBackend(device=args.device)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    width, contexts = (300, (20, 60)) if args.quick else (2048, (300, 900))
    batches = [3] if args.quick else [int(b) for b in args.batches.split(",")]
    n = args.tree_size
    console = make_console()
    table = make_table(f"attention of one layer, chains of {n}, keys bounded by {width}: graph-replayed us per call",
                       ["case", *SETTINGS, "mix / all", "mean active nodes (mix)"], left=["case"])
    results = []
    for invariant in (False, True):
        for batch in batches:
            rng = random.Random(batch)
            kv_lens = [rng.randint(*contexts) for _ in range(batch)]
            a = attention_call(rng, backend.device, dtype, kv_lens=kv_lens, q_lens=[n] * batch, heads=(9, 3),
                               head_dim=64, trees=[list(range(-1, n - 1))] * batch,
                               extra_cols=width - max(kv_lens)).args
            a["max_kv_len"] = width
            calls, counts = {}, {}
            for setting in SETTINGS:
                counts[setting] = active_counts(rng, batch, n, setting)
                q_active = None if counts[setting] is None else torch.tensor(counts[setting], device=backend.device)
                layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                                  a["q"].shape[0], a["tree_mask"], width, invariant, q_active)
                calls[setting] = lambda layout=layout: backend.attention(**a, layout=layout)
            full = calls["all active"]()
            for setting in SETTINGS[1:]:
                rows = torch.cat([torch.arange(n) < k for k in counts[setting]]).to(backend.device)
                got = calls[setting]()
                if not (torch.equal(got[rows], full[rows]) and bool((got[~rows] == 0).all())):
                    raise SystemExit(f"batch {batch}, {setting}: the active rows differ from every node's call")
            us = {s: None if args.quick else 1e3 * graph_ms(fn, backend.device, args.calls, args.replays)
                  for s, fn in calls.items()}
            ratio = None if args.quick else us["workload mix"] / us["all active"]
            mean = sum(counts["workload mix"]) / batch
            case = f"{'invariant' if invariant else 'default'} B={batch}"
            results.append({"case": case, "batch": batch, "invariant": invariant, "tree_size": n, "us": us,
                            "mix_over_all": ratio, "active_nodes_mix": counts["workload mix"]})
            table.add_row(case, *("-" if us[s] is None else f"{us[s]:.2f}" for s in SETTINGS),
                          "-" if ratio is None else f"{ratio:.2f}x", f"{mean:.1f}")
    console.print(table)
    report = {**report_header("ngram-hal/bench-attention-active/1", backend), "width": width,
              "contexts": list(contexts), "dtype": str(dtype).removeprefix("torch."),
              "mix": [{"match_length": m, "share": s} for m, s in MIX], "results": results}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
