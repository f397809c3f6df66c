"""Verify glue: draft tree -> retrieve links -> greedy or sampled verify -> KV compaction -> tokens.

Backend-neutral: every device step is a HAL op or a plain torch op, and nothing reads device data
on the host, so a whole verify step can be enqueued while the host prepares the next one.

Slot discipline. Request b (pool row ``r_b``, ``seq_len_b`` tokens with KV in the cache) verifies
a tree of D nodes, node 0 being its last committed token, whose KV is not in the cache yet. The
nodes occupy positions ``seq_len_b .. seq_len_b + D - 1`` of its ``req_to_token`` row:
``out_cache_loc[b*D + i] = req_to_token[r_b, seq_len_b + i]`` (:func:`tree_cache_locs`), and the
target forward writes node i's K/V there. After verify, :func:`commit` moves the root and the
accepted nodes into positions ``seq_len_b .. seq_len_b + accept_len_b - 1``; the other slots stay
owned by the request and are written again next step. A request therefore needs slots up to
``seq_len + D`` every step; :func:`slots_needed` reserves ``2*D`` ahead so that allocation happens
about every other step rather than every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import contract as c
from ..backend import Backend
from ..kv_cache import KVCache
from .relay import OverlapRelay

CommitResult = OverlapRelay
"""What :func:`commit` returns: exactly the state the overlap relay carries to the next step."""


@dataclass(frozen=True)
class TreeBatch:
    """B draft trees of D nodes, ready for the target forward and verify.

    Attributes:
        positions: int64[B*D], ``seq_len + depth`` of each node (the target's position ids).
        retrieve_index, retrieve_next_token, retrieve_next_sibling: int64[B, D] retrieve links.
        candidates: int64[B, D], the node tokens (node 0 the root).
        tree_mask: bool[B, D, D], the attention mask among nodes.
    """

    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    candidates: torch.Tensor
    tree_mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.candidates.shape[0]

    @property
    def tree_size(self) -> int:
        return self.candidates.shape[1]

    @property
    def retrieve(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(retrieve_index, retrieve_next_token, retrieve_next_sibling)``."""
        return self.retrieve_index, self.retrieve_next_token, self.retrieve_next_sibling


@dataclass(frozen=True)
class VerifyOutput:
    """A verify op's result.

    Attributes:
        predicts: int64[B*D], at each accepted node the token committed after it.
        accept_index: int64[B, D], flat ids of the root and the accepted nodes, -1 padded.
        accept_len: int64[B], accepted drafts + 1.
    """

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_len: torch.Tensor


def slots_needed(seq_len: int, allocated_len: int, tree_size: int) -> int:
    """Slots to allocate for a request before a verify step (host ints).

    A step writes the D tree nodes at positions ``seq_len .. seq_len + D - 1``. When fewer than
    ``seq_len + D`` positions are allocated, extend to ``seq_len + 2*D``; otherwise nothing.
    """
    op = "slots_needed"
    c.check_int(op, "seq_len", seq_len)
    c.check_int(op, "allocated_len", allocated_len)
    c.check_int(op, "tree_size", tree_size, minimum=1)
    if allocated_len >= seq_len + tree_size:
        return 0
    return seq_len + 2 * tree_size - allocated_len


def tree_cache_locs(backend: Backend, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, tree_size: int) -> torch.Tensor:
    """``out_cache_loc`` int64[B*D]: entry ``b*D + i`` is ``req_to_token[r_b, seq_len_b + i]``."""
    c.check_int("tree_cache_locs", "tree_size", tree_size, minimum=1)
    B = req_pool_indices.shape[0]
    return backend.gather_cache_locs(req_to_token, req_pool_indices, seq_lens, seq_lens + tree_size,
                                     num_tokens=B * tree_size)


def prepare_tree(backend: Backend, draft_tokens: torch.Tensor, tree_mask: torch.Tensor,
                 seq_lens: torch.Tensor) -> TreeBatch:
    """Positions and retrieve links for B draft trees.

    Args:
        draft_tokens: int64[B*D], request b's nodes at ``b*D .. b*D + D - 1`` in BFS order.
        tree_mask: bool[B, D, D]; ``tree_mask[b, i, j]`` when node j is node i or an ancestor.
        seq_lens: int64[B], tokens of each request with KV in the cache (the root's position).
    """
    c.check_mask("prepare_tree", "tree_mask", tree_mask, backend.device, ndim=3)
    B, D, _ = tree_mask.shape
    c.check_index("prepare_tree", "draft_tokens", draft_tokens, backend.device, shape=(B * D,))
    positions, retrieve_index, next_token, next_sibling = backend.reconstruct_tree(tree_mask, seq_lens)
    return TreeBatch(positions, retrieve_index, next_token, next_sibling, draft_tokens.view(B, D), tree_mask)


def verify_greedy(backend: Backend, tree: TreeBatch, logits: torch.Tensor) -> VerifyOutput:
    """Greedy verify against the target's logits float[B*D, V] (row ``b*D + i``: after node i)."""
    B, D = tree.batch_size, tree.tree_size
    c.check_float("verify_greedy", "logits", logits, backend.device, shape=(B * D, None))
    return verify_tokens(backend, tree, logits.argmax(-1))


def verify_tokens(backend: Backend, tree: TreeBatch, target_tokens: torch.Tensor) -> VerifyOutput:
    """Verify against the target's own token after each node, int64[B*D] (its argmax, or a token
    it sampled there): a draft is accepted exactly when it equals that token."""
    B, D = tree.batch_size, tree.tree_size
    return VerifyOutput(*backend.verify_tree_greedy(tree.candidates, *tree.retrieve, target_tokens.view(B, D)))


def verify_sample(backend: Backend, tree: TreeBatch, probs: torch.Tensor,
                  generator: torch.Generator | None = None, uniform_samples: torch.Tensor | None = None,
                  uniform_final: torch.Tensor | None = None) -> VerifyOutput:
    """Verify by target-only rejection sampling against the target's probabilities.

    Args:
        probs: float[B*D, V], row ``b*D + i`` the target distribution after node i (temperature,
            top-k and top-p already applied).
        generator: draws the coins when ``uniform_samples`` / ``uniform_final`` are not given;
            it lives on the backend's device.
        uniform_samples: float[B, D], the acceptance coin of each node. uniform_final: float[B].
    """
    B, D = tree.batch_size, tree.tree_size
    c.check_float("verify_sample", "probs", probs, backend.device, shape=(B * D, None))
    if uniform_samples is None:
        uniform_samples = torch.rand((B, D), generator=generator, device=probs.device)
    if uniform_final is None:
        uniform_final = torch.rand((B,), generator=generator, device=probs.device)
    target_probs = probs.view(B, D, probs.shape[1])
    return VerifyOutput(*backend.verify_tree_sample(tree.candidates, *tree.retrieve, target_probs,
                                                    uniform_samples, uniform_final))


def commit(backend: Backend, kv: KVCache, out: VerifyOutput, out_cache_loc: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> CommitResult:
    """Compact the accepted nodes' KV and lay out the committed tokens.

    Moves K/V of the root and accepted nodes from their tree slots to positions
    ``seq_len_b .. seq_len_b + accept_len_b - 1`` of each request's row.

    Args:
        out_cache_loc: int64[B*D], the tree nodes' slots (see :func:`tree_cache_locs`).
        req_to_token: int64[R, M]. req_pool_indices, seq_lens: int64[B], as given to the tree.
    Returns:
        accept_tokens int64[B*D] (committed tokens at ``b*D + j`` for ``j < accept_len_b``, -1
        elsewhere), accept_lens int64[B], new_seq_lens = seq_lens + accept_lens.
    """
    src, dst = backend.accepted_kv_moves(out_cache_loc, out.accept_index, req_to_token, req_pool_indices, seq_lens)
    backend.move_kv(kv, src, dst)
    B, D = out.accept_index.shape
    tokens = out.predicts.gather(0, out.accept_index.clamp(min=0).reshape(-1))
    accept_tokens = torch.where(out.accept_index.reshape(-1) >= 0, tokens, -1)
    return CommitResult(accept_tokens, out.accept_len, seq_lens + out.accept_len, D)
