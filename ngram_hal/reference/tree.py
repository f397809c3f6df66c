"""Draft-tree structure from a tree mask: positions and retrieve links, in plain torch.

Every op here works on the mask's shape only, so any mask values give in-range outputs: a node
that does not see itself (a mask the contract forbids, checked only in strict mode) still gets
depth 0, never a position before its root.
"""

from __future__ import annotations

import torch


def _parents(tree_mask: torch.Tensor) -> torch.Tensor:
    """The parent of every node: its deepest strict ancestor, -1 for the root.

    Args:
        tree_mask: bool[B, D, D]; ``tree_mask[b, i, j]`` when node j is node i or an ancestor.
    Returns:
        int64[B, D].
    """
    B, D, _ = tree_mask.shape
    eye = torch.eye(D, dtype=torch.bool, device=tree_mask.device)
    strict = tree_mask & ~eye
    depth = tree_mask.sum(-1) - 1
    ancestor_depth = torch.where(strict, depth.unsqueeze(1).expand(B, D, D), -1)
    best, parent = ancestor_depth.max(-1)
    return torch.where(best >= 0, parent, -1)


def reconstruct_tree(tree_mask: torch.Tensor, seq_lens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and retrieve links of B draft trees (see ``Backend.reconstruct_tree``).

    Node depth is the number of strict ancestors; first child and next sibling follow node order.

    Args:
        tree_mask: bool[B, D, D]. seq_lens: int64[B].
    Returns:
        positions int64[B*D], retrieve_index, retrieve_next_token, retrieve_next_sibling int64[B, D].
    """
    B, D, _ = tree_mask.shape
    device = tree_mask.device
    depth = (tree_mask.sum(-1) - 1).clamp(min=0)
    positions = (seq_lens.unsqueeze(1) + depth).reshape(B * D)
    retrieve_index = torch.arange(B * D, dtype=torch.int64, device=device).view(B, D)

    parent = _parents(tree_mask)
    node = torch.arange(D, dtype=torch.int64, device=device)
    # child_of[b, p, i]: node i is a child of node p.
    child_of = parent.unsqueeze(1) == node.view(1, D, 1)
    first_child = torch.where(child_of, node, D).amin(-1)
    retrieve_next_token = torch.where(first_child < D, first_child, -1)
    # sibling_after[b, i, j]: node j > i has the same parent as non-root node i.
    later = node.view(1, 1, D) > node.view(1, D, 1)
    sibling_after = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent.unsqueeze(2) >= 0) & later
    next_sibling = torch.where(sibling_after, node, D).amin(-1)
    retrieve_next_sibling = torch.where(next_sibling < D, next_sibling, -1)
    return positions, retrieve_index, retrieve_next_token, retrieve_next_sibling


class CpuTreeOps:
    """Mixin: the reference's draft-tree ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _reconstruct_tree = staticmethod(reconstruct_tree)
