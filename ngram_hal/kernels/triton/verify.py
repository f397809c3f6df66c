"""Tree verification, greedy and by target-only rejection sampling, each in one Triton kernel.

A program takes a block of requests and walks their trees together, one node per step, for at
most D steps (it stops early once every walk has ended). Before the walk it turns the retrieve
links into, for every node, its parent and its place among its siblings (list ranking by pointer
doubling over ``[requests, node, node]`` tiles), so each step is a handful of tile operations
over the current node's children rather than a walk along the sibling chain.

Sampling reads the current node's probability row once per step for its sum (blocks of the
vocabulary added lane by lane, one reduction per row); the children's masses are gathers. The
bonus token is drawn after the walk by a blocked scan of the final node's row that zeroes the
rejected children's tokens on the fly and stops at the block where the residual CDF crosses the
threshold. Probabilities are float32 whatever the input dtype.

Whatever the links, tokens and probabilities hold, the kernels neither read nor write outside
the tensors and every loop is bounded: a link outside ``[1, D)`` counts as none, a token outside
``[0, V)`` has mass 0, and a ``retrieve_index`` entry outside ``[0, B*D)`` is not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, pow2_block, require_contiguous

# Node pairs per thread in the walk's [node, node] tiles, and probabilities per thread in a
# vocabulary block: they set the warps of the launches.
_PAIRS_PER_THREAD = 8
_PROBS_PER_THREAD = 16


@triton.jit
def _take(x, idx, lanes):
    """``x[b, idx[b, i]]`` for [BLOCK_B, BLOCK_D] tiles (0 where ``idx`` is not a lane)."""
    return tl.sum(tl.where(idx[:, :, None] == lanes[None, None, :], x[:, None, :], 0), axis=2)


@triton.jit
def _links(ptr, offsets, inside, D):
    """A [BLOCK_B, BLOCK_D] tile of retrieve links as int32, -1 for none or out of ``[1, D)``."""
    link = tl.load(ptr + offsets, mask=inside, other=-1)
    return tl.where((link >= 1) & (link < D), link, -1).to(tl.int32)


@triton.jit
def _siblings(next_token, next_sibling, lanes, LOG_D: tl.constexpr):
    """Each node's parent (int32[BLOCK_B, BLOCK_D], -1 for none) and ``earlier[b, j, k]``: node k
    is a sibling of node j that comes before it in the sibling chain (ties broken by index)."""
    # The node whose next sibling is j, then the head of j's chain and j's distance from it.
    pred = tl.max(tl.where(next_sibling[:, None, :] == lanes[None, :, None], lanes[None, None, :], -1), axis=2)
    head = tl.where(pred >= 0, pred, lanes[None, :])
    rank = (pred >= 0).to(tl.int32)
    for _ in tl.static_range(LOG_D):
        rank = rank + _take(rank, head, lanes)
        head = _take(head, head, lanes)
    parent = tl.max(tl.where(next_token[:, None, :] == head[:, :, None], lanes[None, None, :], -1), axis=2)
    parent_j = parent[:, :, None]
    rank_j = rank[:, :, None]
    rank_k = rank[:, None, :]
    before = (rank_k < rank_j) | ((rank_k == rank_j) & (lanes[None, None, :] < lanes[None, :, None]))
    earlier = (parent_j == parent[:, None, :]) & (parent_j >= 0) & before
    return parent, earlier


@triton.jit
def _trees(cand_ptr, index_ptr, next_token_ptr, next_sibling_ptr, B, D,
           BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    """This program's requests and their trees: ``req`` [BLOCK_B], ``lanes`` [BLOCK_D], flat
    offsets ``tile`` and mask ``inside`` of the [BLOCK_B, BLOCK_D] tiles, the tokens ``cand``
    and flat ids ``flat`` (-1 off the tile), each node's ``parent``, the ``earlier`` sibling
    relation and ``order``, a node's place among its siblings."""
    req = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    lanes = tl.arange(0, BLOCK_D)
    tile = req[:, None].to(tl.int64) * D + lanes[None, :]
    inside = (req < B)[:, None] & (lanes[None, :] < D)
    cand = tl.load(cand_ptr + tile, mask=inside, other=-1)
    flat = tl.load(index_ptr + tile, mask=inside, other=-1)
    parent, earlier = _siblings(_links(next_token_ptr, tile, inside, D), _links(next_sibling_ptr, tile, inside, D),
                                lanes, LOG_D)
    return req, lanes, tile, inside, cand, flat, parent, earlier, tl.sum(earlier.to(tl.int32), axis=2)


@triton.jit
def _visit(cur, active, count, lanes, flat, accept, visited):
    """Each walking request's current node ``cur``: its flat id goes to entry ``count`` of its
    ``accept`` row and it is marked ``visited``. Returns ``(at, accept, visited)``, ``at`` the
    node's lane."""
    at = (lanes[None, :] == cur[:, None]) & active[:, None]
    here = tl.sum(tl.where(at, flat, 0), axis=1)
    accept = tl.where(active[:, None] & (lanes[None, :] == count[:, None]), here[:, None], accept)
    return at, accept, visited | at


@triton.jit
def _store(predicts_ptr, accept_index_ptr, accept_len_ptr, req, tile, inside, flat, accept, count, visited, value,
           B, D):
    """The outputs: ``accept`` rows, ``count`` lengths, and ``value`` at the visited nodes' flat
    ids that lie in ``[0, B*D)``."""
    tl.store(accept_index_ptr + tile, accept, mask=inside)
    tl.store(accept_len_ptr + req, count.to(tl.int64), mask=req < B)
    write = visited & (flat >= 0) & (flat < B * D)
    tl.store(predicts_ptr + tl.where(write, flat, 0), value, mask=write)


@triton.jit
def verify_greedy_kernel(cand_ptr, index_ptr, next_token_ptr, next_sibling_ptr, target_ptr,
                          predicts_ptr, accept_index_ptr, accept_len_ptr, B, D,
                          BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    req, lanes, tile, inside, cand, flat, parent, earlier, order = _trees(
        cand_ptr, index_ptr, next_token_ptr, next_sibling_ptr, B, D, BLOCK_B, BLOCK_D, LOG_D)
    target = tl.load(target_ptr + tile, mask=inside, other=0)

    none = BLOCK_D * BLOCK_D
    cur = tl.zeros([BLOCK_B], dtype=tl.int32)
    active = req < B
    count = tl.zeros([BLOCK_B], dtype=tl.int32)
    accept = tl.full([BLOCK_B, BLOCK_D], -1, dtype=tl.int64)
    visited = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.int1)
    value = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.int64)
    walking = tl.sum(active.to(tl.int32), axis=0)
    while walking > 0:
        at, accept, visited = _visit(cur, active, count, lanes, flat, accept, visited)
        want = tl.sum(tl.where(at, target, 0), axis=1)
        value = tl.where(at, want[:, None], value)
        count += active.to(tl.int32)
        match = (parent == cur[:, None]) & (cand == want[:, None]) & (count < D)[:, None]
        key = tl.min(tl.where(match, order * BLOCK_D + lanes[None, :], none), axis=1)
        found = active & (key < none)
        cur = tl.where(found, key % BLOCK_D, cur)
        active = found
        walking = tl.sum(active.to(tl.int32), axis=0)
    _store(predicts_ptr, accept_index_ptr, accept_len_ptr, req, tile, inside, flat, accept, count, visited, value,
           B, D)


@triton.jit
def verify_sample_kernel(cand_ptr, index_ptr, next_token_ptr, next_sibling_ptr, probs_ptr, coins_ptr, final_ptr,
                          predicts_ptr, accept_index_ptr, accept_len_ptr, B, D, V,
                          BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr,
                          BLOCK_V: tl.constexpr, NUM_V_BLOCKS: tl.constexpr):
    req, lanes, tile, inside, cand, flat, parent, earlier, order = _trees(
        cand_ptr, index_ptr, next_token_ptr, next_sibling_ptr, B, D, BLOCK_B, BLOCK_D, LOG_D)
    coins = tl.load(coins_ptr + tile, mask=inside, other=1.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_V)
    in_req = req < B
    # A child whose token an earlier sibling already carries has mass 0 (that token was zeroed
    # when the earlier sibling was rejected); so has a token outside the vocabulary.
    repeat = tl.max((earlier & (cand[:, :, None] == cand[:, None, :])).to(tl.int32), axis=2) > 0
    fresh_token = (cand >= 0) & (cand < V) & ~repeat

    none = BLOCK_D * BLOCK_D
    cur = tl.zeros([BLOCK_B], dtype=tl.int32)
    active = in_req
    count = tl.zeros([BLOCK_B], dtype=tl.int32)
    accept = tl.full([BLOCK_B, BLOCK_D], -1, dtype=tl.int64)
    visited = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.int1)
    value = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.int64)
    # The node where each walk ends, with what the bonus draw needs from it.
    end_node = tl.zeros([BLOCK_B], dtype=tl.int32)
    end_rest = tl.zeros([BLOCK_B], dtype=tl.float32)
    end_token = tl.full([BLOCK_B, BLOCK_D], -1, dtype=tl.int64)
    walking = tl.sum(active.to(tl.int32), axis=0)
    while walking > 0:
        row = (req.to(tl.int64) * D + cur) * V
        # The row's sum: blocks added lane by lane, one reduction at the end, so that the
        # blocks' loads can all be in flight together.
        acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        for blk in tl.static_range(NUM_V_BLOCKS):
            col = blk * BLOCK_V + cols
            acc += tl.load(probs_ptr + row[:, None] + col[None, :], mask=active[:, None] & (col[None, :] < V),
                           other=0.0).to(tl.float32)
        child = (parent == cur[:, None]) & active[:, None] & (count < D - 1)[:, None]
        fresh = child & fresh_token
        mass = tl.load(probs_ptr + row[:, None] + tl.where(fresh, cand, 0), mask=fresh, other=0.0).to(tl.float32)
        # q outside the children's tokens, then the q each child sees: that plus its own mass
        # and its later siblings' (the earlier ones were zeroed on rejection).
        rest = tl.maximum(tl.sum(acc, axis=1) - tl.sum(mass, axis=1), 0.0)
        seen = rest[:, None] + tl.sum(tl.where(earlier, 0.0, mass[:, None, :]), axis=2)
        key = tl.min(tl.where(fresh & (coins * seen < mass), order * BLOCK_D + lanes[None, :], none), axis=1)
        found = active & (key < none)
        nxt = key % BLOCK_D

        at, accept, visited = _visit(cur, active, count, lanes, flat, accept, visited)
        taken = tl.sum(tl.where(lanes[None, :] == nxt[:, None], cand, 0), axis=1)
        value = tl.where(at, taken[:, None], value)
        count += active.to(tl.int32)
        ends = active & ~found
        end_node = tl.where(ends, cur, end_node)
        end_rest = tl.where(ends, rest, end_rest)
        end_token = tl.where(ends[:, None], tl.where(fresh, cand, -1), end_token)
        cur = tl.where(found, nxt, cur)
        active = found
        walking = tl.sum(active.to(tl.int32), axis=0)

    # Bonus token: the smallest t with cumsum(residual)[t] > u * sum(residual), the residual
    # being the row with the rejected children's tokens zeroed. The scan goes block by block and
    # stops at the crossing; the running sum it carries is the last CDF value of a block that did
    # not cross, so a zeroed token can never be the first to cross.
    threshold = tl.load(final_ptr + req, mask=in_req, other=0.0).to(tl.float32) * end_rest
    end_row = (req.to(tl.int64) * D + end_node) * V
    run = tl.zeros([BLOCK_B], dtype=tl.float32)
    bonus = tl.zeros([BLOCK_B], dtype=tl.int64) + (V - 1)
    searching = in_req
    blk = tl.zeros([BLOCK_B], dtype=tl.int32)
    left = tl.sum(searching.to(tl.int32), axis=0)
    while left > 0:
        col = blk[:, None] * BLOCK_V + cols[None, :]
        live = searching[:, None] & (col < V)
        x = tl.load(probs_ptr + end_row[:, None] + col, mask=live, other=0.0).to(tl.float32)
        start = blk[:, None] * BLOCK_V
        in_block = (end_token >= start) & (end_token < start + BLOCK_V)
        if tl.sum(tl.sum(in_block.to(tl.int32), axis=1), axis=0) > 0:
            for j in tl.static_range(BLOCK_D):
                rejected = tl.sum(tl.where(lanes[None, :] == j, end_token, 0), axis=1)
                x = tl.where(col == rejected[:, None], 0.0, x)
        c = run[:, None] + tl.cumsum(x, axis=1)
        hit = tl.min(tl.where((c > threshold[:, None]) & live, col, V), axis=1)
        got = hit < V
        bonus = tl.where(searching & got, hit, bonus)
        run = tl.max(c, axis=1)
        searching = searching & ~got & (blk + 1 < NUM_V_BLOCKS)
        blk += 1
        left = tl.sum(searching.to(tl.int32), axis=0)

    value = tl.where((lanes[None, :] == end_node[:, None]) & in_req[:, None], bonus[:, None], value)
    _store(predicts_ptr, accept_index_ptr, accept_len_ptr, req, tile, inside, flat, accept, count, visited, value,
           B, D)


def greedy_launch(B: int, D: int, cfg: LaunchConfig) -> dict[str, int]:
    """The greedy kernel's block sizes and ``num_warps`` for B requests of D nodes (B, D >= 1);
    the grid is ``cdiv(B, BLOCK_B)`` programs."""
    block_d = pow2_block(D)
    block_b = cfg.rows_per_program(B, block_d * block_d)
    return {"BLOCK_B": block_b, "BLOCK_D": block_d, "LOG_D": block_d.bit_length() - 1,
            "num_warps": cfg.warps(block_b * block_d * block_d // _PAIRS_PER_THREAD)}


def sample_launch(B: int, D: int, V: int, cfg: LaunchConfig) -> dict[str, int]:
    """The sampling kernel's block sizes and ``num_warps`` for B requests of D nodes over a
    vocabulary of V (B, D >= 1); the grid is ``cdiv(B, BLOCK_B)`` programs."""
    launch = greedy_launch(B, D, cfg)
    block_d = launch["BLOCK_D"]
    block_v = min(pow2_block(V), pow2_block(cfg.vocab_block))
    block_b = cfg.rows_per_program(B, max(block_d * block_d, block_v))
    threads = block_b * max(block_d * block_d // _PAIRS_PER_THREAD, block_v // _PROBS_PER_THREAD)
    return {**launch, "BLOCK_B": block_b, "BLOCK_V": block_v, "NUM_V_BLOCKS": triton.cdiv(V, block_v),
            "num_warps": cfg.warps(threads)}


def _outputs(B: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``predicts`` (zeros: the kernels write only at accepted nodes), ``accept_index`` and
    ``accept_len`` (written whole by the kernels; zeros when there are no nodes)."""
    predicts = torch.zeros(B * D, dtype=torch.int64, device=device)
    accept_index = torch.empty((B, D), dtype=torch.int64, device=device)
    accept_len = torch.empty(B, dtype=torch.int64, device=device) if D else torch.zeros(B, dtype=torch.int64,
                                                                                       device=device)
    return predicts, accept_index, accept_len


def verify_tree_greedy(candidates: torch.Tensor, retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor,
                       retrieve_next_sibling: torch.Tensor, target_predict: torch.Tensor, cfg: LaunchConfig
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification (``Backend.verify_tree_greedy``), one launch after zeroing ``predicts``.

    Args:
        candidates: int64[B, D] draft tokens, node 0 the root.
        retrieve_index, retrieve_next_token, retrieve_next_sibling: int64[B, D], as from
            ``reconstruct_tree``.
        target_predict: int64[B, D], the target's argmax after each node.
        cfg: the backend's launch configuration. Every tensor contiguous, on one device.
    Returns:
        ``predicts`` int64[B*D], ``accept_index`` int64[B, D] (-1 padded), ``accept_len`` int64[B].
    """
    require_contiguous("verify_tree_greedy", candidates=candidates, retrieve_index=retrieve_index,
                       retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
                       target_predict=target_predict)
    B, D = candidates.shape
    predicts, accept_index, accept_len = _outputs(B, D, candidates.device)
    if B * D == 0:
        return predicts, accept_index, accept_len
    launch = greedy_launch(B, D, cfg)
    verify_greedy_kernel[(triton.cdiv(B, launch["BLOCK_B"]),)](
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
        predicts, accept_index, accept_len, B, D, **launch, **cfg.options())
    return predicts, accept_index, accept_len


def verify_tree_sample(candidates: torch.Tensor, retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor,
                       retrieve_next_sibling: torch.Tensor, target_probs: torch.Tensor,
                       uniform_samples: torch.Tensor, uniform_final: torch.Tensor, cfg: LaunchConfig
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target-only tree rejection sampling (``Backend.verify_tree_sample``), one launch after
    zeroing ``predicts``.

    Args:
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling: int64[B, D].
        target_probs: float32, float16 or bfloat16 [B, D, V], read as float32.
        uniform_samples: float[B, D], each node's acceptance coin. uniform_final: float[B], the
            bonus coin.
        cfg: the backend's launch configuration (``vocab_block`` sets the scan's block). Every
            tensor contiguous, on one device.
    Returns:
        ``predicts`` int64[B*D], ``accept_index`` int64[B, D] (-1 padded), ``accept_len`` int64[B].
    """
    require_contiguous("verify_tree_sample", candidates=candidates, retrieve_index=retrieve_index,
                       retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
                       target_probs=target_probs, uniform_samples=uniform_samples, uniform_final=uniform_final)
    B, D = candidates.shape
    V = target_probs.shape[2]
    predicts, accept_index, accept_len = _outputs(B, D, candidates.device)
    if B * D == 0:
        return predicts, accept_index, accept_len
    launch = sample_launch(B, D, V, cfg)
    verify_sample_kernel[(triton.cdiv(B, launch["BLOCK_B"]),)](
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_probs,
        uniform_samples, uniform_final, predicts, accept_index, accept_len, B, D, V, **launch, **cfg.options())
    return predicts, accept_index, accept_len


class TritonVerifyOps:
    """Mixin: the verification kernels as the ``_<op>`` of :class:`~ngram_hal.backend.Backend` (which
    has validated the arguments), launched with the backend's ``launch``."""

    def _verify_tree_greedy(self, *args):
        return verify_tree_greedy(*args, self.launch)

    def _verify_tree_sample(self, *args):
        return verify_tree_sample(*args, self.launch)
