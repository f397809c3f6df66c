"""The Triton paged-attention kernel (``ngram_hal.kernels.triton.attention``) against float64 dense
attention: every batch kind, grouped-query head maps, head sizes, the three KV dtypes, with and
without the key split and its merge kernel, and default-mode robustness. Runs under Triton's
interpreter on the CPU (``tests/conftest.py``) or compiled on a CUDA device."""

from __future__ import annotations

import random
import types
from dataclasses import replace

import pytest
import torch
from ngram_hal_conformance.test_attention import TOLERANCE, attention_call, dense_attention
from numerics import assert_invariant

pytest.importorskip("triton")
from ngram_hal_cuda import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {
    "prefill": dict(kv_lens=[5, 12, 1], q_lens=[5, 12, 1]),
    "decode": dict(kv_lens=[40, 3, 70, 1], q_lens=[1, 1, 1, 1]),
    "mixed": dict(kv_lens=[20, 3, 11, 7, 6], q_lens=[5, 3, 1, 0, 2]),
    "long-prefill": dict(kv_lens=[150], q_lens=[150]),
    "tree": dict(kv_lens=[12, 5], q_lens=[5, 5], trees=[[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]),
    "tree-deep": dict(kv_lens=[30, 17], q_lens=[17, 17], trees=[[-1] + list(range(16)), [-1] + [0] * 16]),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _backend(split: bool, programs: int | None = None) -> CudaBackend:
    """A cuda backend whose attention splits the keys (and merges) whenever a request has >16 keys,
    or never splits; ``programs`` overrides the programs that fill the device (in the batch-invariant
    mode, whose splits are fixed, the programs that take them: 1 walks them all in one)."""
    backend = CudaBackend(device=DEVICE)
    backend.launch = replace(CudaBackend.launch, attn_programs=programs or (4096 if split else 1),
                             attn_invariant_fill=1, attn_min_split=16)
    return backend


def _check(backend, call, what: str) -> torch.Tensor:
    a = call.args
    out = backend.attention(**a)
    assert out.dtype == a["q"].dtype and out.shape == a["q"].shape
    want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    got = out.cpu().double()
    assert bool(torch.isfinite(got).all()), f"{what}: NaN or inf (read a row outside the request?)"
    atol, rtol = TOLERANCE[a["q"].dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return out


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-keys"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense(name, dtype, split):
    call = attention_call(random.Random(name), DEVICE, dtype, heads=(6, 2), poison=True, spare_slots=6,
                          **CASES[name])
    _check(_backend(split), call, f"{name} {dtype}")


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("name", ["tree", "tree-deep"])
def test_tree_tile_heights(name, block_m):
    """A verify step's nodes cut into tiles of 16, 32 or 64 rows (1 to 3 tiles a request here) give
    the dense attention under the tree mask."""
    backend = _backend(True)
    backend.launch = replace(backend.launch, attn_tree_block_m=block_m)
    call = attention_call(random.Random(name), DEVICE, torch.float32, heads=(9, 3), poison=True, spare_slots=6,
                          **CASES[name])
    _check(backend, call, f"{name} tiles of {block_m}")


@pytest.mark.parametrize("heads", [(1, 1), (4, 4), (8, 2), (9, 3), (16, 1), (32, 8)], ids=str)
@pytest.mark.parametrize("head_dim", [4, 64, 128])
def test_head_maps_and_sizes(heads, head_dim):
    """Grouped-query maps (G = 1 to 16) and head sizes below and at the matrix-unit minimum."""
    call = attention_call(random.Random(f"{heads}{head_dim}"), DEVICE, torch.float32, heads=heads,
                          head_dim=head_dim, poison=True, kv_lens=[9, 33, 2], q_lens=[9, 1, 2])
    _check(_backend(False), call, f"heads {heads} d {head_dim}")


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-keys"])
def test_layout_shared_by_layers(split):
    """One layout, three layers: each layer's output equals a call that builds its own layout."""
    backend = _backend(split)
    call = attention_call(random.Random("layers"), DEVICE, torch.bfloat16, num_layers=3, kv_lens=[19, 40],
                          q_lens=[2, 1])
    a = call.args
    layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                      a["q"].shape[0], a["tree_mask"], a["max_kv_len"])
    for layer in range(3):
        shared = backend.attention(**{**a, "layer": layer}, layout=layout)
        assert torch.equal(shared, backend.attention(**{**a, "layer": layer}))


@pytest.mark.parametrize("name", ["mixed", "decode", "tree"])
def test_generous_max_kv_len(name):
    """max_kv_len above every kv_len (and above the table's width, as in a captured step) changes
    nothing: each request's keys are shared by as many splits as the bound asks for."""
    backend = _backend(True)
    lens = {"mixed": dict(kv_lens=[8, 21, 3], q_lens=[2, 1, 3]), "decode": dict(kv_lens=[70, 33], q_lens=[1, 1]),
            "tree": CASES["tree"]}[name]
    call = attention_call(random.Random("maxlen"), DEVICE, torch.float32, **lens)
    tight = _check(backend, call, "tight")
    for max_kv_len in (None, 40, 10_000):
        loose = backend.attention(**{**call.args, "max_kv_len": max_kv_len})
        torch.testing.assert_close(loose, tight, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", ["slots", "pool-row", "negative-q", "q-over-kv", "kv-over-table"])
def test_default_mode_never_reads_or_writes_outside(bad):
    """Out-of-range values in default mode: no crash, the cache and the table unchanged, rows of
    well-formed requests still right."""
    backend = _backend(True)
    call = attention_call(random.Random(bad), DEVICE, torch.float32, kv_lens=[6, 9], q_lens=[2, 1])
    a = dict(call.args)
    table, kv = a["req_to_token"], a["kv"]
    r = int(a["req_pool_indices"][1])
    if bad == "slots":
        table[r, :4] = torch.tensor([-7, kv.num_slots, 10**9, -1])
    elif bad == "pool-row":
        a["req_pool_indices"] = a["req_pool_indices"].clone()
        a["req_pool_indices"][1] = table.shape[0] + 5
    elif bad == "negative-q":
        a["q_lens"] = torch.tensor([2, -3], dtype=torch.int64, device=DEVICE)
    elif bad == "q-over-kv":
        a["kv_lens"] = torch.tensor([6, 0], dtype=torch.int64, device=DEVICE)
    else:
        a["kv_lens"] = torch.tensor([6, 10**6], dtype=torch.int64, device=DEVICE)
    before = (table.clone(), kv.k.clone(), kv.v.clone())
    out = backend.attention(**a)
    assert torch.equal(table, before[0]) and torch.equal(kv.k, before[1]) and torch.equal(kv.v, before[2])
    good = attention_call(random.Random(bad), DEVICE, torch.float32, kv_lens=[6, 9], q_lens=[2, 1]).args
    want = dense_attention(good["q"][:2], good["kv"].k, good["kv"].v, good["layer"], good["req_to_token"],
                           good["req_pool_indices"][:1], good["kv_lens"][:1], good["q_lens"][:1], good["sm_scale"])
    torch.testing.assert_close(out[:2].cpu().double(), want[:2], atol=1e-3, rtol=1e-3)


def _invariant(backend, a, **changes):
    a = {**a, **changes}
    layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                      a["q"].shape[0], a["tree_mask"], a["req_to_token"].shape[1],
                                      batch_invariant=True)
    return backend.attention(**a, layout=layout)


@pytest.mark.parametrize("block_m", [None, 64], ids=lambda m: f"{m or 'least'}-rows")
@pytest.mark.parametrize("programs", [1, 40, 4096], ids=lambda p: f"{p}-programs")
@pytest.mark.parametrize("name", ["tree", "tree-deep", "decode"])
def test_invariant_matches_dense(name, programs, block_m):
    """The batch-invariant mode against dense attention, with tiles of one query's heads or 64 rows
    (``attn_invariant_block_m``: a tile then holds 32 of a tree's nodes)."""
    call = attention_call(random.Random(name), DEVICE, torch.float32, heads=(6, 2), poison=True, spare_slots=6,
                          extra_cols=300, **CASES[name])
    a = call.args
    want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    backend = _backend(True, programs)
    backend.launch = replace(backend.launch, attn_invariant_block_m=block_m)
    torch.testing.assert_close(_invariant(backend, a).cpu().double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tree", "decode"])
def test_invariant_bits_do_not_follow_the_programs(name):
    """Batch-invariant mode: the key splits sit at fixed positions and merge in their own order, so
    taking them in one program per tile and head, in two (every other split), or one each gives the
    same bits, and so does one program that folds them as it walks them (where tiles x heads fill
    at least half the device: 1 and 16 programs to fill for the decode's 8 tiles x heads, 1 for the
    tree). The table's width (300 more columns: 3 splits of 128 keys) makes splits past every
    context, which the programs must mark empty. Filling 40 programs gives the decode's 8 tiles x
    heads 3 programs each, the tree's 20 node tiles x heads 2."""
    a = attention_call(random.Random(f"programs-{name}"), DEVICE, torch.bfloat16, heads=(6, 2),
                       extra_cols=300, **CASES[name]).args
    one_each = _invariant(_backend(True, 4096), a)
    for programs in (1, 16, 40):
        assert_invariant(_invariant(_backend(True, programs), a), one_each, f"{programs} programs to fill")


@pytest.mark.parametrize("programs", [1, 40, 4096], ids=lambda p: f"{p}-programs")
@pytest.mark.parametrize("prefix", [29, 300], ids=["one-split", "splits-before-the-tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_tree_rows_equal_decode_of_their_path(dtype, prefix, programs):
    """Batch-invariant mode: a tree node's output is bit for bit the decode output of the same query
    once its path (its ancestors, then itself) has been accepted, i.e. moved to the positions right
    after the prefix, whatever other branches the tree had. With a long prefix the key splits
    wholly before the tree are read by one tile of all the nodes, the rest node by node. The tree
    takes its splits in ``programs`` per tile (1: its tiles fill the device, so one program per tile
    and head folds them all, the nodes on from where the first launch left them), the decodes one
    program per split and a merge."""
    parents = [-1, 0, 0, 1, 2, 1, 3, 4, 6, 7, 5, 8]
    D = len(parents)
    call = attention_call(random.Random("path"), DEVICE, dtype, heads=(6, 2), kv_lens=[prefix + D], q_lens=[D],
                          trees=[parents], extra_cols=8)
    backend = _backend(True)
    a = call.args
    tree_out = _invariant(_backend(True, programs), a)
    r = int(a["req_pool_indices"][0])
    for i in range(D):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        table = a["req_to_token"].clone()
        table[r, prefix:prefix + len(path)] = a["req_to_token"][r, [prefix + j for j in reversed(path)]]
        decode = _invariant(backend, a, req_to_token=table, q=a["q"][i:i + 1].contiguous(), tree_mask=None,
                            kv_lens=torch.tensor([prefix + len(path)], device=DEVICE),
                            q_lens=torch.tensor([1], device=DEVICE))
        assert_invariant(tree_out[i], decode[0], f"node {i} (path {path[::-1]}) against its decode")


@pytest.mark.parametrize("programs", [1, 40, 4096], ids=lambda p: f"{p}-programs")
@pytest.mark.parametrize("prefix", [29, 300], ids=["one-split", "splits-before-the-chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_chain_as_causal_extend_equals_decode(dtype, prefix, programs):
    """Batch-invariant mode: a chain of drafts attended as a causal extend (no tree mask; tiles of
    several nodes, which share each key read) gives each node the bits of its decode, and of the
    same chain read node by node along its path under its tree mask."""
    D = 12
    call = attention_call(random.Random("chain"), DEVICE, dtype, heads=(6, 2), kv_lens=[prefix + D], q_lens=[D],
                          trees=[list(range(-1, D - 1))], extra_cols=8)
    a = call.args
    backend = _backend(True, programs)
    extend = _invariant(backend, a, tree_mask=None)
    assert_invariant(extend, _invariant(backend, a), "the chain as an extend against its tree")
    for i in range(D):
        decode = _invariant(_backend(True), a, q=a["q"][i:i + 1].contiguous(), tree_mask=None,
                            kv_lens=torch.tensor([prefix + i + 1], device=DEVICE),
                            q_lens=torch.tensor([1], device=DEVICE))
        assert_invariant(extend[i], decode[0], f"node {i} against its decode")


@pytest.mark.parametrize("name", ["tree", "decode"])
def test_merge_of_several_rows_skips_empty_splits_to_the_same_bits(name):
    """Merge programs of several rows read only the splits that saw keys (``SKIP_EMPTY``); one-row
    programs read every split. Never folding, the batch-invariant mode's splits (most of them past
    every context under the table's 300 extra columns) merge to the same bits either way."""
    a = attention_call(random.Random(f"skip-{name}"), DEVICE, torch.bfloat16, heads=(6, 2),
                       extra_cols=300, **CASES[name]).args
    results = []
    for programs in (1, 1 << 20):  # rows a merge program: 16, then 1
        backend = _backend(True, programs)
        backend.launch = replace(backend.launch, attn_invariant_fold=None)
        results.append(_invariant(backend, a))
    assert_invariant(results[0], results[1], "merged in programs of 16 rows against one row")
    want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(results[0].cpu().double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("mode", ["one-pass", "split-keys", "invariant-1", "invariant-40", "invariant-4096"])
@pytest.mark.parametrize("prefix", [29, 300], ids=["one-split", "splits-before-the-tree"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain-as-extend"])
def test_active_queries_keep_their_bits(tree, prefix, mode):
    """A layout's ``q_active`` zeroes the rows of the queries it leaves out (tiles wholly past it walk
    no key) and leaves the others' bits as they were, in every launch path: one pass, key splits and
    their merge, and the batch-invariant mode's shared prefix, node paths and folds."""
    parents = [-1, 0, 0, 1, 2, 1, 3, 4, 6, 7, 5, 8] if tree else list(range(-1, 11))
    D = len(parents)
    a = attention_call(random.Random(f"active-{prefix}"), DEVICE, torch.bfloat16, heads=(6, 2),
                       kv_lens=[prefix + D, 40 + D, 7 + D], q_lens=[D] * 3, trees=[parents] * 3, extra_cols=8).args
    if not tree:
        a["tree_mask"] = None
    invariant = mode.startswith("invariant")
    backend = _backend(mode != "one-pass", int(mode.split("-")[1]) if invariant else None)
    q_active = torch.tensor([0, 5, D + 3], device=DEVICE)

    def run(active):
        width = a["req_to_token"].shape[1] if invariant else a["max_kv_len"]
        layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                          a["q"].shape[0], a["tree_mask"], width, invariant, active)
        return backend.attention(**a, layout=layout)

    full, got = run(None), run(q_active)
    active = torch.cat([torch.arange(D, device=DEVICE) < k for k in q_active.tolist()])
    assert bool((got[~active] == 0).all()), "a query past q_active has a nonzero row"
    assert_invariant(got[active], full[active], "the active queries against the call without q_active")


@pytest.mark.parametrize("block_q", [1, 5, 16])
@pytest.mark.parametrize("batch", [1, 7, 40])
def test_the_plan_kernel_tiles_each_request_in_order(block_q, batch):
    """The attention plan's one kernel: the query lengths (negatives as 0), their offsets, and the
    tile table of ``block_q`` queries a tile, entry by entry as the batch's requests cut into
    tiles give it, the tiles past the last request marked with B."""
    from ngram_hal.kernels.triton.attention import Plan

    gen = torch.Generator().manual_seed(block_q * 100 + batch)
    q_lens = torch.randint(-2, 40, (batch,), generator=gen)
    q_lens[0] = max(int(q_lens[0]), 1)
    lens = q_lens.clamp(min=0)
    N = int(lens.sum())
    layout = types.SimpleNamespace(q_lens=q_lens.to(DEVICE), batch_size=batch, num_queries=N)
    plan = Plan(layout, CudaBackend.launch)
    tiles = plan.tiles(block_q)
    want_req, want_q0 = [], []
    for b, n in enumerate(lens.tolist()):
        for q0 in range(0, n, block_q):
            want_req.append(b)
            want_q0.append(q0)
    count = min(N, (N + batch * (block_q - 1)) // block_q)
    assert count >= len(want_req)
    assert tiles.req.tolist() == want_req + [batch] * (count - len(want_req))
    assert tiles.q0.tolist()[:len(want_q0)] == want_q0
    assert plan.q_lens.tolist() == lens.tolist()
    assert plan.q_start.tolist() == (torch.cumsum(lens, 0) - lens).tolist()
