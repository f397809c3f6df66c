"""Drafting cost per request per decode step, on real text, against two baselines.

A step is what the scheduler asks of a drafter between two verifies: record the tokens committed
at the previous step (``extend``) and build the next draft trees (``draft``) for the whole batch.
B requests, each with a context of C real tokens (even requests Python sources, odd ones
documentation prose; see ``realtext.py``), trees of D nodes. The committed tokens come from a
greedy replay of the true text (``replay.py``), so every drafter runs on its own realistic path.

Side by side in the same run:
  trie    TrieDrafter (shared n-gram corpus, BFS by recency), incremental
  linear  LinearDrafter (prompt lookup, one chain), incremental
  rescan  the textbook prompt lookup: a full rescan of the context for the longest suffix match
          at every step (numpy), one chain

Reports microseconds per request per step: the mean CPU time over steps (it carries the
amortized cost of evicting from a full corpus, and leaves out the time the process sat preempted
on a busy machine) and the median wall time (mean and p90 wall time in the JSON); the prefill
time (recording the prompts); the mean tokens committed per step; rescan/trie and linear/trie
ratios of the CPU means. Also the trie's memory: bytes per node and the corpus's bytes at
capacity.

    python bench/bench_drafting.py [--batch 1 16 64] [--context 1024 8192 32768] [--tree-size 8 16]
                                   [--steps 256] [--json reports/bench_drafting.json]
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, make_console, make_table, peak_rss_bytes, utc_now, write_report  # noqa: E402
from realtext import load_tokens  # noqa: E402
from replay import Replay  # noqa: E402

from ngram_hal.speculative.corpus import Corpus, as_tokens  # noqa: E402
from ngram_hal.speculative.drafter import DraftBatch, Drafter, LinearDrafter, TrieDrafter, pack_chains  # noqa: E402


class RescanDrafter(Drafter):
    """Prompt lookup by a full rescan of the context at every draft (the usual implementation).

    The longest suffix of up to ``max_ngram`` tokens with an earlier occurrence is found by
    narrowing the positions that match the last token, then the one before it, and so on; the
    latest occurrence wins, and its continuation (periodic past the end) is the chain.
    """

    def __init__(self, max_ngram: int = 8):
        self.max_ngram = max_ngram
        self._buf: dict[Hashable, np.ndarray] = {}
        self._len: dict[Hashable, int] = {}

    def add_request(self, rid, prompt):
        arr = as_tokens("RescanDrafter.add_request", "prompt", prompt)
        self._buf[rid] = np.empty(max(1024, 2 * arr.size), np.int64)
        self._buf[rid][: arr.size] = arr
        self._len[rid] = arr.size

    def extend(self, rid, tokens):
        arr = as_tokens("RescanDrafter.extend", "tokens", tokens)
        n, buf = self._len[rid], self._buf[rid]
        if n + arr.size > buf.size:
            buf = np.concatenate([buf, np.empty(max(buf.size, arr.size), np.int64)])
            self._buf[rid] = buf
        buf[n:n + arr.size] = arr
        self._len[rid] = n + arr.size

    def _match(self, ctx: np.ndarray) -> tuple[int, int]:
        n = ctx.size
        ends = np.flatnonzero(ctx[:-1] == ctx[-1])
        if ends.size == 0:
            return 0, -1
        length = 1
        while length < self.max_ngram and length < n - 1:
            room = ends[ends >= length]
            keep = room[ctx[room - length] == ctx[n - 1 - length]]
            if keep.size == 0:
                break
            ends, length = keep, length + 1
        return length, int(ends[-1])

    def draft(self, rids: Sequence[Hashable], tree_size: int) -> DraftBatch:
        D = tree_size
        tokens = np.empty((len(rids), D), np.int64)
        drafted = np.ones(len(rids), np.int64)
        for b, rid in enumerate(rids):
            ctx = self._buf[rid][: self._len[rid]]
            tokens[b, 0] = ctx[-1]
            length, end = self._match(ctx)
            if length == 0:
                tokens[b, 1:] = ctx[-1]
                continue
            period = ctx.size - 1 - end
            tokens[b, 1:] = ctx[end + 1 + np.arange(D - 1) % period]
            drafted[b] = D
        return pack_chains(tokens, drafted)

    def erase(self, rid):
        del self._buf[rid], self._len[rid]


DRAFTERS = {
    "trie": lambda: TrieDrafter(),
    "linear": lambda: LinearDrafter(),
    "rescan": lambda: RescanDrafter(),
}


def streams_for(batch: int, length: int, code: np.ndarray, prose: np.ndarray) -> list[np.ndarray]:
    """``batch`` windows of ``length`` tokens: even ones from code, odd ones from prose, disjoint."""
    out = []
    for b in range(batch):
        src, i = (code, b // 2) if b % 2 == 0 else (prose, b // 2)
        out.append(src[i * length:(i + 1) * length])
    return out


def run_one(name: str, drafter: Drafter, prefill: float, streams: list[np.ndarray], context: int,
            tree_size: int, steps: int) -> dict:
    """Time ``steps`` decode steps of ``drafter``, which already holds the prompts."""
    replay = Replay(drafter, streams, context, tree_size)
    times, cpu_times, committed = [], [], []
    for _ in range(steps):
        seconds, cpu, done = replay.step()
        times.append(seconds / len(streams) * 1e6)
        cpu_times.append(cpu / len(streams) * 1e6)
        committed.append(float(done.mean()))
    row = {"drafter": name, "batch": len(streams), "context": context, "tree_size": tree_size,
           "steps": steps, "cpu_us_per_request_step": statistics.fmean(cpu_times),
           "us_per_request_step": statistics.fmean(times),
           "us_per_request_step_p50": statistics.median(times),
           "us_per_request_step_p90": float(np.percentile(times, 90)),
           "prefill_s": prefill, "tokens_per_step": statistics.fmean(committed)}
    if isinstance(drafter, TrieDrafter):
        corpus = drafter.corpus
        row.update(trie_nodes=corpus.num_nodes, trie_capacity=corpus.capacity, trie_bytes=corpus.nbytes)
    return row


def warm_up() -> None:
    """Load (or compile) the drafters' kernels before anything is timed."""
    for make in DRAFTERS.values():
        replay = Replay(make(), [np.arange(64) % 7], 32, 4)
        replay.prefill()
        replay.step()


def resident_bytes() -> int | None:
    """The process's resident set size now (Linux), else None."""
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return None
    return int(statm.read_text().split()[1]) * resource.getpagesize()


def memory_at_capacity(capacity: int, tokens: np.ndarray) -> dict:
    """Fill a shared corpus past ``capacity`` nodes with real text: its array bytes, bytes per
    node, and how much the resident set grew while filling it."""
    before = resident_bytes()
    corpus = Corpus(capacity=capacity)
    corpus.open("fill", tokens)
    corpus.flush()
    after = resident_bytes()
    return {"capacity": capacity, "live_nodes": corpus.num_nodes, "bytes": corpus.nbytes,
            "bytes_per_node": corpus.bytes_per_node, "tokens_inserted": int(tokens.size),
            "resident_growth_bytes": None if before is None else after - before}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--tree-size", type=int, nargs="+", default=[8, 16], metavar="D")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument("--memory-capacity", type=int, default=1 << 20)
    ap.add_argument("--cache", type=Path, default=Path("reports/cache"))
    ap.add_argument("--json", type=Path, default=Path("reports/bench_drafting.json"))
    args = ap.parse_args(argv)

    length = max(args.context) + args.steps * max(args.tree_size) + max(args.tree_size)
    per_kind = (max(args.batch) + 1) // 2 * length
    code, tokenizer = load_tokens("code", per_kind, args.cache)
    prose, _ = load_tokens("prose", per_kind, args.cache)

    warm_up()
    memory = memory_at_capacity(args.memory_capacity, code[: args.memory_capacity])
    rows = []
    console = make_console()
    for B in args.batch:
        for C in args.context:
            streams = [s[: C + args.steps * max(args.tree_size) + max(args.tree_size)]
                       for s in streams_for(B, length, code, prose)]
            if min(s.size for s in streams) < C + args.steps * max(args.tree_size):
                console.print(f"[yellow]skip B={B} C={C}: not enough text")
                continue
            for name in args.drafters:
                base = DRAFTERS[name]()
                prefill = Replay(base, streams, C, min(args.tree_size)).prefill()
                for D in args.tree_size:
                    row = run_one(name, copy.deepcopy(base), prefill, streams, C, D, args.steps)
                    rows.append(row)
                    console.log(f"{name:6s} B={B:3d} C={C:6d} D={D:2d} "
                                f"{row['cpu_us_per_request_step']:9.1f} us/req/step (CPU)")

    table = make_table("Drafting cost per request per step, us (mean CPU time / median wall time); "
                       f"tokens: {tokenizer}",
                       ("B", "context", "D", "trie", "linear", "rescan", "rescan/trie", "linear/trie",
                        "tok/step trie", "tok/step linear"))
    by_key = {(r["batch"], r["context"], r["tree_size"], r["drafter"]): r for r in rows}
    for B in args.batch:
        for C in args.context:
            for D in args.tree_size:
                got = {n: by_key.get((B, C, D, n)) for n in DRAFTERS}
                if not any(got.values()):
                    continue
                trie, linear = got["trie"], got["linear"]

                def us(r):
                    return f"{r['cpu_us_per_request_step']:.1f} / {r['us_per_request_step_p50']:.1f}" if r else "-"

                def ratio(r):
                    return (f"{r['cpu_us_per_request_step'] / trie['cpu_us_per_request_step']:.2f}x"
                            if r and trie else "-")

                table.add_row(str(B), str(C), str(D), us(trie), us(linear), us(got["rescan"]),
                              ratio(got["rescan"]), ratio(linear),
                              f"{trie['tokens_per_step']:.2f}" if trie else "-",
                              f"{linear['tokens_per_step']:.2f}" if linear else "-")
    console.print(table)
    grown = memory["resident_growth_bytes"]
    console.print(f"trie memory: {memory['bytes_per_node']:.1f} bytes/node; "
                  f"{memory['bytes'] / 2**20:.1f} MiB at capacity {memory['capacity']} "
                  f"({memory['live_nodes']} live nodes after {memory['tokens_inserted']} tokens; "
                  f"resident set grew {'?' if grown is None else f'{grown / 2**20:.1f} MiB'})")

    report = {
        "bench": "drafting",
        "time": utc_now(),
        "machine": machine(numpy=np.__version__, torch=torch.__version__),
        "tokenizer": tokenizer,
        "steps": args.steps,
        "rows": rows,
        "memory": memory,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
    }
    write_report(args.json, report, console)
    return report


if __name__ == "__main__":
    main()
