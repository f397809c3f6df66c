"""Reference allocation, cache-location and KV ops against naive per-request Python loops.

One speculative decode step of a batch: B requests of about ``--context`` tokens each, tree size D
(``--tree-size``), a KV cache shaped like SmolLM2-135M (30 layers, 3 kv heads, head dim 64).
Each op runs through ``CpuBackend`` (vectorized, no host sync) and through a per-request Python
loop that reads lengths back to the host, as a straightforward implementation would. Both see the
same inputs and must give the same result before either is timed. Reports the median time of
``--repeats`` runs and the loop/vectorized ratio.

    python bench/bench_reference_ops.py [--device cuda] [--json reports/bench_reference_ops.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, median_ms, report_header, write_report  # noqa: E402

from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.memory import ReqToTokenPool, SlotAllocator  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402

I64 = torch.int64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------ naive per-request baselines


def naive_alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size):
    ps, dev = page_size, free_pages.device
    offsets = torch.arange(ps, dtype=I64, device=dev)
    out, head = [], 0
    for p, s, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
        boundary = -(-p // ps) * ps
        if min(s, boundary) > p:
            out.append(torch.arange(last + 1, last + 1 + min(s, boundary) - p, dtype=I64, device=dev))
        pages = -(-s // ps) - boundary // ps
        if pages > 0:
            block = free_pages[head:head + pages]
            head += pages
            out.append((block.unsqueeze(1) * ps + offsets).reshape(-1)[: s - boundary])
    return torch.cat(out)


def naive_assign(req_to_token, req_pool_indices, start, end, locs):
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        req_to_token[r, s:e] = locs[off:off + e - s]
        off += e - s


def naive_gather(req_to_token, req_pool_indices, start, end):
    return torch.cat([req_to_token[r, s:e] for r, s, e in zip(req_pool_indices.tolist(), start.tolist(),
                                                                 end.tolist())])


def naive_store(kv, layer, locs, k, v, per_request):
    for b in range(locs.shape[0] // per_request):
        rows = slice(b * per_request, (b + 1) * per_request)
        keep = locs[rows] != -1
        kv.k[layer, locs[rows][keep]] = k[rows][keep]
        kv.v[layer, locs[rows][keep]] = v[rows][keep]


def naive_move(kv, src, dst, per_request):
    src_h, dst_h = src.tolist(), dst.tolist()
    for b in range(len(src_h) // per_request):
        pairs = [(s, d) for s, d in zip(src_h[b * per_request:(b + 1) * per_request],
                                        dst_h[b * per_request:(b + 1) * per_request]) if -1 not in (s, d) and s != d]
        if not pairs:
            continue
        s_idx = torch.tensor([s for s, _ in pairs], dtype=I64, device=src.device)
        d_idx = torch.tensor([d for _, d in pairs], dtype=I64, device=src.device)
        for cache in (kv.k, kv.v):
            cache[:, d_idx] = cache[:, s_idx].clone()


def naive_accepted(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
    B, D = accept_index.shape
    src = torch.full((B * D,), -1, dtype=I64, device=accept_index.device)
    dst = torch.full((B * D,), -1, dtype=I64, device=accept_index.device)
    for b, (row, r, s) in enumerate(zip(accept_index.tolist(), req_pool_indices.tolist(), seq_lens.tolist())):
        n = row.index(-1) if -1 in row else D
        src[b * D:b * D + n] = out_cache_loc[accept_index[b, :n]]
        dst[b * D:b * D + n] = req_to_token[r, s:s + n]
    return src, dst


# ------------------------------------------------------------------ timing


class Timer:
    """Times an op and its loop baseline, median of ``repeats`` after ``warmup`` runs, and keeps rows."""

    def __init__(self, sync, repeats: int, warmup: int):
        self.sync, self.repeats, self.warmup = sync, repeats, warmup
        self.results: list[dict] = []

    def compare(self, op: str, dtype: str, page_size: int, work: str, vectorized, loop) -> None:
        vec_ms = median_ms(vectorized, self.sync, self.repeats, self.warmup)
        loop_ms = median_ms(loop, self.sync, self.repeats, self.warmup)
        self.results.append({"op": op, "dtype": dtype, "page_size": page_size, "work": work,
                             "vectorized_ms": round(vec_ms, 4), "loop_ms": round(loop_ms, 4),
                             "speedup": round(loop_ms / vec_ms, 2)})


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise SystemExit(f"{name}: the vectorized op and the loop baseline disagree")


# ------------------------------------------------------------------ the decode-step scene


class Scene:
    """B requests of ~context tokens whose slots were handed out in decode-sized rounds."""

    def __init__(self, backend: CpuBackend, args, page_size: int, rng: random.Random):
        dev, B, D = backend.device, args.batch, args.tree_size
        self.backend, self.page_size, self.B, self.D = backend, page_size, B, D
        self.seq = [args.context + rng.randint(-args.context // 8, args.context // 8) for _ in range(B)]
        # Each request holds seq + 2*D slots (the reserve ahead); the free list has room for the
        # next step's extension to seq + 3*D.
        held = [s + 2 * D for s in self.seq]
        slots = sum(-(-(s + 3 * D) // page_size) + 1 for s in self.seq) * page_size
        self.num_slots = slots
        self.alloc = SlotAllocator(backend, slots, page_size)
        self.pool = ReqToTokenPool(B, max(self.seq) + 3 * D, device=dev)
        self.rows = torch.tensor([self.pool.alloc() for _ in range(B)], dtype=I64, device=dev)
        # Grow every request a chunk at a time, the way decode steps interleave their slots.
        grown = [0] * B
        while grown != held:
            new = [min(n, g + 2 * D) for n, g in zip(held, grown)]
            self.extend(grown, new)
            grown = new
        self.held = held
        self.seq_lens = torch.tensor(self.seq, dtype=I64, device=dev)
        j = torch.arange(D, dtype=I64, device=dev)
        self.out_cache_loc = self.pool.req_to_token[self.rows.unsqueeze(1), self.seq_lens.unsqueeze(1) + j].reshape(-1)
        accept = []
        for b in range(B):
            n = rng.randint(1, D)
            nodes = [0] + sorted(rng.sample(range(1, D), n - 1))
            accept.append([b * D + i for i in nodes] + [-1] * (D - n))
        self.accept_index = torch.tensor(accept, dtype=I64, device=dev)

    def last_loc(self, prefix: torch.Tensor) -> torch.Tensor:
        """Slot of each request's position ``prefix - 1``, or -1 for an empty prefix."""
        loc = self.pool.req_to_token[self.rows, (prefix - 1).clamp(min=0)]
        return torch.where(prefix > 0, loc, -1)

    def extend(self, old: list[int], new: list[int]) -> None:
        dev = self.backend.device
        prefix, seq = torch.tensor(old, dtype=I64, device=dev), torch.tensor(new, dtype=I64, device=dev)
        locs = self.alloc.alloc_extend(prefix, seq, self.last_loc(prefix), old, new)
        self.backend.assign_req_to_token(self.pool.req_to_token, self.rows, prefix, seq, locs)

    def extend_inputs(self):
        """``alloc_extend``'s arguments for the next step's reservation: held slots to seq + 3*D."""
        dev = self.backend.device
        old, new = self.held, [s + 3 * self.D for s in self.seq]
        prefix = torch.tensor(old, dtype=I64, device=dev)
        return (prefix, torch.tensor(new, dtype=I64, device=dev), self.last_loc(prefix),
                self.alloc.free_list.clone(), self.page_size, sum(n - o for o, n in zip(old, new)))


def bench_index_ops(backend, args, rng, timer: Timer) -> Scene:
    D, B = args.tree_size, args.batch
    for page_size in args.page_sizes:
        scene = Scene(backend, args, page_size, rng)
        inputs = scene.extend_inputs()
        same("alloc_extend", backend.alloc_extend(*inputs), naive_alloc_extend(*inputs[:5]))
        timer.compare("alloc_extend", "-", page_size, f"{B} req +{D} tok, ctx~{args.context}",
                      partial(backend.alloc_extend, *inputs), partial(naive_alloc_extend, *inputs[:5]))

    scene = Scene(backend, args, 1, rng)
    table, rows, start = scene.pool.req_to_token, scene.rows, scene.seq_lens
    end = start + 2 * D
    locs = backend.gather_cache_locs(table, rows, start, end, B * 2 * D).flip(0).contiguous()
    twin = table.clone()
    backend.assign_req_to_token(table, rows, start, end, locs)
    naive_assign(twin, rows, start, end, locs)
    same("assign_req_to_token", table, twin)
    timer.compare("assign_req_to_token", "-", 1, f"{B} req x {2 * D} tok",
                  partial(backend.assign_req_to_token, table, rows, start, end, locs),
                  partial(naive_assign, twin, rows, start, end, locs))

    zero, total = torch.zeros_like(start), sum(scene.seq)
    gather = partial(backend.gather_cache_locs, table, rows, zero, start, total)
    same("gather_cache_locs", gather(), naive_gather(table, rows, zero, start))
    timer.compare("gather_cache_locs", "-", 1, f"{B} req x ctx~{args.context} ({total} locs)",
                  gather, partial(naive_gather, table, rows, zero, start))

    acc = (scene.out_cache_loc, scene.accept_index, table, rows, scene.seq_lens)
    (src, dst), (want_src, want_dst) = backend.accepted_kv_moves(*acc), naive_accepted(*acc)
    same("accepted_kv_moves src", src, want_src)
    same("accepted_kv_moves dst", dst, want_dst)
    timer.compare("accepted_kv_moves", "-", 1, f"B={B} D={D}",
                  partial(backend.accepted_kv_moves, *acc), partial(naive_accepted, *acc))
    return scene


def bench_kv_ops(backend, args, scene: Scene, dtype_name: str, timer: Timer) -> None:
    dev, dtype, B, D = backend.device, DTYPES[dtype_name], args.batch, args.tree_size
    kv = KVCache(args.layers, scene.num_slots, args.heads, args.head_dim, dtype=dtype, device=dev)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    locs = scene.out_cache_loc
    k = torch.randn((B * D, args.heads, args.head_dim), generator=g, device=dev).to(dtype)
    v = torch.randn((B * D, args.heads, args.head_dim), generator=g, device=dev).to(dtype)
    layer = args.layers // 2
    backend.store_kv(kv, layer, locs, k, v)
    same("store_kv", kv.k[layer, locs], k)
    kv.k[layer, locs] = 0
    naive_store(kv, layer, locs, k, v, D)
    same("store_kv (loop)", kv.k[layer, locs], k)
    timer.compare("store_kv", dtype_name, 1, f"{B * D} rows, 1 layer",
                  partial(backend.store_kv, kv, layer, locs, k, v), partial(naive_store, kv, layer, locs, k, v, D))

    src, dst = backend.accepted_kv_moves(scene.out_cache_loc, scene.accept_index, scene.pool.req_to_token,
                                         scene.rows, scene.seq_lens)
    # Every tree node's rows differ in every layer, so a wrong move order shows up.
    for i in range(args.layers):
        backend.store_kv(kv, i, locs, k + i, v - i)
    live = ((src != -1) & (dst != -1)).nonzero().squeeze(1)
    src_live, dst_live = src[live], dst[live]
    sources = kv.k[:, src_live].clone()
    backend.move_kv(kv, src, dst)
    same("move_kv", kv.k[:, dst_live], sources)
    kv.k[:, src_live] = sources
    naive_move(kv, src, dst, D)
    same("move_kv (loop)", kv.k[:, dst_live], sources)
    timer.compare("move_kv", dtype_name, 1, f"{live.numel()} live pairs of {B * D}, {args.layers} layers K+V",
                  partial(backend.move_kv, kv, src, dst), partial(naive_move, kv, src, dst, D))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--batch", type=int, default=64, help="requests B (default: 64)")
    parser.add_argument("--tree-size", type=int, default=16, metavar="D", help="draft tree size D (default: 16)")
    parser.add_argument("--context", type=int, default=1024, help="mean context per request (default: 1024)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3, help="kv heads (default: 3)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,bf16", help="KV dtypes, comma separated (fp32, bf16, fp16)")
    parser.add_argument("--page-sizes", default="1,16", help="page sizes for alloc_extend (default: 1,16)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 steadies timings on a busy host")
    parser.add_argument("--json", default="reports/bench_reference_ops.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    dtype_names = args.dtypes.split(",")
    for name in dtype_names:
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend = CpuBackend(device=args.device)
    timer = Timer(backend.synchronize, args.repeats, args.warmup)
    with torch.inference_mode():
        scene = bench_index_ops(backend, args, random.Random(args.seed), timer)
        for name in dtype_names:
            bench_kv_ops(backend, args, scene, name, timer)
    results = timer.results

    table = make_table(f"reference ops vs per-request loops on {backend.device} "
                       f"(B={args.batch}, D={args.tree_size}, ctx~{args.context}, median of {args.repeats})",
                       ("op", "dtype", "page", "work", "vectorized ms", "loop ms", "loop / vectorized"),
                       left=("op", "work"))
    for r in results:
        table.add_row(r["op"], r["dtype"], str(r["page_size"]), r["work"], f"{r['vectorized_ms']:.3f}",
                      f"{r['loop_ms']:.3f}", f"{r['speedup']:.1f}x")
    console = make_console()
    console.print(table)

    report = {
        **report_header("ngram-hal-bench-reference-ops/2", backend),
        "config": {"batch": args.batch, "tree_size": args.tree_size, "context": args.context, "layers": args.layers,
                   "kv_heads": args.heads, "head_dim": args.head_dim, "dtypes": dtype_names,
                   "page_sizes": args.page_sizes, "repeats": args.repeats, "warmup": args.warmup,
                   "seed": args.seed, "kv_slots": scene.num_slots},
        "baseline": "per-request Python loop reading lengths to the host",
        "results": results,
    }
    write_report(args.json, report, console)


if __name__ == "__main__":
    main()
