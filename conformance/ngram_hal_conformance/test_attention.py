"""Conformance: ``attention`` — paged attention over the KV cache for prefill, decode, mixed
batches and tree verify, checked against dense attention computed independently in float64.

Every case scatters each request's K/V over random slots of a paged cache, reads them through a
random row of ``req_to_token`` and leaves junk (-1 or stale slot ids) in the columns past
``kv_lens``. Poisoned cases also fill every slot no request reads with NaN, so a backend that
reads outside ``req_to_token[r_b, :kv_lens[b]]`` produces NaN.

:func:`dense_attention` and :func:`attention_call` are importable so other suites can reuse them.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from . import cases
from .checks import assert_unchanged, host, rejects, snapshot

conformance = pytest.mark.conformance
rngs = st.randoms(use_true_random=False)


@cases.minimal_call("attention")
def _minimal_attention(rng, device, page_size, dtype):
    """A tree verify (every tensor argument present): request 0 has 2 cached positions and a
    3-node chain, request 1 a root with two children."""
    rng = random.Random("attention")
    kv = cases.random_kv(rng, device, 2, 12, 1, 4, dtype)
    return cases.Call("attention", {"q": cases.random_rows(rng, device, 6, 2, 4, dtype), "kv": kv, "layer": 1,
                                    **_minimal_layout_args(device), "sm_scale": 0.5})


@cases.minimal_call("attention_layout")
def _minimal_layout(rng, device, page_size, dtype):
    return cases.Call("attention", {**_minimal_layout_args(device), "num_queries": 6,
                                    "q_active": cases.index([2, 3], device)}, method="attention_layout")


def _minimal_layout_args(device) -> dict:
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 0], [1, 0, 1]]],
                        dtype=torch.bool, device=device)
    table = cases.index([[0, 1, 2, 3, 4, -1], [5, 6, 7, -1, -1, -1], [8, 9, 10, 11, -1, -1]], device)
    return {"req_to_token": table, "req_pool_indices": cases.index([0, 2], device),
            "kv_lens": cases.index([5, 3], device), "q_lens": cases.index([3, 3], device), "tree_mask": mask,
            "max_kv_len": 5}

# (atol, rtol) against the float64 result, per dtype of q and the cache. float32 allows
# TF32-class matmuls; half types allow rounding of the inputs' products and of the output.
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}
HEADS = [(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]


# ---------------------------------------------------------------- cases and the dense oracle

def tree_mask_of(parents: list[int]) -> list[list[bool]]:
    """``mask[i][j]``: node j is node i or one of its ancestors (``parents[0] == -1``)."""
    mask: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(mask[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def random_parents(rng: random.Random, depth: int) -> list[int]:
    """A random tree of ``depth`` nodes in an order where every parent precedes its children."""
    return [-1] + [rng.randrange(i) for i in range(1, depth)]


def random_batch(data, rng: random.Random, batch: int, mode: str, max_keys: int, max_nodes: int,
                 max_queries: int) -> tuple[list[int], list[int], list[list[int]] | None]:
    """``(kv_lens, q_lens, trees)`` of a random batch of ``mode``: ``prefill`` (whole prompts),
    ``decode`` (one query each), ``mixed`` (0 to ``max_queries`` new positions each) or ``tree``
    (one random tree of 1 to ``max_nodes`` nodes, drawn from ``data``, after each prefix)."""
    if mode == "tree":
        D = data.draw(st.integers(1, max_nodes), label="D")
        return [D + rng.randint(0, max_keys) for _ in range(batch)], [D] * batch, \
            [random_parents(rng, D) for _ in range(batch)]
    kv_lens = [rng.randint(1, max_keys) for _ in range(batch)]
    q_lens = {"prefill": list(kv_lens), "decode": [1] * batch,
              "mixed": [rng.randint(0, min(k, max_queries)) for k in kv_lens]}[mode]
    return kv_lens, q_lens, None


def attention_call(rng: random.Random, device, dtype: torch.dtype, kv_lens: list[int], q_lens: list[int],
                   heads: tuple[int, int] = (4, 2), head_dim: int = 8, trees: list[list[int]] | None = None,
                   poison: bool = False, num_layers: int = 2, spare_slots: int = 3, extra_cols: int = 4
                   ) -> cases.Call:
    """A valid ``attention`` call: request b has ``kv_lens[b]`` cached positions, the last
    ``q_lens[b]`` of them queried. ``trees`` (one parent list per request, all of length D with
    ``q_lens == D``) makes it a tree-verify call. The last layer is the one read."""
    B = len(kv_lens)
    Hq, H = heads
    total = sum(kv_lens)
    num_slots = total + spare_slots
    order = rng.sample(range(num_slots), num_slots)
    used, spare = order[:total], order[total:]
    rows, M = B + 2, max(kv_lens, default=0) + extra_cols
    table = [[-1] * M for _ in range(rows)]
    pool = rng.sample(range(rows), B)
    taken = iter(used)
    for b in range(B):
        for j in range(M):
            table[pool[b]][j] = next(taken) if j < kv_lens[b] else rng.choice([-1] + spare)
    kv = cases.random_kv(rng, device, num_layers, num_slots, H, head_dim, dtype)
    if poison and spare:
        kv.k[:, spare] = float("nan")
        kv.v[:, spare] = float("nan")
    tree_mask = None
    if trees is not None:
        tree_mask = torch.tensor([tree_mask_of(p) for p in trees], dtype=torch.bool, device=device)
    return cases.Call("attention", {
        "q": cases.random_rows(rng, device, sum(q_lens), Hq, head_dim, dtype), "kv": kv,
        "layer": num_layers - 1, "req_to_token": cases.index(table, device),
        "req_pool_indices": cases.index(pool, device), "kv_lens": cases.index(kv_lens, device),
        "q_lens": cases.index(q_lens, device), "sm_scale": rng.uniform(0.5, 1.5) / math.sqrt(head_dim),
        "tree_mask": tree_mask, "max_kv_len": max(kv_lens, default=0)})


def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                    q_lens: torch.Tensor, sm_scale: float, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The op's docstring computed densely in float64 on the host, one request at a time."""
    q = host(q).double()
    N, Hq, d = q.shape
    H = k_cache.shape[2]
    out = torch.zeros(N, Hq, d, dtype=torch.float64)
    off = 0
    for b, (r, T, n) in enumerate(zip(req_pool_indices.tolist(), kv_lens.tolist(), q_lens.tolist())):
        slots = host(req_to_token)[r, :T]
        k = host(k_cache)[layer, slots].double().repeat_interleave(Hq // H, dim=1)
        v = host(v_cache)[layer, slots].double().repeat_interleave(Hq // H, dim=1)
        visible = torch.ones(n, T, dtype=torch.bool)
        block = host(tree_mask)[b] if tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        visible[:, T - n:] = block
        scores = torch.einsum("nhd,thd->hnt", q[off:off + n], k) * sm_scale
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out[off:off + n] = torch.einsum("hnt,thd->nhd", probs, v)
        off += n
    return out


def _check(backend, device, call: cases.Call, what: str) -> None:
    a = call.args
    out = call.run(backend)
    q = a["q"]
    assert isinstance(out, torch.Tensor), f"{what}: expected a tensor, got {type(out).__name__}"
    assert out.dtype == q.dtype, f"{what}: output dtype {out.dtype}, q is {q.dtype}"
    assert tuple(out.shape) == tuple(q.shape), f"{what}: output shape {tuple(out.shape)}, q is {tuple(q.shape)}"
    assert out.device.type == torch.device(device).type, f"{what}: output on {out.device}, backend on {device}"
    want = dense_attention(q, a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    got = host(out).double()
    assert bool(torch.isfinite(got).all()), f"{what}: output has NaN/inf (read outside the request's rows?)"
    atol, rtol = TOLERANCE[q.dtype]
    err = (got - want).abs()
    bad = err > atol + rtol * want.abs()
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {err.numel()} values off the float64 result, "
                                 f"max abs error {err.max().item():.3g} (atol {atol}, rtol {rtol})")


def kv_dtypes(backend) -> list[torch.dtype]:
    """The KV dtypes the backend lists, as torch dtypes."""
    return [getattr(torch, name) for name in backend.capabilities().kv_dtypes]


def _each_dtype(backend, device, seed: str, **kwargs) -> None:
    for dtype in kv_dtypes(backend):
        rng = random.Random(f"{seed}-{dtype}")
        _check(backend, device, attention_call(rng, device, dtype, **kwargs), f"{seed} {dtype}")


# ---------------------------------------------------------------- semantics

@conformance(op="attention", tier="semantics")
@pytest.mark.parametrize("kv_lens", [[1], [17], [5, 12, 1]], ids=["one", "single", "batch"])
def test_prefill(backend, device, kv_lens):
    """Causal attention over whole prompts (q_lens == kv_lens)."""
    _each_dtype(backend, device, f"prefill{kv_lens}", kv_lens=kv_lens, q_lens=kv_lens)


@conformance(op="attention", tier="semantics")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-h{h[1]}")
def test_decode(backend, device, heads):
    """One query per request over its whole cache, grouped-query head mapping included."""
    _each_dtype(backend, device, f"decode{heads}", kv_lens=[9, 1, 30, 4], q_lens=[1, 1, 1, 1], heads=heads)


@conformance(op="attention", tier="semantics")
def test_mixed_extend(backend, device):
    """Requests extending a cached prefix by different amounts, one of them by nothing."""
    _each_dtype(backend, device, "mixed", kv_lens=[20, 3, 11, 7, 6], q_lens=[5, 3, 1, 0, 2])


@conformance(op="attention", tier="semantics")
@pytest.mark.parametrize("trees", [
    [[-1, 0, 1, 2]] * 2,
    [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 1, 0, 4]],
    [[-1]] * 3,
], ids=["chain", "branching", "root-only"])
def test_tree_verify(backend, device, trees):
    """D tree nodes per request after a cached prefix: each sees the prefix and its ancestors."""
    D = len(trees[0])
    prefixes = [7, 0, 13][:len(trees)]
    _each_dtype(backend, device, f"tree{trees}", kv_lens=[p + D for p in prefixes], q_lens=[D] * len(trees),
                trees=trees)


@conformance(op="attention", tier="semantics")
@pytest.mark.parametrize("mode", ["chain", "branching", "extend"])
def test_active_queries(backend, device, mode):
    """A layout's ``q_active`` leaves each request's queries from that count on out: their rows are
    zero, and the other rows are the dense result (a count of 0, one within and one past the
    request's queries)."""
    trees = {"chain": [[-1, 0, 1, 2, 3, 4, 5]] * 3, "branching": [[-1, 0, 0, 1, 2, 1, 3]] * 3, "extend": None}[mode]
    q_lens = [7, 7, 7] if trees else [7, 4, 1]
    q_active = [0, 3, 9]
    for dtype in kv_dtypes(backend):
        call = attention_call(random.Random(f"active-{mode}-{dtype}"), device, dtype, kv_lens=[12, 7, 30],
                              q_lens=q_lens, trees=trees, poison=True, spare_slots=6)
        a = call.args
        layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                          a["q"].shape[0], a["tree_mask"], a["max_kv_len"],
                                          q_active=cases.index(q_active, device))
        got = host(call.replace(layout=layout).run(backend)).double()
        want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                               a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
        active = torch.cat([torch.arange(n) < k for n, k in zip(q_lens, q_active)])
        assert bool((got[~active] == 0).all()), f"{mode} {dtype}: a query past q_active has a nonzero row"
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(got[active], want[active], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{mode} {dtype}, the active queries: {m}")


@conformance(op="attention", tier="semantics")
def test_reads_only_its_rows(backend, device):
    """Slots outside every request's first kv_lens columns hold NaN; the output stays finite."""
    _each_dtype(backend, device, "poison", kv_lens=[6, 14, 2], q_lens=[6, 2, 1], poison=True, spare_slots=12)
    _each_dtype(backend, device, "poison-tree", kv_lens=[9, 3], q_lens=[3, 3], trees=[[-1, 0, 0], [-1, 0, 1]],
                poison=True, spare_slots=12)


@conformance(op="attention", tier="semantics")
def test_max_kv_len_optional(backend, device):
    """max_kv_len=None and a generous max_kv_len give the tight one's result."""
    call = attention_call(random.Random("maxlen"), device, torch.float32, kv_lens=[8, 21, 3], q_lens=[2, 1, 3])
    tight = call.run(backend)
    for max_kv_len in (None, 40):
        other = call.replace(max_kv_len=max_kv_len).run(backend)
        torch.testing.assert_close(host(other), host(tight), atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"max_kv_len={max_kv_len}: {m}")


@conformance(op="attention", tier="semantics")
def test_leaves_state_unchanged(backend, device):
    """Attention reads the cache and the table; it writes neither (nor q)."""
    call = attention_call(random.Random("pure"), device, torch.float32, kv_lens=[10, 4], q_lens=[3, 4])
    before = snapshot({**call.state(), "q": call.args["q"]})
    call.run(backend)
    assert_unchanged(before, {**call.state(), "q": call.args["q"]}, "attention", call.args["kv"].num_slots)


@conformance(op="attention", tier="semantics")
@given(data=st.data(), rng=rngs, heads=st.sampled_from(HEADS), head_dim=st.sampled_from([4, 8, 16]),
       batch=st.integers(1, 4), mode=st.sampled_from(["prefill", "decode", "mixed", "tree"]))
def test_matches_dense(backend, device, data, rng, heads, head_dim, batch, mode):
    """Random batches of every kind against the float64 dense result, with poisoned spare slots."""
    dtype = data.draw(st.sampled_from(kv_dtypes(backend)), label="dtype")
    kv_lens, q_lens, trees = random_batch(data, rng, batch, mode, max_keys=40, max_nodes=6, max_queries=40)
    call = attention_call(rng, device, dtype, kv_lens, q_lens, heads=heads, head_dim=head_dim, trees=trees,
                          poison=True, spare_slots=rng.randint(0, 8))
    _check(backend, device, call, f"{mode} {dtype}")


# ---------------------------------------------------------------- contract
# (Every tensor argument of attention and attention_layout, the layout object: test_contract.py;
# lengths, tree q_lens and the slots read in strict mode: test_strict.py.)

def _minimal(device) -> cases.Call:
    return attention_call(random.Random("contract"), device, torch.float32, kv_lens=[5, 3], q_lens=[2, 3])


@conformance(op="attention", tier="contract")
def test_q_dtype_must_match_cache(backend, device):
    call = _minimal(device)
    other = torch.float16 if call.args["kv"].dtype != torch.float16 else torch.float32
    rejects(backend, call.replace(q=call.args["q"].to(other)), "q", f"q as {other}")


@conformance(op="attention", tier="contract")
def test_q_head_layout_rejected(backend, device):
    """Query heads must be a multiple of the cache's KV heads, with the cache's head dim."""
    call = _minimal(device)
    q = call.args["q"]
    rejects(backend, call.replace(q=q[:, :1].repeat(1, 3, 1).contiguous()), "q", "3 query heads over 2 KV heads")
    rejects(backend, call.replace(q=q[..., :-1].contiguous()), "q", "a head dim one short")


@conformance(op="attention", tier="contract")
def test_tree_mask_must_match_the_batch(backend, device):
    """A tree mask of another batch size, or of a D that does not match q's rows, is refused."""
    call = attention_call(random.Random("tree-contract"), device, torch.float32, kv_lens=[5, 3], q_lens=[3, 3],
                          trees=[[-1, 0, 1], [-1, 0, 0]])
    mask = call.args["tree_mask"]
    rejects(backend, call.replace(tree_mask=mask[:1].contiguous()), "tree_mask", "a mask for one request of two")
    rejects(backend, call.replace(tree_mask=mask[:, :2, :2].contiguous()), "q", "a mask of D = 2 for 6 query rows")
