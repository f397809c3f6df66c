"""Admission and KV-slot bookkeeping for continuous batching.

Each request gets a slot budget when it arrives: its prompt, its (context-clamped) new tokens and
``3*D`` for the draft trees of its last steps (the last one's nodes, the step the host may launch
before it has seen that the request finished, and the slack of the relay's bound). Slots come in
pages of ``page_size`` through the HAL's ``alloc_extend`` (a request fills the rest of its last
page before it takes a new one), and budgets are counted in whole pages. A waiting request is
admitted only when the free pages cover its budget, and admission takes the whole budget at once:
a running request never meets an empty cache, nothing is ever preempted, and no decode step
allocates (admission already set those pages aside, so taking them early costs no capacity, and a
request that stops early gives them all back). A request whose budget exceeds the whole cache, or whose
prompt leaves no room in the context, fails on its own with a clear error; the others are
unaffected.
"""

from __future__ import annotations

from collections import deque

import torch

from ..backend import Backend
from ..memory import ReqToTokenPool, SlotAllocator
from .overlap import Transfer
from .request import Request, Status


def request_room(prompt_len: int, max_new_tokens: int, tree_size: int, max_context_len: int) -> tuple[int, int] | None:
    """The output tokens and the slot budget of a request of ``prompt_len`` prompt tokens asking
    for ``max_new_tokens``, with ``3 * tree_size`` of its ``max_context_len`` positions kept for
    draft trees: its output is cut to what the context leaves, and it may hold up to prompt +
    output + trees slots. None when the prompt leaves no room for one output token."""
    room = max_context_len - prompt_len - 3 * tree_size
    if room < 1:
        return None
    output = min(max_new_tokens, room)
    return output, prompt_len + output + 3 * tree_size


def pages_of(slots: int, page_size: int) -> int:
    """Pages of ``page_size`` slots that hold ``slots`` positions of one request."""
    return -(-slots // page_size)


class Scheduler:
    """Waiting queue, running set, request-pool rows and KV slots.

    Args:
        backend: the HAL backend (slot ids and cache locations go through its ops).
        transfer: host->device uploads.
        num_slots: KV-cache slots.
        max_running: rows of the request pool, the most requests decoding at once.
        max_context_len: positions per request row (prompt + output + speculation room).
        tree_size: D, draft-tree nodes per verify step (1 without speculation).
        max_prefill_tokens: prompt tokens per prefill step (a longer prompt runs alone).
        page_size: KV slots per page.

    Attributes:
        prefill_cap: the most requests and prompt tokens one admission takes (a captured
            prefill's, which the engine sets where it captures them: a larger prefill runs eagerly,
            many times longer), or None: ``max_prefill_tokens`` alone bounds it.
    """

    def __init__(self, backend: Backend, transfer: Transfer, num_slots: int, max_running: int,
                 max_context_len: int, tree_size: int, max_prefill_tokens: int, page_size: int = 1):
        self.backend = backend
        self.transfer = transfer
        self.slots = SlotAllocator(backend, num_slots, page_size)
        self.pool = ReqToTokenPool(max_running, max_context_len, backend.device)
        self.tree_size = tree_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_cap: tuple[int, int] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.pool.req_to_token

    def check(self, req: Request) -> str | None:
        """Clamp ``req``'s output to its context and set its slot budget; an error message if it can never run."""
        n, D, M = len(req.prompt_ids), self.tree_size, self.pool.max_context_len
        if n == 0:
            return "empty prompt"
        fit = request_room(n, req.params.max_new_tokens, D, M)
        if fit is None:
            return (f"prompt of {n} tokens does not fit the context of {M} positions "
                    f"(at most {M - 3 * D - 1} prompt tokens with {D} draft nodes)")
        req.max_new_tokens, req.slot_budget = fit
        if self._pages(req.slot_budget) > self.slots.num_pages:
            ps = self.slots.page_size
            needed = f"{self._pages(req.slot_budget) * ps} KV slots" + (f" (pages of {ps})" if ps > 1 else "")
            return f"needs up to {needed}; the cache holds {self.slots.num_slots}"
        return None

    def _pages(self, slots: int) -> int:
        return pages_of(slots, self.slots.page_size)

    def admit(self) -> list[Request]:
        """Move waiting requests (first come, first served) that fit now into the running set.

        Each admitted request gets a pool row and the slots of its whole budget. One admission
        takes at most ``max_prefill_tokens`` prompt tokens and what :attr:`prefill_cap` bounds (a
        first request longer than the bound comes alone).
        """
        most, bound = self._bounds()
        admitted: list[Request] = []
        free = self.slots.free_pages
        tokens = 0
        while self.waiting and min(most, self.pool.available()) > len(admitted):
            req = self.waiting[0]
            n = len(req.prompt_ids)
            if self._pages(req.slot_budget) > free or (admitted and tokens + n > bound):
                break
            self.waiting.popleft()
            free -= self._pages(req.slot_budget)
            tokens += n
            admitted.append(req)
        if not admitted:
            return admitted
        for req in admitted:
            req.row = self.pool.alloc()
            req.status = Status.RUNNING
        self._allocate(admitted)
        self.running.extend(admitted)
        return admitted

    def _bounds(self) -> tuple[int, int]:
        """The most requests and prompt tokens one admission takes."""
        if self.prefill_cap is not None:
            return self.prefill_cap[0], min(self.prefill_cap[1], self.max_prefill_tokens)
        return self.pool.size, self.max_prefill_tokens

    def _allocate(self, reqs: list[Request]) -> None:
        """Give each newly admitted request (holding no slot yet) the slots of positions
        ``0 .. slot_budget - 1`` (``alloc_extend`` from nothing: whole pages) and record them in
        the request table."""
        up = self.transfer.upload
        prefix, seq = [0] * len(reqs), [r.slot_budget for r in reqs]
        rows, prefix_dev, seq_dev = up([r.row for r in reqs]), up(prefix), up(seq)
        last = torch.full_like(prefix_dev, -1)  # no request holds a slot yet
        locs = self.slots.alloc_extend(prefix_dev, seq_dev, last, prefix, seq)
        self.backend.assign_req_to_token(self.req_to_token, rows, prefix_dev, seq_dev, locs)
        for r in reqs:
            r.allocated = r.slot_budget

    def release(self, reqs: list[Request]) -> None:
        """Give back every slot and the row of each request (finished or aborted)."""
        held = [r for r in reqs if r.row >= 0]
        up = self.transfer.upload
        # Pages of one slot may be given back all at once; larger pages request by request, each
        # run of positions starting at a page boundary (what SlotAllocator.free takes).
        for group in [held] if self.slots.page_size == 1 else [[r] for r in held]:
            total = sum(r.allocated for r in group)
            if total:
                locs = self.backend.gather_cache_locs(self.req_to_token, up([r.row for r in group]),
                                                      up([0] * len(group)), up([r.allocated for r in group]),
                                                      num_tokens=total)
                self.slots.free(locs)
        for r in held:
            self.pool.free(r.row)
            r.row, r.allocated = -1, 0
        gone = set(map(id, reqs))
        self.running = [r for r in self.running if id(r) not in gone]
