"""The reference attention op against a per-request loop, on SmolLM2-135M-shaped heads.

Each scenario (prefill, batched prefill, decode, a mixed batch, tree verify) runs one layer of
paged attention through ``CpuBackend.attention`` (padded groups, no host sync) and through a
straightforward loop that reads the lengths back to the host and runs one SDPA per request. Both
see the same inputs and must agree before either is timed. Reports the median of ``--repeats``
runs and the loop/reference ratio (above 1: the reference is faster).

    python bench/bench_attention.py [--device cuda] [--dtype bf16] [--json reports/bench_attention.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, median_ms, report_header, write_report  # noqa: E402

from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402

I64 = torch.int64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# name -> (kv_lens, q_lens, tree depth D or 0)
SCENARIOS = {
    "prefill 1x512": ([512], [512], 0),
    "prefill 4x128": ([128] * 4, [128] * 4, 0),
    "decode 16 x ctx 1024": ([1024] * 16, [1] * 16, 0),
    "mixed: prefill 128 + 15 decodes": ([128] + [1024] * 15, [128] + [1] * 15, 0),
    "tree verify 8 x D=8, ctx 1024": ([1024] * 8, [8] * 8, 8),
}


def per_request_attention(q, kv, layer, req_to_token, req_pool_indices, kv_lens, q_lens, sm_scale, tree_mask):
    """One SDPA per request, lengths read on the host, K/V heads repeated for the query heads."""
    N, Hq, d = q.shape
    g = Hq // kv.num_heads
    out = torch.empty_like(q)
    off = 0
    for b, (r, T, n) in enumerate(zip(req_pool_indices.tolist(), kv_lens.tolist(), q_lens.tolist())):
        rows = req_to_token[r, :T]
        k = kv.k[layer].index_select(0, rows).repeat_interleave(g, dim=1).transpose(0, 1)
        v = kv.v[layer].index_select(0, rows).repeat_interleave(g, dim=1).transpose(0, 1)
        mask = torch.ones(n, T, dtype=torch.bool, device=q.device)
        block = tree_mask[b] if tree_mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask[:, T - n:] = block
        o = F.scaled_dot_product_attention(q[off:off + n].transpose(0, 1), k, v, attn_mask=mask, scale=sm_scale)
        out[off:off + n] = o.transpose(0, 1)
        off += n
    return out


def chain_masks(B: int, D: int, device) -> torch.Tensor:
    """A binary-ish draft tree per request: node i's parent is (i - 1) // 2."""
    mask = torch.zeros(D, D, dtype=torch.bool)
    for i in range(D):
        mask[i, i] = True
        if i:
            mask[i] |= mask[(i - 1) // 2]
    return mask.expand(B, D, D).contiguous().to(device)


def build(kv_lens, q_lens, D, args, dtype, device, rng: random.Random):
    """Inputs for one scenario: K/V scattered over a cache sized for exactly these requests."""
    total = sum(kv_lens)
    slots = rng.sample(range(total), total)
    table = torch.full((len(kv_lens), max(kv_lens)), -1, dtype=I64)
    off = 0
    for b, n in enumerate(kv_lens):
        table[b, :n] = torch.tensor(slots[off:off + n])
        off += n
    kv = KVCache(1, total, args.kv_heads, args.head_dim, dtype, device)
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    q = torch.randn(sum(q_lens), args.q_heads, args.head_dim, generator=gen).to(dtype).to(device)
    return dict(q=q, kv=kv, layer=0, req_to_token=table.to(device),
                req_pool_indices=torch.arange(len(kv_lens), dtype=I64, device=device),
                kv_lens=torch.tensor(kv_lens, dtype=I64, device=device),
                q_lens=torch.tensor(q_lens, dtype=I64, device=device), sm_scale=args.head_dim ** -0.5,
                tree_mask=chain_masks(len(kv_lens), D, device) if D else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 steadies timings on a busy host")
    parser.add_argument("--json", default="reports/bench_attention.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    backend = CpuBackend(device=args.device)
    rng = random.Random(args.seed)
    results = []
    with torch.inference_mode():
        for name, (kv_lens, q_lens, D) in SCENARIOS.items():
            call = build(kv_lens, q_lens, D, args, dtype, backend.device, rng)
            max_kv_len = max(kv_lens)

            def reference(call=call, max_kv_len=max_kv_len):
                return backend.attention(**call, max_kv_len=max_kv_len)

            def loop(call=call):
                return per_request_attention(**call)

            atol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(reference(), loop(), atol=atol, rtol=atol,
                                       msg=lambda m, name=name: f"{name}: reference and loop disagree: {m}")
            ref_ms = median_ms(reference, backend.synchronize, args.repeats, args.warmup)
            loop_ms = median_ms(loop, backend.synchronize, args.repeats, args.warmup)
            results.append({"scenario": name, "batch": len(kv_lens), "queries": sum(q_lens),
                            "kv_tokens": sum(kv_lens), "reference_ms": round(ref_ms, 4),
                            "loop_ms": round(loop_ms, 4), "loop_over_reference": round(loop_ms / ref_ms, 2)})

    table = make_table(f"attention: reference vs per-request loop on {backend.device}, {args.dtype}, "
                       f"Hq={args.q_heads} H={args.kv_heads} d={args.head_dim}, one layer, median of {args.repeats}",
                       ("scenario", "B", "queries", "kv tokens", "reference ms", "loop ms", "loop / reference"),
                       left=("scenario",))
    for r in results:
        table.add_row(r["scenario"], str(r["batch"]), str(r["queries"]), str(r["kv_tokens"]),
                      f"{r['reference_ms']:.3f}", f"{r['loop_ms']:.3f}", f"{r['loop_over_reference']:.2f}x")
    console = make_console()
    console.print(table)

    report = {
        **report_header("ngram-hal-bench-attention/1", backend),
        "config": {"dtype": args.dtype, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed},
        "baseline": "per-request loop: lengths read to the host, one SDPA per request",
        "results": results,
    }
    write_report(args.json, report, console)


if __name__ == "__main__":
    main()
