"""The ``cuda`` backend's Triton kernels against the reference backend on the same device.

Every op runs through ``CudaBackend`` (the Triton kernels) and through ``CpuBackend(device=...)``
(the reference's torch ops on the same GPU) on the same inputs; the two must agree before either
is timed. Two times per op: **eager** (the median of ``--repeats`` host-timed calls, each
followed by a synchronize: launch work included) and **graph** (``--graph-calls`` calls captured
in one CUDA graph, replayed ``--graph-replays`` times between CUDA events: device time per call).

Op groups (``--groups``):

- ``index``: ``alloc_extend`` (page sizes 1 and 16), ``assign_req_to_token``, ``gather_cache_locs``
  and ``accepted_kv_moves`` for one speculative decode step of ``--batch`` requests (tree size D,
  ``--tree-size``; contexts around ``--context``). Target: alloc/assign/gather <= 10 us of graph time.
- ``kv``: ``store_kv`` of the step's B*D rows into one layer.
- ``attention``: one layer's paged attention, SmolLM2-135M heads (9 query, 3 KV, 64 wide) and
  Llama-8B heads (32, 8, 128), bf16: decode of 1 and 16 requests at contexts 512, 4K and 32K and
  tree verify of D = 8 and 16 nodes at 4K, against SDPA on the same K/V already gathered
  contiguous per request (a lower bound for any paged kernel). Target: graph time within 1.5x of
  SDPA. A few cases also sweep the kernel's launch settings (keys per step, warps, pipeline
  stages, programs per multiprocessor) and report the best.
- ``move``: ``move_kv`` at (layers, kv heads, head dim) = (30, 3, 64), (32, 8, 128), (80, 8, 128),
  bf16, N = 8 ... 16384 pairs (random sources over the slot range, distinct destinations, so
  sources often are other pairs' destinations), against also (a) per-layer torch indexing
  (``k[l, dst] = k[l, src]`` for each layer, K and V; the right side is gathered before the write,
  so overlapping sets are safe) and (b) the copy floor: the bytes moved, read and written, over
  the device-to-device copy bandwidth measured in this run. Targets: >= 20x faster than per-layer
  torch eager for N <= 512; graph time within 3x of the floor for N >= 256; never slower than torch.

More groups join ``GROUPS`` as functions of ``(ctx) -> None`` that add rows and targets to ``ctx``.

    python bench/bench_kernels.py [--device cuda] [--groups index,kv,move] [--json reports/bench_kernels.json]
    TRITON_INTERPRET=1 python bench/bench_kernels.py --device cpu --quick   # a smoke run, no graphs
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_reference_ops import Scene  # noqa: E402
from common import (graph_ms, make_console, make_table, median_ms,  # noqa: E402
                    report_header, write_report)

from ngram_hal.backend import Backend  # noqa: E402
from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

I64 = torch.int64
MOVE_SHAPES = ((30, 3, 64), (32, 8, 128), (80, 8, 128))
MOVE_PAIRS = (8, 64, 256, 512, 4096, 16384)
QUICK_MOVE_SHAPES = ((2, 2, 8),)
QUICK_MOVE_PAIRS = (8, 600)


@dataclass
class Context:
    """What every op group needs: the two backends, the timers' settings, and the rows it adds."""

    args: argparse.Namespace
    cuda: Backend
    ref: Backend
    rows: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    copy_bandwidth: float | None = None

    @property
    def device(self) -> torch.device:
        return self.cuda.device

    def _scale(self, fn) -> float:
        """How many of the configured repeats fit ``--budget-ms`` (1 when they all do), from one call."""
        self.cuda.synchronize()
        start = time.perf_counter()
        fn()
        self.cuda.synchronize()
        once_ms = 1e3 * (time.perf_counter() - start)
        total_ms = once_ms * (self.args.repeats + self.args.graph_calls * (self.args.graph_replays + 2))
        return min(1.0, self.args.budget_ms / max(total_ms, 1e-9))

    def eager_us(self, fn) -> float:
        repeats = max(3, int(self.args.repeats * self._scale(fn)))
        return 1e3 * median_ms(fn, self.cuda.synchronize, repeats, self.args.warmup)

    def graph_us(self, fn) -> float | None:
        scale = self._scale(fn)
        calls, replays = max(2, int(self.args.graph_calls * scale)), max(2, int(self.args.graph_replays * scale ** 0.5))
        ms = graph_ms(fn, self.device, calls, replays, self.args.warmup)
        return None if ms is None else 1e3 * ms

    def time_pair(self, group: str, op: str, case: str, cuda_fn, ref_fn, **extra) -> dict:
        """Eager and graph times of the cuda op and the reference op; adds and returns the row."""
        row = {"group": group, "op": op, "case": case,
               "cuda_eager_us": self.eager_us(cuda_fn), "ref_eager_us": self.eager_us(ref_fn),
               "cuda_graph_us": self.graph_us(cuda_fn), "ref_graph_us": self.graph_us(ref_fn), **extra}
        self.rows.append(row)
        return row

    def target(self, what: str, measured: float | None, limit: float, higher_is_better: bool) -> None:
        met = None if measured is None else (measured >= limit if higher_is_better else measured <= limit)
        self.targets.append({"target": what, "measured": measured, "limit": limit,
                             "higher_is_better": higher_is_better, "met": met})


def same(what: str, got, want) -> None:
    """Stop the run unless the two backends agree: integers exactly, K/V rows bit for bit."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        if a.is_floating_point():
            bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
            a, b = a.view(bits), b.view(bits)
        if not torch.equal(a, b):
            raise SystemExit(f"{what}: the cuda backend and the reference disagree")


# ------------------------------------------------------------------ index and KV-row ops


def bench_index(ctx: Context) -> None:
    args = ctx.args
    rng = random.Random(args.seed)
    B, D = args.batch, args.tree_size
    step = f"B={B}, D={D}"
    for page_size in (1, 16):
        scene = Scene(ctx.ref, args, page_size, rng)
        inputs = scene.extend_inputs()
        same("alloc_extend", ctx.cuda.alloc_extend(*inputs), ctx.ref.alloc_extend(*inputs))
        row = ctx.time_pair("index", "alloc_extend", f"{step}, +{3 * D} slots each, page {page_size}",
                            lambda: ctx.cuda.alloc_extend(*inputs), lambda: ctx.ref.alloc_extend(*inputs))
        ctx.target(f"alloc_extend page {page_size}, B={B}: graph us <= 10", row["cuda_graph_us"], 10, False)

    scene = Scene(ctx.ref, args, 1, rng)
    table, rows, start = scene.pool.req_to_token, scene.rows, scene.seq_lens
    end, n = start + 2 * D, B * 2 * D
    locs = ctx.ref.gather_cache_locs(table, rows, start, end, n).flip(0).contiguous()
    twin = table.clone()
    ctx.cuda.assign_req_to_token(table, rows, start, end, locs)
    ctx.ref.assign_req_to_token(twin, rows, start, end, locs)
    same("assign_req_to_token", table, twin)
    row = ctx.time_pair("index", "assign_req_to_token", f"{step}, {2 * D} locs each",
                        lambda: ctx.cuda.assign_req_to_token(table, rows, start, end, locs),
                        lambda: ctx.ref.assign_req_to_token(twin, rows, start, end, locs))
    ctx.target(f"assign_req_to_token B={B}: graph us <= 10", row["cuda_graph_us"], 10, False)

    gather = (table, rows, start, end, n)
    same("gather_cache_locs", ctx.cuda.gather_cache_locs(*gather), ctx.ref.gather_cache_locs(*gather))
    row = ctx.time_pair("index", "gather_cache_locs", f"{step}, {2 * D} locs each",
                        lambda: ctx.cuda.gather_cache_locs(*gather), lambda: ctx.ref.gather_cache_locs(*gather))
    ctx.target(f"gather_cache_locs B={B}: graph us <= 10", row["cuda_graph_us"], 10, False)

    acc = (scene.out_cache_loc, scene.accept_index, table, rows, scene.seq_lens)
    same("accepted_kv_moves", ctx.cuda.accepted_kv_moves(*acc), ctx.ref.accepted_kv_moves(*acc))
    ctx.time_pair("index", "accepted_kv_moves", step, lambda: ctx.cuda.accepted_kv_moves(*acc),
                  lambda: ctx.ref.accepted_kv_moves(*acc))


def bench_kv(ctx: Context) -> None:
    args = ctx.args
    L, H, d = args.store_shape
    n = args.batch * args.tree_size
    gen = torch.Generator(device=ctx.device).manual_seed(args.seed)
    locs = torch.randperm(2 * n, generator=gen, device=ctx.device)[:n]
    k = torch.randn((n, H, d), generator=gen, device=ctx.device).to(torch.bfloat16)
    v = torch.randn((n, H, d), generator=gen, device=ctx.device).to(torch.bfloat16)
    mine, ref = (KVCache(L, 2 * n, H, d, torch.bfloat16, ctx.device) for _ in range(2))
    layer = L // 2
    ctx.cuda.store_kv(mine, layer, locs, k, v)
    ctx.ref.store_kv(ref, layer, locs, k, v)
    same("store_kv", (mine.k[:, :-1], mine.v[:, :-1]), (ref.k[:, :-1], ref.v[:, :-1]))
    ctx.time_pair("kv", "store_kv", f"{n} rows into 1 of {L} layers, H={H}, d={d}, bf16",
                  lambda: ctx.cuda.store_kv(mine, layer, locs, k, v), lambda: ctx.ref.store_kv(ref, layer, locs, k, v))


# ------------------------------------------------------------------ move_kv


def per_layer_torch(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The baseline: one gather and one scatter per layer, K and V (the gather copies, so sources
    are read before any destination is written)."""
    for cache in (kv.k, kv.v):
        for layer in range(kv.num_layers):
            cache[layer, dst] = cache[layer, src]


def bench_move(ctx: Context) -> None:
    args = ctx.args
    shapes, counts = (QUICK_MOVE_SHAPES, QUICK_MOVE_PAIRS) if args.quick else (MOVE_SHAPES, MOVE_PAIRS)
    bandwidth = ctx.copy_bandwidth = ctx.cuda.runtime.copy_bandwidth(args.copy_bytes)
    gen = torch.Generator(device=ctx.device).manual_seed(args.seed)
    for L, H, d in shapes:
        S = 2 * max(counts)
        kv = KVCache(L, S, H, d, torch.bfloat16, ctx.device)
        kv.k.normal_(generator=gen)
        kv.v.normal_(generator=gen)
        for N in counts:
            dst = torch.randperm(S, generator=gen, device=ctx.device)[:N]
            src = torch.randint(0, S, (N,), generator=gen, device=ctx.device)
            want_k, want_v = kv.k[:, src], kv.v[:, src]
            ctx.cuda.move_kv(kv, src, dst)
            same(f"move_kv {L}x{H}x{d} N={N}", (kv.k[:, dst], kv.v[:, dst]), (want_k, want_v))
            del want_k, want_v
            moved = N * KVCache.bytes_per_slot(L, H, d, torch.bfloat16)
            floor_us = 1e6 * 2 * moved / bandwidth
            torch_eager = ctx.eager_us(lambda: per_layer_torch(kv, src, dst))
            torch_graph = ctx.graph_us(lambda: per_layer_torch(kv, src, dst))
            row = ctx.time_pair("move", "move_kv", f"L={L} H={H} d={d} bf16, N={N}",
                                lambda: ctx.cuda.move_kv(kv, src, dst), lambda: ctx.ref.move_kv(kv, src, dst),
                                pairs=N, bytes_moved=moved, floor_us=floor_us, torch_eager_us=torch_eager,
                                torch_graph_us=torch_graph)
            label = f"move_kv {L}x{H}x{d} N={N}"
            eager_x = torch_eager / row["cuda_eager_us"]
            if N <= 512:
                ctx.target(f"{label}: eager speedup vs per-layer torch >= 20x", eager_x, 20, True)
            else:
                ctx.target(f"{label}: eager speedup vs per-layer torch >= 1x", eager_x, 1, True)
            if row["cuda_graph_us"] is not None:
                ctx.target(f"{label}: graph speedup vs per-layer torch >= 1x", torch_graph / row["cuda_graph_us"],
                           1, True)
                if N >= 256:
                    ctx.target(f"{label}: graph time / copy floor <= 3x", row["cuda_graph_us"] / floor_us, 3, False)
        del kv


# ------------------------------------------------------------------ attention

ATTN_HEADS = {"SmolLM2-135M": (9, 3, 64), "Llama-8B": (32, 8, 128)}
ATTN_CASES = ([("decode", B, T, 1) for B in (1, 16) for T in (512, 4096, 32768)]
              + [("tree", B, 4096, D) for B in (1, 16) for D in (8, 16)])
QUICK_ATTN_HEADS = {"tiny": (4, 2, 16)}
QUICK_ATTN_CASES = [("decode", 2, 40, 1), ("tree", 2, 40, 4)]
# Launch settings tried on a few cases: (key bytes per step, warps, stages, programs per SM, fewest
# keys per split: None for the default, 256 for four steps of 64 keys, the tree-verify default before
# a tree split like decode).
ATTN_SWEEP = [(kb, w, st, p, None) for kb in (4096, 8192, 16384) for w in (4, 8) for st in (1, 2, 3)
              for p in (2,)] + [(8192, 4, 2, 1, None), (8192, 4, 2, 4, None), (8192, 4, 2, 2, 256)]
ATTN_SWEEP_CASES = {("SmolLM2-135M", "decode", 1, 4096), ("SmolLM2-135M", "decode", 16, 4096),
                    ("SmolLM2-135M", "tree", 1, 4096), ("SmolLM2-135M", "tree", 16, 4096),
                    ("Llama-8B", "decode", 16, 4096), ("Llama-8B", "tree", 16, 4096),
                    ("SmolLM2-135M", "decode", 1, 32768)}


def attention_case(device, heads: tuple[int, int, int], B: int, T: int, n: int, seed: int):
    """One layer of attention for B requests of T cached positions (the last n queried; a random
    tree of n nodes when n > 1), K/V scattered over random slots; and the same K/V gathered
    contiguous per request with the queries and mask laid out for SDPA."""
    Hq, H, d = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    S = B * T
    kv = KVCache(1, S, H, d, torch.bfloat16, device)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    table = torch.randperm(S, generator=gen, device=device).view(B, T).contiguous()
    q = torch.randn((B * n, Hq, d), generator=gen, device=device).to(torch.bfloat16)
    lens = torch.full((B,), T, dtype=I64, device=device)
    tree_mask = None
    visible = None
    if n > 1:
        rng = random.Random(seed)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        tree_mask = mask.to(device).expand(B, n, n).contiguous()
        visible = torch.ones(B, 1, n, T, dtype=torch.bool, device=device)
        visible[:, 0, :, T - n:] = tree_mask
    args = dict(q=q, kv=kv, layer=0, req_to_token=table, req_pool_indices=torch.arange(B, dtype=I64, device=device),
                kv_lens=lens, q_lens=torch.full((B,), n, dtype=I64, device=device),
                sm_scale=d ** -0.5, tree_mask=tree_mask, max_kv_len=T)
    k = kv.k[0, table].transpose(1, 2).contiguous()
    v = kv.v[0, table].transpose(1, 2).contiguous()
    sdpa = dict(query=q.view(B, n, Hq, d).transpose(1, 2).contiguous(), key=k, value=v, attn_mask=visible,
                scale=d ** -0.5)
    return args, sdpa


def sdpa(query, key, value, attn_mask, scale):
    """SDPA over K/V already contiguous per request (grouped-query heads through ``enable_gqa``)."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                                            enable_gqa=True)


def bench_attention(ctx: Context) -> None:
    args = ctx.args
    heads_by_name, cases = (QUICK_ATTN_HEADS, QUICK_ATTN_CASES) if args.quick else (ATTN_HEADS, ATTN_CASES)
    base = ctx.cuda.launch
    for model, heads in heads_by_name.items():
        for kind, B, T, n in cases:
            call, dense = attention_case(ctx.device, heads, B, T, n, args.seed)
            layout = ctx.cuda.attention_layout(call["req_to_token"], call["req_pool_indices"], call["kv_lens"],
                                               call["q_lens"], B * n, call["tree_mask"], T)
            ref_layout = ctx.ref.attention_layout(call["req_to_token"], call["req_pool_indices"], call["kv_lens"],
                                                  call["q_lens"], B * n, call["tree_mask"], T)
            want = sdpa(**dense).transpose(1, 2).reshape(B * n, *call["q"].shape[1:]).float()
            got = ctx.cuda.attention(**call, layout=layout).float()
            err = float((got - want).norm() / want.norm())
            if err > 2e-2:
                raise SystemExit(f"attention {model} {kind} B={B} T={T} n={n}: relative error {err:.3g} vs SDPA")
            sdpa_graph = ctx.graph_us(lambda: sdpa(**dense))
            row = ctx.time_pair("attention", "attention", f"{model} {kind} B={B} ctx={T}" + (f" D={n}" if n > 1 else ""),
                                lambda: ctx.cuda.attention(**call, layout=layout),
                                lambda: ctx.ref.attention(**call, layout=ref_layout),
                                sdpa_eager_us=ctx.eager_us(lambda: sdpa(**dense)), sdpa_graph_us=sdpa_graph,
                                rel_error_vs_sdpa=err)
            if (model, kind, B, T) in ATTN_SWEEP_CASES or (args.quick and kind == "decode"):
                row["sweep"] = sweep_attention(ctx, call, base, ATTN_SWEEP[:2] if args.quick else ATTN_SWEEP)
                best = min(row["sweep"], key=lambda r: r["us"])
                row["best_us"], row["best_config"] = best["us"], best["config"]
            ctx.cuda.launch = base
            if row["cuda_graph_us"] is not None and sdpa_graph:
                ctx.target(f"attention {row['case']}: graph time / SDPA on contiguous K/V <= 1.5x",
                           row["cuda_graph_us"] / sdpa_graph, 1.5, False)
            del call, dense, layout, ref_layout


def sweep_attention(ctx: Context, call: dict, base, settings) -> list[dict]:
    """Time of one attention call (graph-replayed; eager where graphs are not available) under each
    launch setting of ``settings`` (see :data:`ATTN_SWEEP`)."""
    from dataclasses import replace

    from ngram_hal.kernels.triton.launch import num_programs_to_fill

    per_sm = max(1, num_programs_to_fill(ctx.device) // 2)
    results = []
    for key_bytes, warps, stages, programs, split_keys in settings:
        ctx.cuda.launch = replace(base, attn_key_bytes=key_bytes, attn_warps=warps, attn_num_stages=stages,
                                  attn_programs=programs * per_sm, attn_min_split=split_keys)
        layout = ctx.cuda.attention_layout(call["req_to_token"], call["req_pool_indices"], call["kv_lens"],
                                           call["q_lens"], call["q"].shape[0], call["tree_mask"], call["max_kv_len"])
        results.append({"config": {"key_bytes": key_bytes, "warps": warps, "stages": stages,
                                   "programs_per_sm": programs, "min_split_keys": split_keys},
                        "us": ctx.graph_us(lambda: ctx.cuda.attention(**call, layout=layout))
                        or ctx.eager_us(lambda: ctx.cuda.attention(**call, layout=layout))})
    ctx.cuda.launch = base
    return results


GROUPS = {"index": bench_index, "kv": bench_kv, "move": bench_move, "attention": bench_attention}


# ------------------------------------------------------------------ report


def fmt(us: float | None) -> str:
    return "-" if us is None else f"{us:,.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.1f}x"


def print_tables(ctx: Context, console) -> None:
    device = f"{ctx.device} ({ctx.cuda.runtime.device_name})"
    others = [r for r in ctx.rows if r["group"] not in ("move", "attention")]
    table = make_table(f"cuda (Triton) vs reference ops on {device}: us per call",
                       ("op", "case", "cuda eager", "ref eager", "ref/cuda", "cuda graph", "ref graph", "ref/cuda "),
                       left=("op", "case"))
    for r in others:
        table.add_row(r["op"], r["case"], fmt(r["cuda_eager_us"]), fmt(r["ref_eager_us"]),
                      ratio(r["ref_eager_us"], r["cuda_eager_us"]), fmt(r["cuda_graph_us"]),
                      fmt(r["ref_graph_us"]), ratio(r["ref_graph_us"], r["cuda_graph_us"]))
    if others:
        console.print(table)

    moves = [r for r in ctx.rows if r["group"] == "move"]
    if moves:
        bw = ctx.copy_bandwidth / 1e9
        table = make_table(f"move_kv on {device}: us per call; copy floor at {bw:,.0f} GB/s (read + write)",
                           ("case", "cuda eager", "torch eager", "torch/cuda", "ref eager", "cuda graph",
                            "torch graph", "torch/cuda ", "ref graph", "floor", "graph/floor"), left=("case",))
        for r in moves:
            table.add_row(r["case"], fmt(r["cuda_eager_us"]), fmt(r["torch_eager_us"]),
                          ratio(r["torch_eager_us"], r["cuda_eager_us"]), fmt(r["ref_eager_us"]),
                          fmt(r["cuda_graph_us"]), fmt(r["torch_graph_us"]),
                          ratio(r["torch_graph_us"], r["cuda_graph_us"]), fmt(r["ref_graph_us"]),
                          f"{r['floor_us']:,.2f}", ratio(r["cuda_graph_us"], r["floor_us"]))
        console.print(table)

    attn = [r for r in ctx.rows if r["group"] == "attention"]
    if attn:
        table = make_table(f"attention on {device}: us per layer call, bf16; SDPA on K/V gathered contiguous",
                           ("case", "cuda eager", "sdpa eager", "cuda graph", "sdpa graph", "cuda/sdpa", "ref graph",
                            "best swept", "rel err"), left=("case",))
        for r in attn:
            table.add_row(r["case"], fmt(r["cuda_eager_us"]), fmt(r["sdpa_eager_us"]), fmt(r["cuda_graph_us"]),
                          fmt(r["sdpa_graph_us"]), ratio(r["cuda_graph_us"], r["sdpa_graph_us"]), fmt(r["ref_graph_us"]),
                          fmt(r.get("best_us")), f"{r['rel_error_vs_sdpa']:.1e}")
        console.print(table)

    table = make_table("targets", ("target", "measured", "limit", "met"), left=("target",))
    for t in ctx.targets:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")
        table.add_row(t["target"], "-" if t["measured"] is None else f"{t['measured']:.2f}", f"{t['limit']:g}", met)
    console.print(table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda; cpu needs TRITON_INTERPRET=1)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"op groups, comma separated ({', '.join(GROUPS)})")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run (the CPU interpreter)")
    parser.add_argument("--batch", type=int, default=256, help="requests B of the index ops (default: 256)")
    parser.add_argument("--tree-size", type=int, default=16, metavar="D", help="draft tree size D (default: 16)")
    parser.add_argument("--context", type=int, default=1024, help="mean context per request (default: 1024)")
    parser.add_argument("--repeats", type=int, default=50, help="host-timed calls per eager time (default: 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--graph-calls", type=int, default=20, help="calls captured in one graph (default: 20)")
    parser.add_argument("--graph-replays", type=int, default=5, help="timed replays of the graph (default: 5)")
    parser.add_argument("--budget-ms", type=float, default=2000.0,
                        help="time one measurement may take; slow calls get fewer repeats (default: 2000)")
    parser.add_argument("--copy-bytes", type=int, default=2**31, help="bytes of the bandwidth copy (default: 2 GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="reports/bench_kernels.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    groups = args.groups.split(",")
    for name in groups:
        if name not in GROUPS:
            parser.error(f"unknown group {name!r}; choose from {', '.join(GROUPS)}")
    device = torch.device(args.device)
    if device.type == "cpu" and not interpreting():
        parser.error("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    if args.quick:
        args.batch, args.tree_size, args.context = min(args.batch, 8), min(args.tree_size, 4), min(args.context, 32)
        args.repeats, args.warmup, args.graph_calls, args.graph_replays = 3, 1, 2, 2
        args.copy_bytes = min(args.copy_bytes, 2**24)
    args.store_shape = (2, 2, 8) if args.quick else (30, 3, 64)

    ctx = Context(args, CudaBackend(device=device), CpuBackend(device=device))
    with torch.inference_mode():
        for name in groups:
            GROUPS[name](ctx)

    console = make_console()
    print_tables(ctx, console)
    report = {
        **report_header("ngram-hal-bench-kernels/2", ctx.cuda),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "triton_interpreted": interpreting(),
        "copy_bandwidth_bytes_per_s": ctx.copy_bandwidth,
        "baselines": {"ref": "CpuBackend on the same device (torch ops)",
                      "torch": "per-layer torch indexing, k[l, dst] = k[l, src] for every layer, K and V",
                      "floor": "bytes moved, read + written, over the measured copy_ bandwidth"},
        "results": ctx.rows,
        "targets": ctx.targets,
    }
    report["versions"]["triton"] = __import__("triton").__version__
    write_report(args.json, report, console)


if __name__ == "__main__":
    main()
