"""Draft-tree structure for Ascend: positions and retrieve links from a tree mask.

Parents come from the mask in one reduction: in BFS order a node's deepest strict ancestor is
its largest-index one. Siblings come from one sort of the nodes by (parent, index): in that
order each node's next sibling is its successor when both share the parent, and a parent's first
child opens its group. No ``[B, D, D]`` comparison tables, so the cost grows as ``D log D``.
Arguments were validated by :class:`ngram_hal.Backend`.
"""

from __future__ import annotations

import torch

from ngram_hal.contract import SENTINEL

from .indices import narrow, take


def _batch_base(B: int, D: int, device) -> torch.Tensor:
    return torch.arange(B, dtype=torch.int64, device=device).unsqueeze(1) * D


def node_take(op: str, values: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``values[b, node[b, ...]]`` for values [B, D, ...] and node ids [B, ...]. A node id outside
    ``[0, D)`` is out of range for the gather, never another request's node."""
    B, D = values.shape[:2]
    base = _batch_base(B, D, values.device).view(B, *([1] * (node.dim() - 1)))
    flat = torch.where((node >= 0) & (node < D), base + node, SENTINEL)
    return take(op, "tree", values.reshape(B * D, *values.shape[2:]), flat)


def scatter_nodes(op: str, B: int, D: int, target: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
                  fill: int = SENTINEL) -> torch.Tensor:
    """int64[B, D] filled with ``fill``, then ``out[b, target[b, i]] = values[b, i]`` where ``keep``
    and ``target`` is in ``[0, D)``; the other entries go to a scratch element past the end."""
    device = values.device
    base = _batch_base(B, D, device).view(B, *([1] * (target.dim() - 1)))
    keep = keep & (target >= 0) & (target < D)
    flat = narrow(op, "tree", torch.where(keep, base + target, B * D), B * D + 1)
    out = torch.full((B * D + 1,), fill, dtype=torch.int64, device=device)
    out.index_put_((flat.reshape(-1),), values.reshape(-1))
    return out[: B * D].view(B, D)


def reconstruct_tree(tree_mask: torch.Tensor, seq_lens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and retrieve links of B draft trees (see ``Backend.reconstruct_tree``).

    Args:
        tree_mask: bool[B, D, D]. seq_lens: int64[B].
    Returns:
        positions int64[B*D], retrieve_index, retrieve_next_token, retrieve_next_sibling int64[B, D].
    """
    op = "reconstruct_tree"
    B, D, _ = tree_mask.shape
    device = tree_mask.device
    node = torch.arange(D, dtype=torch.int64, device=device)
    positions = (seq_lens.unsqueeze(1) + tree_mask.sum(-1) - 1).reshape(B * D)
    retrieve_index = torch.arange(B * D, dtype=torch.int64, device=device).view(B, D)
    if B * D == 0:
        empty = torch.full((B, D), SENTINEL, dtype=torch.int64, device=device)
        return positions, retrieve_index, empty, empty.clone()
    ancestor = tree_mask & ~torch.eye(D, dtype=torch.bool, device=device)
    parent = torch.where(ancestor, node, SENTINEL).amax(-1)
    # Nodes grouped by parent (the root, parent -1, first), in index order inside a group.
    order = torch.argsort(parent * D + node, dim=-1)
    grouped = node_take(op, parent, order)
    nxt = torch.cat([order[:, 1:], order.new_full((B, 1), SENTINEL)], dim=1)
    nxt_parent = torch.cat([grouped[:, 1:], grouped.new_full((B, 1), SENTINEL)], dim=1)
    same_group = (nxt_parent == grouped) & (grouped >= 0)
    next_sibling = scatter_nodes(op, B, D, order, torch.where(same_group, nxt, SENTINEL), order >= 0)
    prev_parent = torch.cat([grouped.new_full((B, 1), SENTINEL), grouped[:, :-1]], dim=1)
    opens = (grouped != prev_parent) & (grouped >= 0)
    first_child = scatter_nodes(op, B, D, grouped, order, opens)
    return positions, retrieve_index, first_child, next_sibling


class NpuTreeOps:
    """Mixin: the NPU backend's draft-tree ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _reconstruct_tree = staticmethod(reconstruct_tree)
