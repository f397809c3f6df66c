"""The attention layout: one batch's attention metadata, built once per forward by a backend and
passed to every layer's attention (a contract type: backends and their kernels read it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import contract as c

if TYPE_CHECKING:
    from .backend import Backend


class AttentionLayout:
    """One batch's attention metadata and the work split a backend derived from it.

    Built by :meth:`Backend.attention_layout`; pass it to every layer's :meth:`Backend.attention`
    of the same forward. ``plan`` is the backend's own (None for a backend that precomputes
    nothing). The tensors are held, not copied: writing to them in place invalidates the layout.
    ``max_slot`` is the largest slot a request reads, found by a strict backend (None otherwise).
    ``q_active`` (int64[B] or None): each request's first so-many queries attend, the others give
    zero rows (:meth:`Backend.attention_layout`).
    """

    def __init__(self, backend: Backend, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 kv_lens: torch.Tensor, q_lens: torch.Tensor, tree_mask: torch.Tensor | None,
                 num_queries: int, max_kv_len: int, batch_invariant: bool = False,
                 q_active: torch.Tensor | None = None):
        self.backend = backend
        self.req_to_token = req_to_token
        self.req_pool_indices = req_pool_indices
        self.kv_lens = kv_lens
        self.q_lens = q_lens
        self.tree_mask = tree_mask
        self.num_queries = num_queries
        self.max_kv_len = max_kv_len
        self.batch_invariant = batch_invariant
        self.q_active = q_active
        self.max_slot: int | None = None
        self.plan = None

    @property
    def batch_size(self) -> int:
        """B, the requests in the batch."""
        return self.req_pool_indices.shape[0]

    def check_matches(self, backend: Backend, req_to_token, req_pool_indices, kv_lens, q_lens, tree_mask,
                      num_queries: int) -> None:
        """ContractError naming ``layout`` unless it was built by ``backend`` over these very tensors."""
        if self.backend is not backend:
            raise c.ContractError("attention", "layout", f"built by {self.backend!r}, used with {backend!r}")
        given = (req_to_token, req_pool_indices, kv_lens, q_lens, tree_mask)
        held = (self.req_to_token, self.req_pool_indices, self.kv_lens, self.q_lens, self.tree_mask)
        names = ("req_to_token", "req_pool_indices", "kv_lens", "q_lens", "tree_mask")
        for name, a, b in zip(names, given, held):
            if a is not b:
                raise c.ContractError("attention", "layout", f"built over another '{name}' tensor than the one passed")
        if num_queries != self.num_queries:
            raise c.ContractError("attention", "layout", f"built for {self.num_queries} queries, q has {num_queries}")
