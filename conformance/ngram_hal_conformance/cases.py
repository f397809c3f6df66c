"""Valid argument sets for the ops, built from a ``random.Random``.

A :class:`Call` holds one op's keyword arguments. Builders take an ``rng`` and sizes, so the
same code serves fixed cases (a seeded ``random.Random``) and property tests (hypothesis's
``st.randoms()``, which shrinks). Every index tensor is int64 on ``device``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from ngram_hal.declarations import DECLARATIONS, TENSOR_KINDS
from ngram_hal.kv_cache import KVCache

# The tensor arguments of every public method of the HAL, in signature order, by kind: "index"
# (int64), "mask" (bool) or "float"; and those whose size is tied to another argument's (one entry
# short -> ContractError naming it). Both come from the ops' declarations; the keys are method
# names: "attention_layout" is the layout builder of the op "attention" (see OP_OF).
TENSOR_ARGS: dict[str, dict[str, str]] = {
    method: {a.name: a.kind for a in args if a.kind in TENSOR_KINDS}
    for decl in DECLARATIONS for method, args in decl.methods().items()}
TIED_ARGS: dict[str, tuple[str, ...]] = {
    method: tuple(a.name for a in args if a.tied) for decl in DECLARATIONS for method, args in decl.methods().items()}
OP_OF: dict[str, str] = {method: decl.name for decl in DECLARATIONS for method in decl.methods()}
WRITES: dict[str, tuple[str, ...]] = {decl.name: decl.writes for decl in DECLARATIONS}
"""The arguments each op writes in place (every other one is read only)."""
"""The op (a name in ``ngram_hal.backend.OPS``) each method of :data:`TENSOR_ARGS` belongs to."""


@dataclass
class Call:
    """One op's arguments. ``run`` calls it on a backend; ``clone`` deep-copies the tensors and
    the KV cache so that two backends can run the same call on separate state. ``method`` is the
    backend method to call when it is not the op itself (``attention_layout``)."""

    op: str
    args: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    method: str | None = None

    def run(self, backend):
        return getattr(backend, self.method or self.op)(**self.args)

    def replace(self, **changes) -> "Call":
        return Call(self.op, {**self.args, **changes}, self.info, self.method)

    def clone(self) -> "Call":
        return Call(self.op, {k: _clone(v) for k, v in self.args.items()}, self.info, self.method)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor the op could touch: each tensor argument and ``kv.k``/``kv.v``."""
        out = {}
        for name, value in self.args.items():
            if isinstance(value, KVCache):
                out[f"{name}.k"], out[f"{name}.v"] = value.k, value.v
            elif isinstance(value, torch.Tensor):
                out[name] = value
        return out


def clone_kv(kv: KVCache) -> KVCache:
    """A KV cache of the same shape, dtype and device holding a copy of ``kv``'s K and V."""
    copy = KVCache(kv.num_layers, kv.num_slots, kv.num_heads, kv.head_dim, kv.dtype, kv.device)
    copy.k.copy_(kv.k)
    copy.v.copy_(kv.v)
    return copy


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, KVCache):
        return clone_kv(value)
    return value


def index(values, device) -> torch.Tensor:
    """An int64 tensor on ``device``."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def random_kv(rng: random.Random, device, num_layers: int, num_slots: int, num_heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> KVCache:
    """A KV cache whose every row holds distinct random values."""
    kv = KVCache(num_layers, num_slots, num_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen).to(dtype))
    return kv


def random_rows(rng: random.Random, device, n: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    return torch.randn((n, num_heads, head_dim), generator=gen).to(dtype).to(device)


# ---------------------------------------------------------------- allocation and cache locs

def alloc_extend(rng: random.Random, device, batch: int, page_size: int, max_len: int, spare_pages: int = 2,
                 extend: int | None = None) -> Call:
    """B requests with random prefixes (up to ``max_len``) held in random pages, extended by random
    lengths up to ``max_len`` (by ``extend`` each when given); the free list holds the remaining
    pages in random order (enough, plus ``spare_pages``)."""
    prefix = [rng.randint(0, max_len) for _ in range(batch)]
    seq = [p + (rng.randint(0, max_len) if extend is None else extend) for p in prefix]
    held = [math.ceil(p / page_size) for p in prefix]
    need = [math.ceil(s / page_size) - h for s, h in zip(seq, held)]
    pages = list(range(sum(held) + sum(need) + spare_pages))
    rng.shuffle(pages)
    last_loc, at = [], 0
    for b in range(batch):
        own = pages[at:at + held[b]]
        at += held[b]
        last_loc.append(own[-1] * page_size + (prefix[b] - 1) % page_size if own else -1)
    free = pages[at:]
    return Call("alloc_extend", {
        "prefix_lens": index(prefix, device), "seq_lens": index(seq, device), "last_loc": index(last_loc, device),
        "free_pages": index(free, device), "page_size": page_size,
        "num_new_tokens": sum(s - p for s, p in zip(seq, prefix))})


def _loc(rng: random.Random, num_slots: int) -> int:
    """A slot id, or -1 one time in four."""
    return -1 if rng.random() < 0.25 else rng.randrange(num_slots)


def _req_rows(rng: random.Random, device, batch: int, rows: int, max_context: int, num_slots: int):
    table = [[_loc(rng, num_slots) for _ in range(max_context)] for _ in range(rows)]
    pool = rng.sample(range(rows), batch)
    bounds = [sorted((rng.randint(0, max_context), rng.randint(0, max_context))) for _ in range(batch)]
    args = {"req_to_token": index(table, device), "req_pool_indices": index(pool, device),
            "start": index([a for a, _ in bounds], device), "end": index([b for _, b in bounds], device)}
    return args, sum(b - a for a, b in bounds)


def assign_req_to_token(rng: random.Random, device, batch: int, rows: int, max_context: int,
                        num_slots: int = 64) -> Call:
    """Distinct request rows, random ``start <= end`` ranges, random locs (a quarter -1)."""
    args, n = _req_rows(rng, device, batch, rows, max_context, num_slots)
    args["locs"] = index([_loc(rng, num_slots) for _ in range(n)], device)
    return Call("assign_req_to_token", args)


def gather_cache_locs(rng: random.Random, device, batch: int, rows: int, max_context: int,
                      num_slots: int = 64) -> Call:
    """Distinct request rows and random ``start <= end`` ranges over a random table (a quarter -1)."""
    args, n = _req_rows(rng, device, batch, rows, max_context, num_slots)
    args["num_tokens"] = n
    return Call("gather_cache_locs", args)


# ---------------------------------------------------------------- KV

def store_kv(rng: random.Random, device, kv: KVCache, n: int, holes: int) -> Call:
    """``n`` distinct locs with ``holes`` -1 entries mixed in, random rows of the cache's dtype."""
    locs = rng.sample(range(kv.num_slots), n) + [-1] * holes
    rng.shuffle(locs)
    total = n + holes
    return Call("store_kv", {
        "kv": kv, "layer": rng.randrange(kv.num_layers), "locs": index(locs, device),
        "k": random_rows(rng, device, total, kv.num_heads, kv.head_dim, kv.dtype),
        "v": random_rows(rng, device, total, kv.num_heads, kv.head_dim, kv.dtype)})


MOVE_PATTERNS = ("random", "cycle", "chain")


def move_kv(rng: random.Random, device, kv: KVCache, n: int, pattern: str, sentinel_rate: float = 0.0,
            identity_rate: float = 0.0) -> Call:
    """``n`` move pairs over the cache's slots with distinct destinations.

    ``random``: any sources (often other pairs' destinations); ``cycle``: a permutation of ``n``
    slots (cycles, fixed points are ``src == dst``); ``chain``: ``a0->a1->...->an``. The pair order
    is shuffled. Then each pair turns into ``src == dst`` with ``identity_rate`` and gets a -1 on
    one side with ``sentinel_rate``.
    """
    S = kv.num_slots
    if pattern == "random":
        dst = rng.sample(range(S), n)
        src = [rng.randrange(S) for _ in range(n)]
    elif pattern == "cycle":
        src = rng.sample(range(S), n)
        dst = src[:]
        rng.shuffle(dst)
    elif pattern == "chain":
        slots = rng.sample(range(S), n + 1)
        src, dst = slots[:-1], slots[1:]
    else:
        raise ValueError(f"unknown move pattern {pattern!r}")
    pairs = list(zip(src, dst))
    rng.shuffle(pairs)
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    for i in range(n):
        if rng.random() < identity_rate:
            src[i] = dst[i]
        if rng.random() < sentinel_rate:
            if rng.random() < 0.5:
                src[i] = -1
            else:
                dst[i] = -1
    return Call("move_kv", {"kv": kv, "src": index(src, device), "dst": index(dst, device)},
                {"pattern": pattern})


def accepted_kv_moves(rng: random.Random, device, batch: int, depth: int, rows: int, max_context: int,
                      num_slots: int) -> Call:
    """B draft trees of D nodes in distinct slots; per request a root-first increasing run of
    accepted nodes (-1 padded); random ``req_to_token`` rows and ``seq_lens + D <= M``."""
    B, D = batch, depth
    out_cache_loc = rng.sample(range(num_slots), B * D)
    accept = []
    for b in range(B):
        n = rng.randint(1, D)
        nodes = [0] + sorted(rng.sample(range(1, D), n - 1))
        accept.append([b * D + i for i in nodes] + [-1] * (D - n))
    table = [[rng.randrange(num_slots) for _ in range(max_context)] for _ in range(rows)]
    return Call("accepted_kv_moves", {
        "out_cache_loc": index(out_cache_loc, device), "accept_index": index(accept, device),
        "req_to_token": index(table, device), "req_pool_indices": index(rng.sample(range(rows), B), device),
        "seq_lens": index([rng.randint(0, max_context - D) for _ in range(B)], device)})


# ---------------------------------------------------------------- one small valid call per op

def minimal(op: str, device, backend=None) -> Call:
    """A small, valid call of ``op`` (every op in ``ngram_hal.backend.OPS``, and
    ``"attention_layout"``, the layout builder of a minimal attention call).

    Given ``backend``, the page size and the KV dtype are ones its capabilities list (4 and
    float32 when it lists them or lists none). The attention call is a tree verify (every tensor
    argument present).
    """
    rng = random.Random(op)
    page_size, dtype = supported(backend)
    if op == "alloc_extend":
        return alloc_extend(rng, device, batch=3, page_size=page_size, max_len=9)
    if op == "assign_req_to_token":
        return assign_req_to_token(rng, device, batch=3, rows=4, max_context=12)
    if op == "gather_cache_locs":
        return gather_cache_locs(rng, device, batch=3, rows=4, max_context=12)
    if op == "store_kv":
        return store_kv(rng, device, random_kv(rng, device, 2, 16, 2, 4, dtype), n=5, holes=2)
    if op == "move_kv":
        return move_kv(rng, device, random_kv(rng, device, 2, 16, 2, 4, dtype), n=6, pattern="chain",
                       sentinel_rate=0.3)
    if op == "accepted_kv_moves":
        return accepted_kv_moves(rng, device, batch=3, depth=4, rows=5, max_context=12, num_slots=32)
    return _minimal_model_op(op, device, dtype)


def supported(backend) -> tuple[int, torch.dtype]:
    """A page size and a KV dtype ``backend`` lists (4 and float32 where it can, or without one)."""
    if backend is None:
        return 4, torch.float32
    caps = backend.capabilities()
    page_size = 4 if not caps.page_sizes or 4 in caps.page_sizes else caps.page_sizes[0]
    dtype = "float32" if "float32" in caps.kv_dtypes else caps.kv_dtypes[0]
    return page_size, getattr(torch, dtype)


def _minimal_model_op(op: str, device, dtype: torch.dtype) -> Call:
    # Two requests, each a 3-node chain tree.
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3).contiguous().to(device)
    retrieve = {"candidates": index([[5, 6, 7], [1, 2, 3]], device),
                "retrieve_index": index([[0, 1, 2], [3, 4, 5]], device),
                "retrieve_next_token": index([[1, 2, -1], [1, 2, -1]], device),
                "retrieve_next_sibling": index([[-1, -1, -1], [-1, -1, -1]], device)}
    if op == "reconstruct_tree":
        return Call(op, {"tree_mask": chain, "seq_lens": index([4, 0], device)})
    if op == "verify_tree_greedy":
        return Call(op, {**retrieve, "target_predict": index([[6, 9, 4], [0, 0, 0]], device)})
    if op == "verify_tree_sample":
        probs = torch.full((2, 3, 8), 1 / 8, device=device)
        return Call(op, {**retrieve, "target_probs": probs,
                         "uniform_samples": torch.full((2, 3), 0.5, device=device),
                         "uniform_final": torch.full((2,), 0.25, device=device)})
    if op in ("attention", "attention_layout"):
        # Request 0: 2 cached positions and a 3-node chain; request 1: a root with two children.
        rng = random.Random("attention")
        kv = random_kv(rng, device, 2, 12, 1, 4, dtype)
        mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 0], [1, 0, 1]]],
                            dtype=torch.bool, device=device)
        table = index([[0, 1, 2, 3, 4, -1], [5, 6, 7, -1, -1, -1], [8, 9, 10, 11, -1, -1]], device)
        common = {"req_to_token": table, "req_pool_indices": index([0, 2], device),
                  "kv_lens": index([5, 3], device), "q_lens": index([3, 3], device), "tree_mask": mask,
                  "max_kv_len": 5}
        if op == "attention_layout":
            return Call("attention", {**common, "num_queries": 6}, method="attention_layout")
        return Call(op, {"q": random_rows(rng, device, 6, 2, 4, dtype), "kv": kv, "layer": 1, **common,
                         "sm_scale": 0.5})
    raise ValueError(f"unknown op {op!r}")
