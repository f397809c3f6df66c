"""One verify step, the same for a captured step and an eager one: the tree, its cache
locations, the target forward, verification and the KV compaction.

:class:`~ngram_hal.engine.graphs.GreedyStep` runs it inside a captured graph (greedy, with the
padding requests masked off by ``live``); the engine runs it op by op where requests sample, want
log-probabilities or nothing is captured, with the captured forward where there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..backend import Backend
from ..kv_cache import KVCache
from ..speculative.relay import OverlapRelay
from ..speculative.verify import VerifyOutput, commit, prepare_tree, tree_cache_locs, verify_tokens
from .model import ForwardBatch


def verify_step(backend: Backend, target: Callable[[ForwardBatch], torch.Tensor], kv: KVCache,
                req_to_token: torch.Tensor, tokens: torch.Tensor, tree_mask: torch.Tensor, rows: torch.Tensor,
                seq_lens: torch.Tensor, q_lens: torch.Tensor, tree_size: int, max_kv_len: int,
                live: torch.Tensor | None = None, chains: bool = False, active: torch.Tensor | None = None
                ) -> tuple[OverlapRelay, VerifyOutput]:
    """Verify B trees of tree size ``tree_size`` (D): ``(relay, out)``.

    Args:
        target: runs the target forward over a ``ForwardBatch`` of the B*D nodes and returns its
            own token after each node, int64[B*D]: its argmax for greedy verify
            (:meth:`LlamaModel.forward_argmax <ngram_hal.engine.model.LlamaModel.forward_argmax>`),
            or the token it samples there (the batch's ``positions`` are the nodes' positions).
        tokens: int64[B*D], each tree's nodes (node 0 the request's last committed token).
        tree_mask: bool[B, D, D]. rows, seq_lens, q_lens: int64[B] (``q_lens`` = D).
        max_kv_len: host int bounding every ``seq_lens + D``.
        live: bool[B*D] or None; nodes of requests not live store no K/V (location -1).
        chains: every tree is a chain (:attr:`ForwardBatch.chains`).
        active: int64[B] or None: each tree's nodes worth verifying (:attr:`Trees.active
            <ngram_hal.speculative.sources.Trees.active>`): the forward's attention skips the
            others and verification sees them as token -1, which no target token equals.
    """
    tree = prepare_tree(backend, tokens, tree_mask, seq_lens)
    locs = tree_cache_locs(backend, req_to_token, rows, seq_lens, tree_size)
    if live is not None:
        locs = torch.where(live, locs, -1)
    batch = ForwardBatch(input_ids=tokens, positions=tree.positions, out_cache_loc=locs, req_to_token=req_to_token,
                         req_pool_indices=rows, kv_lens=seq_lens + tree_size, q_lens=q_lens,
                         tree_mask=tree_mask if tree_size > 1 else None, chains=chains, max_kv_len=max_kv_len,
                         q_active=active, logits_index=None)
    if active is not None:
        node = torch.arange(tree_size, dtype=torch.int64, device=tokens.device)
        tree = replace(tree, candidates=torch.where(node < active.unsqueeze(1), tree.candidates, -1))
    out = verify_tokens(backend, tree, target(batch))
    return commit(backend, kv, out, locs, req_to_token, rows, seq_lens), out
