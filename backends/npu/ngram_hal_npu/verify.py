"""Tree verification for Ascend, greedy and by target-only rejection sampling, without a walk.

A walk down the tree takes one step per depth, each a round of small kernels. Here every node
decides at once which of its children it would accept, and the accepted path is then found by
pointer jumping over the parent links, in ``ceil(log2(D))`` rounds:

1. From the retrieve links, each node's parent and its rank among its siblings (list ranking
   along the sibling chains), and ``kids[b, p, r]``, the r-th child of node p.
2. Each node's chosen child: greedy, the first child whose token is the target's argmax there;
   sampling, the first child that passes its coin against the target's residual distribution.
3. A node is accepted when it is the chosen child of its parent and so is every ancestor.
   Accepted nodes, in index order, are the path from the root (a child's index exceeds its
   parent's); the deepest one ends it.

Arguments were validated by :class:`ngram_hal.Backend`.
"""

from __future__ import annotations

import torch

from ngram_hal.contract import SENTINEL

from .indices import narrow, take
from .tree import node_take, scatter_nodes


def _rounds(D: int) -> int:
    """Pointer-jumping rounds that cover a chain of up to ``D - 1`` links."""
    return max(D - 1, 1).bit_length()


def _jump(op: str, hop: torch.Tensor, value: torch.Tensor, combine) -> torch.Tensor:
    """``value`` folded along ``hop`` chains (a node at a chain's end hops to itself):
    after the rounds, ``value[i]`` combines ``value`` over i and every node its chain reaches."""
    for _ in range(_rounds(hop.shape[1])):
        value = combine(value, node_take(op, value, hop))
        hop = node_take(op, hop, hop)
    return value


def _children(op: str, next_token: torch.Tensor, next_sibling: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``parent`` int64[B, D] (-1 for the root) and ``kids`` int64[B, D, K], the children of
    each node in sibling order, -1 padded; K = max(D - 1, 1)."""
    B, D = next_token.shape
    node = torch.arange(D, dtype=torch.int64, device=next_token.device).expand(B, D)
    prev = scatter_nodes(op, B, D, next_sibling, node, next_sibling >= 0)
    opener = scatter_nodes(op, B, D, next_token, node, next_token >= 0)
    # List ranking: hop to the chain's first child, counting the links passed.
    hop, rank = torch.where(prev >= 0, prev, node), (prev >= 0).to(torch.int64)
    for _ in range(_rounds(D)):
        rank = rank + node_take(op, rank, hop)
        hop = node_take(op, hop, hop)
    parent = node_take(op, opener, hop)
    K = max(D - 1, 1)
    kids = scatter_nodes(op, B, D * K, parent * K + rank, node, (parent >= 0) & (rank < K)).view(B, D, K)
    return parent, kids


def _first(op: str, hit: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
    """The first kid (in sibling order) where ``hit``, or -1: int64[B, D] from [B, D, K]."""
    B, D, K = kids.shape
    rank = torch.arange(K, dtype=torch.int64, device=kids.device)
    first = torch.where(hit, rank, K).amin(-1)
    chosen = node_take(op, kids.view(B * D, K), first.clamp(max=K - 1).view(B * D, 1)).view(B, D)
    return torch.where(first < K, chosen, SENTINEL)


def _path(op: str, parent: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted, last)``: bool[B, D], the nodes on the accepted path (root included), and
    int64[B], its deepest node."""
    B, D = parent.shape
    node = torch.arange(D, dtype=torch.int64, device=parent.device).expand(B, D)
    has_parent = parent >= 0
    picked = ~has_parent | (node_take(op, chosen, parent.clamp(min=0)) == node)
    accepted = _jump(op, torch.where(has_parent, parent, node), picked, torch.logical_and)
    return accepted, torch.where(accepted, node, SENTINEL).amax(-1)


def _outputs(op: str, accepted: torch.Tensor, token: torch.Tensor, retrieve_index: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(predicts[B*D], accept_index[B, D], accept_len[B])`` from the accepted nodes and the
    token committed after each node (read at accepted nodes only)."""
    B, D = accepted.shape
    place = torch.cumsum(accepted.to(torch.int64), 1) - 1
    accept_index = scatter_nodes(op, B, D, place, retrieve_index, accepted)
    flat = torch.where(accepted, retrieve_index, B * D).reshape(-1)
    predicts = scatter_nodes(op, 1, B * D, flat.view(1, -1), token.reshape(1, -1), accepted.view(1, -1), fill=0)
    return predicts.view(B * D), accept_index, accepted.sum(-1)


def verify_tree_greedy(candidates: torch.Tensor, retrieve_index: torch.Tensor,
                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                       target_predict: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification (see ``Backend.verify_tree_greedy``): from the root, accept the
    first child in sibling order whose token equals the target's argmax at the current node.

    Args:
        candidates, retrieve_*, target_predict: int64[B, D].
    Returns:
        predicts int64[B*D], accept_index int64[B, D], accept_len int64[B].
    """
    op = "verify_tree_greedy"
    parent, kids = _children(op, retrieve_next_token, retrieve_next_sibling)
    valid = kids >= 0
    hit = valid & (node_take(op, candidates, kids.clamp(min=0)) == target_predict.unsqueeze(2))
    accepted, _ = _path(op, parent, _first(op, hit, kids))
    return _outputs(op, accepted, target_predict, retrieve_index)


def verify_tree_sample(candidates: torch.Tensor, retrieve_index: torch.Tensor,
                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                       target_probs: torch.Tensor, uniform_samples: torch.Tensor,
                       uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target-only tree rejection sampling (see ``Backend.verify_tree_sample``).

    At node p with target distribution q, child r (sibling order) with token t is accepted when
    ``uniform_samples[b, child] * S_r < m_r``: ``m_r`` is ``q[t]`` for the first child with token
    t and 0 for a repeat, ``S_r`` the mass left once the tokens of the children before r are
    zeroed, written as the mass outside every child's token plus ``m_r + m_{r+1} + ...`` (exact
    when one token is left). Every node computes its children's tests at once; the bonus token
    at the deepest accepted node is the smallest t with ``cumsum(q')[t] > uniform_final[b] *
    sum(q')``, q' its q without its children's tokens. Probabilities in float32.

    Args:
        candidates, retrieve_*: int64[B, D]. target_probs: float[B, D, V].
        uniform_samples: float[B, D]. uniform_final: float[B].
    Returns:
        predicts int64[B*D], accept_index int64[B, D], accept_len int64[B].
    """
    op = "verify_tree_sample"
    B, D, V = target_probs.shape
    parent, kids = _children(op, retrieve_next_token, retrieve_next_sibling)
    K = kids.shape[2]
    valid = kids >= 0
    child = kids.clamp(min=0)
    tok = node_take(op, candidates, child)
    earlier = torch.ones(K, K, dtype=torch.bool, device=kids.device).tril(diagonal=-1)
    repeat = ((tok.unsqueeze(3) == tok.unsqueeze(2)) & valid.unsqueeze(2) & earlier).any(-1)
    rows = torch.arange(B * D, dtype=torch.int64, device=kids.device).view(B, D, 1) * V
    # A token outside the vocabulary is out of range for the gather, never another node's entry.
    cell = torch.where((tok >= 0) & (tok < V), rows + tok, SENTINEL)
    probs = target_probs.reshape(B * D * V).float()
    mass = torch.where(valid & ~repeat, take(op, "candidates", probs, cell), 0.0)
    # q' of every node: its q with every child's token zeroed (a scratch element takes the rest).
    residual = torch.cat([probs, probs.new_zeros(1)])
    zeroed = narrow(op, "candidates", torch.where(valid, cell, B * D * V), B * D * V + 1)
    residual.index_put_((zeroed.reshape(-1),), probs.new_zeros(()))
    residual = residual[: B * D * V].view(B, D, V)
    seen = residual.sum(-1, keepdim=True) + mass.flip(-1).cumsum(-1).flip(-1)
    coins = node_take(op, uniform_samples.float(), child)
    chosen = _first(op, valid & (coins * seen < mass), kids)
    accepted, last = _path(op, parent, chosen)
    cdf = node_take(op, residual, last.unsqueeze(1)).squeeze(1).cumsum(-1)
    threshold = (uniform_final.float() * cdf[:, -1]).unsqueeze(1).contiguous()
    bonus = torch.searchsorted(cdf, threshold, right=True).clamp(max=V - 1)
    token = torch.where(chosen >= 0, node_take(op, candidates, chosen.clamp(min=0)), bonus)
    return _outputs(op, accepted, token, retrieve_index)


class NpuVerifyOps:
    """Mixin: the NPU backend's verification ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _verify_tree_greedy = staticmethod(verify_tree_greedy)
    _verify_tree_sample = staticmethod(verify_tree_sample)
