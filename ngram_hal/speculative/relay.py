"""The overlap relay: what one decode step hands to the next under overlap scheduling.

While the device verifies step t, the host already schedules step t+1, so the results of step t
(committed tokens, their counts, the new lengths) stay on the device in an :class:`OverlapRelay`.
Continuous batching reshapes it with :meth:`OverlapRelay.filter` (finished requests leave) and
:meth:`OverlapRelay.merge` (batches join). A relay's stride is the tree size of the step that
produced it (D for a full verify step, fewer for a step the ``auto`` policy ran smaller, 1 for a
prefill); merging relays of different strides widens the narrower one. Nothing here reads device
data on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import contract as c


@dataclass(frozen=True)
class OverlapRelay:
    """Per-request results of a verify step, kept on the device.

    Attributes:
        accept_tokens: int64[B*D]; request b's committed tokens at ``b*D + j`` for
            ``j < accept_lens[b]``, -1 elsewhere.
        accept_lens: int64[B], tokens committed per request (accepted drafts + 1 bonus).
        new_seq_lens: int64[B], each request's length after the step.
        tree_size: D, the stride of ``accept_tokens``: the draft-tree nodes per request of the
            step that produced the relay (a host int).
    """

    accept_tokens: torch.Tensor
    accept_lens: torch.Tensor
    new_seq_lens: torch.Tensor
    tree_size: int

    def __post_init__(self):
        op = "OverlapRelay"
        D = c.check_int(op, "tree_size", self.tree_size, minimum=1)
        if not isinstance(self.accept_lens, torch.Tensor):
            raise c.ContractError(op, "accept_lens", f"expected a torch.Tensor, got {type(self.accept_lens).__name__}")
        lens = c.check_index(op, "accept_lens", self.accept_lens, self.accept_lens.device, ndim=1)
        B = lens.shape[0]
        c.check_index(op, "accept_tokens", self.accept_tokens, lens.device, shape=(B * D,))
        c.check_index(op, "new_seq_lens", self.new_seq_lens, lens.device, shape=(B,))

    @classmethod
    def empty(cls, tree_size: int, device: torch.device | str) -> "OverlapRelay":
        """A relay of no requests."""
        none = torch.empty(0, dtype=torch.int64, device=device)
        return cls(none, none.clone(), none.clone(), tree_size)

    @property
    def batch_size(self) -> int:
        """B, the number of requests."""
        return self.accept_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.accept_lens.device

    def last_tokens(self) -> torch.Tensor:
        """int64[B], each request's last committed token (the root of its next draft tree)."""
        B, D = self.batch_size, self.tree_size
        if D == 1:  # one token a request (a prefill's, a plain step's): no gather to launch
            return self.accept_tokens
        last = (self.accept_lens - 1).clamp(min=0).unsqueeze(1)
        return self.accept_tokens.view(B, D).gather(1, last).squeeze(1)

    def filter(self, keep_indices: torch.Tensor) -> "OverlapRelay":
        """The relay of the requests ``keep_indices`` (int64[K], on this relay's device), in that order."""
        keep = c.check_index("OverlapRelay.filter", "keep_indices", keep_indices, self.device, ndim=1)
        tokens = self.accept_tokens.view(self.batch_size, self.tree_size).index_select(0, keep)
        return OverlapRelay(tokens.reshape(-1), self.accept_lens.index_select(0, keep),
                            self.new_seq_lens.index_select(0, keep), self.tree_size)

    def widen(self, tree_size: int) -> "OverlapRelay":
        """The same results laid out with the larger stride ``tree_size`` (-1 padded); this relay
        itself where the stride is already ``tree_size``."""
        D = c.check_int("OverlapRelay.widen", "tree_size", tree_size, minimum=self.tree_size)
        if D == self.tree_size:
            return self
        B = self.batch_size
        tokens = torch.full((B, D), -1, dtype=torch.int64, device=self.device)
        tokens[:, :self.tree_size] = self.accept_tokens.view(B, self.tree_size)
        return OverlapRelay(tokens.view(-1), self.accept_lens, self.new_seq_lens, D)

    def merge(self, other: "OverlapRelay") -> "OverlapRelay":
        """This relay's requests followed by ``other``'s, with the larger of the two strides; both
        need the same device."""
        op = "OverlapRelay.merge"
        if not isinstance(other, OverlapRelay):
            raise c.ContractError(op, "other", f"expected an OverlapRelay, got {type(other).__name__}")
        if not c.same_device(other.device, self.device):
            raise c.ContractError(op, "other", f"expected a relay on {self.device}, got one on {other.device}")
        D = max(self.tree_size, other.tree_size)
        mine, theirs = self.widen(D), other.widen(D)
        return OverlapRelay(torch.cat([mine.accept_tokens, theirs.accept_tokens]),
                            torch.cat([mine.accept_lens, theirs.accept_lens]),
                            torch.cat([mine.new_seq_lens, theirs.new_seq_lens]), D)
