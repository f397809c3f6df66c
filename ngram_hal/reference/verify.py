"""Tree verification, greedy and by target-only rejection sampling, in plain torch.

The walk down a draft tree is sequential in depth, so both ops loop over at most D steps, each a
handful of tensor ops over the whole batch; nothing reads device data on the host. Values the
contract forbids (checked only in strict mode) are masked as a kernel would mask them: a
retrieve link outside ``[0, D)`` is no link, a candidate token outside the vocabulary is never
accepted, and ``predicts`` is not written at a ``retrieve_index`` outside ``[0, B*D)``.
"""

from __future__ import annotations

import torch

from .ragged import within


def _children(retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor) -> torch.Tensor:
    """``kids[b, p, k]``: the k-th child of node p in sibling order, -1 padded; int64[B, D, K],
    K = max(D - 1, 1) (a node has at most D - 1 children)."""
    D = retrieve_next_token.shape[1]
    sibling = torch.where(within(retrieve_next_sibling, D), retrieve_next_sibling, -1)
    cur = torch.where(within(retrieve_next_token, D), retrieve_next_token, -1)
    columns = []
    for _ in range(max(D - 1, 1)):
        columns.append(cur)
        after = sibling.gather(1, cur.clamp(min=0))
        cur = torch.where(cur >= 0, after, -1)
    return torch.stack(columns, dim=-1)


def _row(table: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``table[b, node[b]]`` for a [B, D, K] table and int64[B, 1] nodes: [B, K]."""
    B, _, K = table.shape
    return table.gather(1, node.unsqueeze(-1).expand(B, 1, K)).squeeze(1)


def _first(hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of the first true entry of each row of bool[B, K] (clamped) and whether there is one."""
    K = hit.shape[1]
    slot = torch.arange(K, dtype=torch.int64, device=hit.device)
    first = torch.where(hit, slot, K).amin(-1, keepdim=True)
    return first.clamp(max=K - 1), first.squeeze(1) < K


def _outputs(accept_nodes: torch.Tensor, predicted: torch.Tensor, retrieve_index: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(predicts[B*D], accept_index[B, D], accept_len[B])`` from accepted node ids [B, D] (-1 padded)
    and the token committed after each of them [B, D]."""
    B, D = accept_nodes.shape
    accepted = accept_nodes >= 0
    flat = retrieve_index.gather(1, accept_nodes.clamp(min=0))
    accept_index = torch.where(accepted, flat, -1)
    # Entries for unaccepted columns land in a scratch element past the end.
    predicts = torch.zeros(B * D + 1, dtype=torch.int64, device=accept_nodes.device)
    predicts.scatter_(0, torch.where(accepted & within(flat, B * D), flat, B * D).reshape(-1), predicted.reshape(-1))
    return predicts[: B * D], accept_index, accepted.sum(-1)


def verify_tree_greedy(candidates: torch.Tensor, retrieve_index: torch.Tensor,
                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                       target_predict: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification (see ``Backend.verify_tree_greedy``).

    From the root, repeatedly accept the first child in sibling order whose token equals the
    target's argmax at the current node.

    Args:
        candidates, retrieve_*, target_predict: int64[B, D].
    Returns:
        predicts int64[B*D], accept_index int64[B, D], accept_len int64[B].
    """
    B, D = candidates.shape
    kids = _children(retrieve_next_token, retrieve_next_sibling)
    node = torch.zeros(B, 1, dtype=torch.int64, device=candidates.device)
    alive = torch.ones(B, dtype=torch.bool, device=candidates.device)
    nodes = [node.squeeze(1)]
    for _ in range(1, D):
        k = _row(kids, node)
        hit = (k >= 0) & (candidates.gather(1, k.clamp(min=0)) == target_predict.gather(1, node))
        first, found = _first(hit)
        alive = alive & found
        node = torch.where(alive.unsqueeze(1), k.gather(1, first), node)
        nodes.append(torch.where(alive, node.squeeze(1), -1))
    accept_nodes = torch.stack(nodes, dim=1)
    predicted = target_predict.gather(1, accept_nodes.clamp(min=0))
    return _outputs(accept_nodes, predicted, retrieve_index)


def verify_tree_sample(candidates: torch.Tensor, retrieve_index: torch.Tensor,
                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                       target_probs: torch.Tensor, uniform_samples: torch.Tensor,
                       uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target-only tree rejection sampling (see ``Backend.verify_tree_sample``).

    At the current node with target distribution q, the children are tried in sibling order:
    child i with token t is accepted when ``uniform_samples[b, i] * sum(q) < q[t]``, else
    ``q[t] = 0``. The first acceptance moves the walk to that child. When every child is rejected
    (or there is none) the bonus token is the smallest t with ``cumsum(q)[t] >
    uniform_final[b] * sum(q)``. Probabilities are handled in float32.

    All tests at one node run at once: with the children's first-occurrence masses ``m_k`` (0 for
    a token already tried) and ``r`` the mass of q outside the children's tokens, the q seen by
    child k sums to ``r + m_k + m_{k+1} + ...``, exact when only one token is left.

    Args:
        candidates, retrieve_*: int64[B, D]. target_probs: float[B, D, V].
        uniform_samples: float[B, D]. uniform_final: float[B].
    Returns:
        predicts int64[B*D], accept_index int64[B, D], accept_len int64[B].
    """
    B, D, V = target_probs.shape
    device = candidates.device
    kids = _children(retrieve_next_token, retrieve_next_sibling)
    K = kids.shape[2]
    earlier = torch.ones(K, K, dtype=torch.bool, device=device).tril(diagonal=-1)
    coins = uniform_samples.float()
    node = torch.zeros(B, 1, dtype=torch.int64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    residual = torch.zeros(B, V, dtype=torch.float32, device=device)
    nodes, taken, moved = [node.squeeze(1)], [], []
    for _ in range(D):
        k = _row(kids, node)
        tok = candidates.gather(1, k.clamp(min=0))
        valid = (k >= 0) & within(tok, V)
        q = _row(target_probs, node).float()
        repeat = ((tok.unsqueeze(2) == tok.unsqueeze(1)) & valid.unsqueeze(1) & earlier).any(-1)
        mass = torch.where(valid & ~repeat, q.gather(1, torch.where(valid, tok, 0)), 0.0)
        rest = torch.cat([q, q.new_zeros(B, 1)], dim=1).scatter(1, torch.where(valid, tok, V), 0.0)[:, :V]
        seen_sum = rest.sum(-1, keepdim=True) + mass.flip(-1).cumsum(-1).flip(-1)
        accept = valid & (coins.gather(1, k.clamp(min=0)) * seen_sum < mass)
        first, found = _first(accept)
        residual = torch.where((alive & ~found).unsqueeze(1), rest, residual)
        alive = alive & found
        taken.append(tok.gather(1, first).squeeze(1))
        moved.append(alive)
        node = torch.where(alive.unsqueeze(1), k.gather(1, first), node)
        nodes.append(torch.where(alive, node.squeeze(1), -1))
    cdf = residual.cumsum(-1)
    threshold = (uniform_final.float() * cdf[:, -1]).unsqueeze(1).contiguous()
    bonus = torch.searchsorted(cdf, threshold, right=True).clamp(max=V - 1)
    accept_nodes = torch.stack(nodes[:D], dim=1)
    predicted = torch.where(torch.stack(moved, dim=1), torch.stack(taken, dim=1), bonus)
    return _outputs(accept_nodes, predicted, retrieve_index)


class CpuVerifyOps:
    """Mixin: the reference's verification ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _verify_tree_greedy = staticmethod(verify_tree_greedy)
    _verify_tree_sample = staticmethod(verify_tree_sample)
