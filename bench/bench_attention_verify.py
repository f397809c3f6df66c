"""A speculative step's attention in its captured shape: the default mode against the batch-invariant
mode, and the invariant mode's programs per tile.

A captured step bounds every request's keys by the request table's width (2048 positions, the
engine's default), while the contexts hold a few hundred. In the batch-invariant mode the key
splits sit at fixed positions (``LaunchConfig.attn_invariant_keys`` each), so the bound makes 16 of
them, most past every context. The settings, each a ``cuda`` backend timed on the same calls, one
layer, SmolLM2-135M heads (9 query, 3 KV, 64 wide), bf16, graph-replayed device time of the kernels
alone (the layout is built once, as a step builds it for all its layers):

- **default**: the default mode (the request's own keys shared evenly by the splits);
- **invariant, one per split**: the batch-invariant mode, one program per split (empty ones too);
- **invariant, fill 1**: its splits taken in as many programs as fill the device once
  (``LaunchConfig.attn_programs``), each program every so-many-th split;
- **invariant**: the mode as it runs: where a call's tiles x heads fill the device
  ``attn_invariant_fold`` (2) times over, one program per tile and head walks every split and folds
  their results as it goes (no merge launch), else the splits are taken in programs that fill the
  device ``attn_invariant_fill`` times over;
- **invariant, never folded** / **always folded**: the splits taken in parallel and merged at
  every batch (``attn_invariant_fold`` None), or walked and folded by one program per tile and head
  at every batch (``attn_programs`` 1, so any call fills the device);
- **invariant, 64 / 256 keys**: the mode with splits of 64 or 256 keys (``attn_invariant_keys``;
  other bits than 128);
- **default, 4x programs**: the default mode splitting the keys for four times as many programs;
- **invariant, 64-row tiles**: the mode with taller tiles (``attn_invariant_block_m``; other bits
  than one query's heads where the height changes the products' instructions), which hold more of a
  tree's nodes: fewer tiles read the keys before the tree;
- **invariant, 64-key steps**: the mode reading 64 keys a step of its key loop (``attn_key_bytes``
  4,096: two steps a 128-key split; other bits), as it did before its steps took a decode step's
  128.

The invariant settings that keep the splits (:data:`SAME_BITS`) must give the same bits, and the
others the same values within bf16 rounding, before anything is timed. Cases: decode and random branching trees of 16 nodes at
batch 1, 16 and 64, contexts drawn from 300-900 keys, and chains of 16 nodes (the device
drafter's drafts), which the default mode verifies under their tree mask and the batch-invariant
mode, as the model runs it, as a causal extend.

    python bench/bench_attention_verify.py [--json reports/bench_attention_verify.json]
    TRITON_INTERPRET=1 python bench/bench_attention_verify.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal.kernels.triton.launch import num_programs_to_fill  # noqa: E402
from ngram_hal_conformance.test_attention import attention_call  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

WIDTH = 2048
SETTINGS = ("default", "invariant, one per split", "invariant, fill 1", "invariant", "invariant, never folded",
            "invariant, always folded", "invariant, 64 keys", "invariant, 256 keys", "default, 4x programs",
            "invariant, 64-row tiles", "invariant, 64-key steps")
SAME_BITS = SETTINGS[1:6]
"""The settings that take the same splits in other programs: bit for bit the same results."""


def branching_tree(rng: random.Random, size: int) -> list[int]:
    """Parents of a draft tree of ``size`` nodes: mostly a chain, some nodes branching off earlier."""
    return [-1] + [i - 1 if rng.random() < 0.6 else rng.randrange(i) for i in range(1, size)]


def call_args(batch: int, tree_size: int, device, dtype, seed: int, width: int, contexts: tuple[int, int],
              chain: bool = False) -> dict:
    """One layer's attention call: ``batch`` requests of ``tree_size`` queries (1: decode; more: a
    branching tree, or a chain with ``chain``), keys bounded by ``width``."""
    rng = random.Random(seed)
    kv_lens = [rng.randint(*contexts) for _ in range(batch)]
    trees = None
    if tree_size > 1:
        trees = [list(range(-1, tree_size - 1)) if chain else branching_tree(rng, tree_size) for _ in range(batch)]
    call = attention_call(rng, device, dtype, kv_lens=kv_lens, q_lens=[tree_size] * batch, heads=(9, 3),
                          head_dim=64, trees=trees, extra_cols=width - max(kv_lens))
    return {**call.args, "max_kv_len": width}


@dataclass
class Cases:
    """The calls both attention benchmarks time: the dtype, the keys' bound and contexts, and per
    case its name, batch, tree size, whether the tree is a chain, and call arguments
    (:func:`call_args`)."""

    dtype: torch.dtype
    width: int
    contexts: tuple[int, int]
    calls: list[tuple[str, int, int, bool, dict]]


def add_case_options(parser: argparse.ArgumentParser, batches: str, calls: int, replays: int, json: str) -> None:
    """The options of the cases and their timing (defaults as given)."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--tree-sizes", default="1,16", metavar="D,...", help="queries per request (1: decode)")
    parser.add_argument("--calls", type=int, default=calls, help="calls per captured graph (a step's layers)")
    parser.add_argument("--replays", type=int, default=replays)
    parser.add_argument("--quick", action="store_true", help="small shapes, agreement only")
    parser.add_argument("--json", default=json)


def cases(args: argparse.Namespace, device) -> Cases:
    """Every batch x tree size of ``args``, a tree size above 1 as a branching tree and as a chain
    (``--quick``: batch 3, short contexts, float32 under the interpreter), its call arguments made on
    ``device``."""
    dtype = torch.float32 if interpreting() else torch.bfloat16
    width, contexts = (300, (20, 60)) if args.quick else (WIDTH, (300, 900))
    batches = [3] if args.quick else [int(b) for b in args.batches.split(",")]
    made = []
    for batch in batches:
        for tree_size in [int(n) for n in args.tree_sizes.split(",")]:
            for chain in (False, True) if tree_size > 1 else (False,):
                kind = "decode" if tree_size == 1 else f"{'chain' if chain else 'tree'} of {tree_size}"
                made.append((f"{kind} B={batch}", batch, tree_size, chain,
                             call_args(batch, tree_size, device, dtype, batch * 100 + tree_size, width, contexts,
                                       chain)))
    return Cases(dtype, width, contexts, made)


def backends(device: str) -> dict[str, tuple[CudaBackend, bool]]:
    """Each setting's backend and whether it runs the batch-invariant mode."""
    base = CudaBackend(device=device)
    fill = num_programs_to_fill(base.device)
    overrides = ({}, {"attn_programs": 1 << 20}, {"attn_invariant_fill": 1}, {}, {"attn_invariant_fold": None},
                 {"attn_programs": 1}, {"attn_invariant_keys": 64}, {"attn_invariant_keys": 256},
                 {"attn_programs": 4 * fill}, {"attn_invariant_block_m": 64}, {"attn_key_bytes": 4096})
    made = {}
    for name, changes in zip(SETTINGS, overrides):
        backend = base if name == "default" else CudaBackend(device=device)
        backend.launch = replace(base.launch, **changes)
        made[name] = (backend, name.startswith("invariant"))
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_options(parser, "1,16,64", 30, 50, "reports/bench_attention_verify.json")
    args = parser.parse_args(argv)
    settings = backends(args.device)
    first = settings["default"][0]
    made = cases(args, first.device)
    width, contexts = made.width, made.contexts
    console = make_console()
    table = make_table(f"attention of one layer, keys bounded by {width}, contexts {contexts[0]}-{contexts[1]}: "
                       "graph-replayed us per call", ["case", *SETTINGS, "invariant / default"], left=["case"])
    results = []
    for case, batch, tree_size, chain, a in made.calls:
        calls = {}
        for name, (backend, invariant) in settings.items():
            # The model runs a chain in the batch-invariant mode as a causal extend.
            call = {**a, "tree_mask": None} if invariant and chain else a
            layout = backend.attention_layout(call["req_to_token"], call["req_pool_indices"], call["kv_lens"],
                                              call["q_lens"], call["q"].shape[0], call["tree_mask"],
                                              call["max_kv_len"], batch_invariant=invariant)
            calls[name] = lambda b=backend, layout=layout, call=call: b.attention(**call, layout=layout)
        got = {name: fn() for name, fn in calls.items()}
        for name in SAME_BITS[1:]:
            if not torch.equal(got[name], got[SAME_BITS[0]]):
                raise SystemExit(f"{case}: '{name}' and '{SAME_BITS[0]}' differ")
        err = max((got[name].float() - got["invariant"].float()).abs().max().item()
                  for name in SETTINGS if name not in SAME_BITS)
        if err > 0.02:
            raise SystemExit(f"{case}: the default and invariant modes differ by {err:.3g}")
        us = {name: None if args.quick else graph_ms(fn, first.device, args.calls, args.replays)
              for name, fn in calls.items()}
        us = {name: None if ms is None else 1e3 * ms for name, ms in us.items()}
        ratio = None if us["default"] is None else us["invariant"] / us["default"]
        results.append({"case": case, "batch": batch, "tree_size": tree_size, "chain": chain, "us": us,
                        "invariant_over_default": ratio, "max_abs_diff": err})
        table.add_row(case, *("-" if us[n] is None else f"{us[n]:.2f}" for n in SETTINGS),
                      "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    report = {**report_header("ngram-hal/bench-attention-verify/1", first), "width": width,
              "contexts": list(contexts), "dtype": str(made.dtype).removeprefix("torch."),
              "settings": {name: {"attn_programs": b.launch.attn_programs, "batch_invariant": inv,
                                  "attn_invariant_fill": b.launch.attn_invariant_fill,
                                  "attn_invariant_keys": b.launch.attn_invariant_keys,
                                  "attn_invariant_fold": b.launch.attn_invariant_fold,
                                  "attn_invariant_block_m": b.launch.attn_invariant_block_m,
                                  "attn_key_bytes": b.launch.attn_key_bytes}
                           for name, (b, inv) in settings.items()}, "results": results}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
