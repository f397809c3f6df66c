"""Scale tier: the ops at the sizes serving reaches, every result checked against the oracle.

* ``move_kv``: 1 to 16,384 pairs, random (sources that are other pairs' destinations), chained
  and cyclic, with -1 and ``src == dst`` pairs, on a cache of several layers;
* ``attention``: contexts of 1 to 32,768 keys, in every page size the backend lists (1, 16 and 64
  where it lists none: each request's positions fill whole pages taken in random order), decodes,
  a 64-query extend and 64-node trees in one batch, every layer of the cache read in turn, against
  dense float64 attention;
* trees of up to D = 64 nodes: ``reconstruct_tree``, ``verify_tree_greedy`` (a whole 64-node
  chain accepted), ``verify_tree_sample`` on dyadic inputs and ``accepted_kv_moves``.

``--scale full`` (the default on an accelerator) runs every size, each context in every pair of
KV dtype and page size; ``--scale reduced`` (the default on the CPU, where Triton kernels run
interpreted) runs the sizes marked for it, which still cross every tile boundary up to 64 nodes,
1,100 keys and 2,048 pairs, each context in one page size per dtype; the other sizes are skipped,
saying so.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from . import cases, oracle
from . import test_kv as kv_cases
from .checks import assert_bitwise, assert_equal, host, slots
from .test_attention import TOLERANCE, dense_attention, random_parents, tree_mask_of
from .test_tree_verify import (assert_verify_outputs, dyadic_inputs, expected_outputs, floats, links_of, mask_of,
                               oracle_greedy, oracle_sample, oracle_tree)

conformance = pytest.mark.conformance


@dataclass(frozen=True)
class Sizes:
    """The sizes one ``--scale`` set runs: move pairs, attention contexts (keys) and tree nodes."""

    moves: tuple[int, ...]
    contexts: tuple[int, ...]
    tree_nodes: tuple[int, ...]


SIZES = {
    "full": Sizes(moves=(1, 513, 2048, 16384), contexts=(1, 300, 1100, 4097, 32768), tree_nodes=(1, 17, 33, 64)),
    "reduced": Sizes(moves=(1, 513, 2048), contexts=(1, 300, 1100), tree_nodes=(1, 33, 64)),
}
"""What each ``--scale`` set runs; a test parametrized by a size outside the set skips."""
DEFAULT_PAGE_SIZES = (1, 16, 64)
"""The page sizes attention runs with for a backend that lists none (any page size)."""
HEADS, HEAD_DIM = (8, 2), 64


def _sizes(field: str) -> list[int]:
    return sorted({n for s in SIZES.values() for n in getattr(s, field)})


def _require(scale: str, field: str, n: int) -> None:
    if n not in getattr(SIZES[scale], field):
        pytest.skip(f"{field} = {n} is not in the '{scale}' scale set (--scale full runs it)")


def _dtypes(backend) -> list[torch.dtype]:
    return [getattr(torch, name) for name in backend.capabilities().kv_dtypes]


# ---------------------------------------------------------------- move_kv

@conformance(op="move_kv", tier="scale")
@pytest.mark.parametrize("pattern", kv_cases.MOVE_PATTERNS)
@pytest.mark.parametrize("n", _sizes("moves"))
def test_move_kv_at_scale(backend, device, scale, pattern, n):
    """n pairs over a cache of 3 layers: every K and V row is the definition's, bit for bit."""
    _require(scale, "moves", n)
    dtypes = _dtypes(backend)
    dtype = dtypes[kv_cases.MOVE_PATTERNS.index(pattern) % len(dtypes)]
    rng = random.Random(f"move-{pattern}-{n}")
    kv = cases.random_kv(rng, device, 3, n + n // 2 + 2, 2, 8, dtype)
    call = kv_cases.move_kv_call(rng, device, kv, n, pattern, sentinel_rate=0.05, identity_rate=0.05)
    src, dst = call.args["src"].tolist(), call.args["dst"].tolist()
    want_k, want_v = oracle.move_kv(host(kv.k), src, dst), oracle.move_kv(host(kv.v), src, dst)
    assert backend.move_kv(**call.args) is None
    S = kv.num_slots
    assert_bitwise(slots(kv.k, S), slots(want_k, S), f"{pattern} moves of {n} pairs ({dtype}): K")
    assert_bitwise(slots(kv.v, S), slots(want_v, S), f"{pattern} moves of {n} pairs ({dtype}): V")


# ---------------------------------------------------------------- attention

def paged_call(rng: random.Random, device, dtype: torch.dtype, kv_lens: list[int], q_lens: list[int],
               page_size: int, layer: int, num_layers: int = 2, trees: list[list[int]] | None = None) -> cases.Call:
    """An attention call whose requests hold their positions in whole pages of ``page_size`` slots,
    the pages in random order; the slots of the pages no request holds are NaN, so reading one
    shows. ``layer`` is the layer read; every layer holds its own random K/V."""
    B = len(kv_lens)
    pages = [math.ceil(t / page_size) for t in kv_lens]
    order = rng.sample(range(sum(pages) + 2), sum(pages) + 2)
    spare = order[sum(pages):]
    M = max(pages, default=0) * page_size + page_size
    rows = B + 1
    pool = rng.sample(range(rows), B)
    table = [[-1] * M for _ in range(rows)]
    at = 0
    for b in range(B):
        own = order[at:at + pages[b]]
        at += pages[b]
        table[pool[b]][:pages[b] * page_size] = [p * page_size + j for p in own for j in range(page_size)]
    kv = cases.random_kv(rng, device, num_layers, (sum(pages) + 2) * page_size, HEADS[1], HEAD_DIM, dtype)
    nan = [p * page_size + j for p in spare for j in range(page_size)]
    kv.k[:, nan] = float("nan")
    kv.v[:, nan] = float("nan")
    mask = None if trees is None else torch.tensor([tree_mask_of(p) for p in trees], dtype=torch.bool, device=device)
    return cases.Call("attention", {
        "q": cases.random_rows(rng, device, sum(q_lens), HEADS[0], HEAD_DIM, dtype), "kv": kv, "layer": layer,
        "req_to_token": cases.index(table, device), "req_pool_indices": cases.index(pool, device),
        "kv_lens": cases.index(kv_lens, device), "q_lens": cases.index(q_lens, device),
        "sm_scale": 1 / math.sqrt(HEAD_DIM), "tree_mask": mask, "max_kv_len": max(kv_lens)})


def check_attention(backend, call: cases.Call, what: str, magnitude: float = 1.0) -> None:
    """The backend's output against dense float64 attention over the same rows: finite everywhere,
    within the dtype's tolerance, its absolute part multiplied by ``magnitude`` (that of the values)."""
    a = call.args
    out = call.run(backend)
    assert out.dtype == a["q"].dtype and tuple(out.shape) == tuple(a["q"].shape), (
        f"{what}: output {out.dtype}{tuple(out.shape)}, q is {a['q'].dtype}{tuple(a['q'].shape)}")
    want = dense_attention(a["q"], a["kv"].k, a["kv"].v, a["layer"], a["req_to_token"], a["req_pool_indices"],
                           a["kv_lens"], a["q_lens"], a["sm_scale"], a["tree_mask"])
    got = host(out).double()
    assert bool(torch.isfinite(got).all()), f"{what}: output has NaN/inf (a key read outside the request's pages?)"
    atol, rtol = TOLERANCE[a["q"].dtype]
    err = (got - want).abs()
    bad = err > atol * magnitude + rtol * want.abs()
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {err.numel()} values off the float64 result, first "
                                 f"at query row {int(bad.nonzero()[0, 0])}, max abs error {err.max().item():.3g} "
                                 f"against values of magnitude {magnitude:.3g}")


def _page_sizes(backend) -> tuple[int, ...]:
    listed = backend.capabilities().page_sizes
    return tuple(listed) if listed else DEFAULT_PAGE_SIZES


def _combinations(backend, scale: str, keys: int) -> list[tuple[torch.dtype, int]]:
    """The (KV dtype, page size) pairs a context of ``keys`` runs: all of them in the full set; in
    the reduced set one page size per dtype, turning with the context, so that the reduced
    contexts together still run every pair (with three or fewer page sizes)."""
    dtypes, pages = _dtypes(backend), _page_sizes(backend)
    if scale == "full":
        return [(d, p) for d in dtypes for p in pages]
    turn = SIZES[scale].contexts.index(keys)
    return [(d, pages[(i + turn) % len(pages)]) for i, d in enumerate(dtypes)]


@conformance(op="attention", tier="scale")
@pytest.mark.parametrize("mode", ["causal", "tree"])
@pytest.mark.parametrize("keys", _sizes("contexts"))
def test_attention_long_context(backend, device, scale, keys, mode):
    """Requests of up to ``keys`` cached keys in every page size and KV dtype the backend lists.
    Causal: a decode over all ``keys``, a 64-query extend ending there, a decode over about half.
    Tree: two 64-node trees (random shapes) after prefixes of ``keys`` and about half of it."""
    _require(scale, "contexts", keys)
    for i, (dtype, page_size) in enumerate(_combinations(backend, scale, keys)):
        rng = random.Random(f"attention-{keys}-{mode}-{dtype}-{page_size}")
        half = keys // 2 + 1
        if mode == "causal":
            kv_lens, q_lens, trees = [keys, keys, half], [1, min(64, keys), 1], None
        else:
            trees = [random_parents(rng, 64) for _ in range(2)]
            kv_lens, q_lens = [keys + 64, half + 64], [64, 64]
        call = paged_call(rng, device, dtype, kv_lens, q_lens, page_size, layer=i % 2, trees=trees)
        check_attention(backend, call, f"{mode} over {keys} keys, {dtype}, pages of {page_size}, layer {i % 2}")


@conformance(op="attention", tier="scale")
def test_attention_reads_every_layer(backend, device):
    """Each of four layers, read in turn, gives that layer's result (K and V differ per layer; the
    KV dtypes the backend lists take turns)."""
    dtypes = _dtypes(backend)
    for layer in range(4):
        dtype = dtypes[layer % len(dtypes)]
        rng = random.Random(f"layers-{dtype}-{layer}")
        call = paged_call(rng, device, dtype, [300, 37, 129], [1, 5, 129], 16, layer, num_layers=4)
        check_attention(backend, call, f"layer {layer} of 4, {dtype}")


# ---------------------------------------------------------------- trees of up to 64 nodes

def _trees(rng: random.Random, B: int, D: int) -> list[list[int]]:
    """B trees of D nodes: a chain, a star, then random trees (parents before children)."""
    shapes = [[-1] + list(range(D - 1)), [-1] + [0] * (D - 1)]
    return (shapes + [random_parents(rng, D) for _ in range(B)])[:B]


@conformance(op="reconstruct_tree", tier="scale")
@pytest.mark.parametrize("D", _sizes("tree_nodes"))
def test_reconstruct_tree_at_scale(backend, device, scale, D):
    _require(scale, "tree_nodes", D)
    rng = random.Random(f"tree-{D}")
    parents = _trees(rng, 8, D)
    seq_lens = [rng.randint(0, 40000) for _ in parents]
    got = backend.reconstruct_tree(mask_of(parents, device), cases.index(seq_lens, device))
    want = [oracle_tree(p, s) for p, s in zip(parents, seq_lens)]
    assert_equal(got[0], [x for w in want for x in w[0]], f"D = {D}: positions")
    assert_equal(got[1], [[b * D + i for i in range(D)] for b in range(len(parents))], f"D = {D}: retrieve_index")
    assert_equal(got[2], [w[1] for w in want], f"D = {D}: retrieve_next_token")
    assert_equal(got[3], [w[2] for w in want], f"D = {D}: retrieve_next_sibling")


@conformance(op="verify_tree_greedy", tier="scale")
@pytest.mark.parametrize("D", _sizes("tree_nodes"))
def test_verify_tree_greedy_at_scale(backend, device, scale, D):
    """A D-node chain the target accepts whole, a star, and random trees over two tokens."""
    _require(scale, "tree_nodes", D)
    rng = random.Random(f"greedy-{D}")
    parents = _trees(rng, 8, D)
    tokens = [[7] + [rng.randrange(2) for _ in range(D - 1)] for _ in parents]
    target = [[rng.randrange(2) for _ in range(D)] for _ in parents]
    target[0] = tokens[0][1:] + [5]  # the chain: every draft is the target's next token
    walks = [oracle_greedy(p, t, g) for p, t, g in zip(parents, tokens, target)]
    assert len(walks[0][0]) == D
    got = backend.verify_tree_greedy(cases.index(tokens, device), *links_of(parents, device),
                                     cases.index(target, device))
    assert_verify_outputs(got, expected_outputs([w[0] for w in walks], [w[1] for w in walks], D), device,
                          f"D = {D}")


@conformance(op="verify_tree_sample", tier="scale")
@pytest.mark.parametrize("D", _sizes("tree_nodes"))
def test_verify_tree_sample_at_scale(backend, device, scale, D):
    """Dyadic probabilities and coins (every float step exact) over 8 trees of D nodes."""
    _require(scale, "tree_nodes", D)
    rng = random.Random(f"sample-{D}")
    parents = _trees(rng, 8, D)
    V = 6
    tokens = [[rng.randrange(V) for _ in range(D)] for _ in parents]
    probs, coins, final = dyadic_inputs(np.random.default_rng(D), len(parents), D, V)
    walks = [oracle_sample(p, t, probs[b].tolist(), coins[b].tolist(), float(final[b]))
             for b, (p, t) in enumerate(zip(parents, tokens))]
    got = backend.verify_tree_sample(cases.index(tokens, device), *links_of(parents, device), floats(probs, device),
                                     floats(coins, device), floats(final, device))
    assert_verify_outputs(got, expected_outputs([w[0] for w in walks], [w[1] for w in walks], D), device,
                          f"D = {D}")


@conformance(op="accepted_kv_moves", tier="scale")
@pytest.mark.parametrize("D", _sizes("tree_nodes"))
def test_accepted_kv_moves_at_scale(backend, device, scale, D):
    _require(scale, "tree_nodes", D)
    rng = random.Random(f"accepted-{D}")
    call = kv_cases.accepted_kv_moves_call(rng, device, batch=16, depth=D, rows=20, max_context=D + 300,
                                   num_slots=16 * D + 4096)
    src, dst = call.run(backend)
    a = {k: v.tolist() for k, v in call.args.items()}
    want_src, want_dst = oracle.accepted_kv_moves(a["out_cache_loc"], a["accept_index"], a["req_to_token"],
                                                  a["req_pool_indices"], a["seq_lens"])
    assert_equal(src, want_src, f"D = {D}: src")
    assert_equal(dst, want_dst, f"D = {D}: dst")
