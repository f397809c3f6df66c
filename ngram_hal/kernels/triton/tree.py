"""``reconstruct_tree``: positions and retrieve links of B draft trees from their masks, in one launch.

A program takes a block of requests and reads each request's whole ``D x D`` mask as one tile
``[requests, node i, node j]``: depths are row counts, a node's parent is its deepest strict
ancestor, and first children and next siblings are minima over the tile. Nothing loops over
nodes, and any mask (a tree or not) gives in-range outputs without reading or writing outside
the tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, pow2_block, require_contiguous

# Mask entries per thread in a program's tile: sets the warps of the launch.
_ENTRIES_PER_THREAD = 8


@triton.jit
def reconstruct_tree_kernel(mask_ptr, seq_lens_ptr, positions_ptr, index_ptr, next_token_ptr, next_sibling_ptr,
                             B, D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    req = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    node = tl.arange(0, BLOCK_D)
    b3 = req[:, None, None]
    i3 = node[None, :, None]
    j3 = node[None, None, :]
    in_tile = (b3 < B) & (i3 < D) & (j3 < D)
    sees = tl.load(mask_ptr + (b3.to(tl.int64) * D + i3) * D + j3, mask=in_tile, other=0) != 0
    depth = tl.sum(sees.to(tl.int32), axis=2) - 1
    # Parent: the strict ancestor of greatest depth (the first such node on ties); an
    # "ancestor" whose own row is empty (depth -1) does not count.
    depth_j = depth[:, None, :]
    key = tl.where(sees & (i3 != j3) & (depth_j >= 0), depth_j * BLOCK_D + (BLOCK_D - 1 - j3), -1)
    best = tl.max(key, axis=2)
    parent = tl.where(best >= 0, BLOCK_D - 1 - best % BLOCK_D, -1)
    parent_j = parent[:, None, :]
    parent_i = parent[:, :, None]
    first = tl.min(tl.where((parent_j == i3) & (j3 < D), j3, BLOCK_D), axis=2)
    later = (parent_j == parent_i) & (parent_i >= 0) & (j3 > i3) & (j3 < D)
    sibling = tl.min(tl.where(later, j3, BLOCK_D), axis=2)

    in_req = req < B
    out = req[:, None].to(tl.int64) * D + node[None, :]
    live = in_req[:, None] & (node[None, :] < D)
    seq = tl.load(seq_lens_ptr + req, mask=in_req, other=0)
    # A node that does not see itself (a mask the contract forbids) still sits at depth 0.
    tl.store(positions_ptr + out, seq[:, None] + tl.maximum(depth, 0), mask=live)
    tl.store(index_ptr + out, out, mask=live)
    tl.store(next_token_ptr + out, tl.where(first < BLOCK_D, first, -1).to(tl.int64), mask=live)
    tl.store(next_sibling_ptr + out, tl.where(sibling < BLOCK_D, sibling, -1).to(tl.int64), mask=live)


def reconstruct_tree(tree_mask: torch.Tensor, seq_lens: torch.Tensor, cfg: LaunchConfig
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and retrieve links of B draft trees (``Backend.reconstruct_tree``), one launch.

    Args:
        tree_mask: bool[B, D, D], contiguous; ``tree_mask[b, i, j]`` when node j is node i or an
            ancestor of it.
        seq_lens: int64[B], contiguous, the position of each root.
        cfg: the backend's launch configuration.
    Returns:
        ``positions`` int64[B*D] (seq_len + depth), ``retrieve_index`` int64[B, D] (b*D + i),
        ``retrieve_next_token`` int64[B, D] (first child or -1), ``retrieve_next_sibling``
        int64[B, D] (next node with the same parent or -1), on the mask's device.
    """
    require_contiguous("reconstruct_tree", tree_mask=tree_mask, seq_lens=seq_lens)
    B, D, _ = tree_mask.shape
    device = tree_mask.device
    positions = torch.empty(B * D, dtype=torch.int64, device=device)
    index, next_token, next_sibling = (torch.empty((B, D), dtype=torch.int64, device=device) for _ in range(3))
    if B == 0:
        return positions, index, next_token, next_sibling
    launch = tree_launch(B, D, cfg)
    reconstruct_tree_kernel[(triton.cdiv(B, launch["BLOCK_B"]),)](
        tree_mask.view(torch.uint8), seq_lens, positions, index, next_token, next_sibling, B, D, **launch, **cfg.options())
    return positions, index, next_token, next_sibling


def tree_launch(B: int, D: int, cfg: LaunchConfig) -> dict[str, int]:
    """The kernel's block sizes and ``num_warps`` for B masks of D x D (B, D >= 1); the grid is
    ``cdiv(B, BLOCK_B)`` programs."""
    block_d = pow2_block(D)
    block_b = cfg.rows_per_program(B, block_d * block_d)
    return {"BLOCK_B": block_b, "BLOCK_D": block_d,
            "num_warps": cfg.warps(block_b * block_d * block_d // _ENTRIES_PER_THREAD)}


class TritonTreeOps:
    """Mixin: the draft-tree kernels as the ``_<op>`` of :class:`~ngram_hal.backend.Backend` (which
    has validated the arguments), launched with the backend's ``launch``."""

    def _reconstruct_tree(self, *args):
        return reconstruct_tree(*args, self.launch)
