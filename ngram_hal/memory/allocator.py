"""KV slot allocation in pages of ``page_size`` slots, with no host sync.

The free list is a device int64 tensor of page ids; how many pages it holds is its length, which
is tensor metadata, so every decision about whether a request fits is made on the host from
host-side lengths. Page ``p`` holds slots ``p*page_size .. p*page_size + page_size - 1``.

Ownership is a device bitmap, one flag per page, set when a page is handed out and cleared when
it comes back, in every mode. :meth:`SlotAllocator.free` refuses a page it does not own (never
handed out, already given back, given twice in one call, -1, out of range or not at a page
start). Strict mode raises and frees nothing. Default mode cannot raise without reading the
data, so it masks instead: refused pages become -1 in a *returned* list kept beside the free
list, whose length (an upper bound of the pages it holds, exact when nothing was refused) counts
as free. The returned list joins the free list, its -1 entries dropped, only when an allocation
needs more pages than the free list holds: that is the one host sync, once per turnover of the
cache rather than once per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import contract as c

if TYPE_CHECKING:
    from ..backend import Backend


class OutOfSlotsError(RuntimeError):
    """Not enough free KV slots; raised before the allocator changes any state.

    Attributes:
        needed: slots the request asked for (whole pages, for page_size > 1).
        free: slots free at the time.
    """

    def __init__(self, needed: int, free: int, page_size: int):
        self.needed = needed
        self.free = free
        self.page_size = page_size
        pages = f" (pages of {page_size} slots)" if page_size > 1 else ""
        super().__init__(f"out of KV slots: {needed} needed, {free} free{pages}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SlotAllocator:
    """Hands out KV-cache slots page by page from a device-side free list.

    Args:
        backend: the backend whose ``alloc_extend`` computes slot ids; its device holds the free
            list and its ``strict`` flag makes a refused free raise (a check that reads device data).
        num_slots: slots of the KV cache; the last ``num_slots % page_size`` are left unused.
        page_size: slots per page, >= 1.
    """

    def __init__(self, backend: "Backend", num_slots: int, page_size: int = 1):
        op = "SlotAllocator"
        c.check_int(op, "num_slots", num_slots, minimum=1)
        c.check_int(op, "page_size", page_size, minimum=1)
        if num_slots < page_size:
            raise c.ContractError(op, "num_slots", f"{num_slots} slots hold no page of {page_size}")
        self.backend = backend
        self.device = backend.device
        self.strict = backend.strict
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self._free = torch.arange(self.num_pages, dtype=c.INDEX_DTYPE, device=self.device)
        self._returned = torch.empty(0, dtype=c.INDEX_DTYPE, device=self.device)
        # Page p is handed out and not yet given back; entry num_pages is a scratch flag, never set.
        self._owned = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)

    @property
    def free_list(self) -> torch.Tensor:
        """The free page ids, int64[free_pages] on the device, next to be handed out first. Read only.

        Merges pages given back in default mode first, which reads device data (a host sync).
        """
        self._merge()
        return self._free

    @property
    def free_pages(self) -> int:
        """Whole pages free now (host int); see the module docstring for pages given back in default mode."""
        return self._free.shape[0] + self._returned.shape[0]

    def available(self) -> int:
        """Slots in free pages (host int). Slots left in a request's last partial page are not counted."""
        return self.free_pages * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` positions 0.. of a new request: int64[num_tokens], through
        :meth:`alloc_extend` from an empty prefix (``ceil(num_tokens / page_size)`` whole pages;
        the last may be partly used)."""
        c.check_int("SlotAllocator.alloc", "num_tokens", num_tokens)
        zero = torch.zeros(1, dtype=c.INDEX_DTYPE, device=self.device)
        return self.alloc_extend(zero, zero + num_tokens, zero - 1, [0], [num_tokens])

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     prefix_lens_host: list[int], seq_lens_host: list[int]) -> torch.Tensor:
        """Slots for extending B requests from ``prefix_lens`` to ``seq_lens``, via ``backend.alloc_extend``.

        Args:
            prefix_lens, seq_lens, last_loc: int64[B] on the device, as in
                :meth:`ngram_hal.Backend.alloc_extend`.
            prefix_lens_host, seq_lens_host: the same lengths as host ints; the pages needed are
                counted from these, so nothing is read back from the device.
        Returns:
            int64[sum(seq_lens - prefix_lens)], request by request.
        Raises:
            OutOfSlotsError: before any state changes, when the pages needed exceed the free ones.
        """
        op = "SlotAllocator.alloc_extend"
        B = c.check_index(op, "prefix_lens", prefix_lens, self.device, ndim=1).shape[0]
        for name, values in (("prefix_lens_host", prefix_lens_host), ("seq_lens_host", seq_lens_host)):
            if not isinstance(values, (list, tuple)) or len(values) != B:
                raise c.ContractError(op, name, f"expected a list of {B} host ints matching prefix_lens")
            for value in values:
                c.check_int(op, name, value)
        if any(p > s for p, s in zip(prefix_lens_host, seq_lens_host)):
            raise c.ContractError(op, "seq_lens_host", "need prefix_lens <= seq_lens")
        ps = self.page_size
        num_new = sum(s - p for p, s in zip(prefix_lens_host, seq_lens_host))
        num_pages = sum(_ceil_div(s, ps) - _ceil_div(p, ps) for p, s in zip(prefix_lens_host, seq_lens_host))
        self._ensure(num_pages)
        if self.strict:
            for name, dev, host in (("prefix_lens_host", prefix_lens, prefix_lens_host),
                                    ("seq_lens_host", seq_lens, seq_lens_host)):
                if dev.tolist() != list(host):
                    raise c.ContractError(op, name, "differs from the device tensor")
        locs = self.backend.alloc_extend(prefix_lens, seq_lens, last_loc, self._free[:num_pages], ps, num_new)
        self._take(num_pages)
        return locs

    def free(self, locs: torch.Tensor) -> None:
        """Give back the pages holding a run of a request's positions.

        Args:
            locs: int64[n] on the device, no -1: the slots of positions ``p0 .. p0+n-1`` of one
                request, as read from its ``req_to_token`` row, with ``p0`` a multiple of
                ``page_size`` (the whole request from position 0, or its tail from a page
                boundary). Page k of the run is freed through ``locs[k*page_size]``. With
                ``page_size == 1`` any set of allocated slots may be given.
        A page the allocator does not own is refused in every mode (see the module docstring).
        In strict mode such a page (a double free, say), or locs that do not lie page by page as
        above, raise :class:`ngram_hal.ContractError` and free nothing. In default mode the
        refused pages are dropped without a host sync and the others are freed.
        """
        op = "SlotAllocator.free"
        c.check_index(op, "locs", locs, self.device, ndim=1)
        ps = self.page_size
        heads = locs[::ps]
        pages = torch.div(heads, ps, rounding_mode="floor")
        if self.strict:
            self._check_free(op, locs, pages)
            self._owned[pages] = False
            self._free = torch.cat([self._free, pages])
            return
        n = pages.shape[0]
        order = torch.arange(n, dtype=c.INDEX_DTYPE, device=self.device)
        ok = (heads >= 0) & (heads < self.num_slots) & (heads % ps == 0)
        index = torch.where(ok, pages, self.num_pages)
        first = torch.full((self.num_pages + 1,), n, dtype=c.INDEX_DTYPE, device=self.device)
        first.scatter_reduce_(0, index, order, "amin")
        ok &= self._owned.index_select(0, index) & (first.index_select(0, index) == order)
        self._owned.index_fill_(0, torch.where(ok, pages, self.num_pages), False)
        self._returned = torch.cat([self._returned, torch.where(ok, pages, c.SENTINEL)])
        if self.free_pages > self.num_pages:
            self._merge()  # more pages counted than exist: refused entries are sure to be there

    def _check_free(self, op: str, locs: torch.Tensor, pages: torch.Tensor) -> None:
        ps = self.page_size
        c.value_range(op, "locs", locs, 0, self.num_slots, allow_sentinel=False)
        n = locs.shape[0]
        pos = torch.arange(n, dtype=c.INDEX_DTYPE, device=self.device)
        expected = torch.repeat_interleave(pages, ps, output_size=pages.shape[0] * ps)[:n] * ps + pos % ps
        if not bool((locs == expected).all()):
            raise c.ContractError(op, "locs", f"not the slots of {n} positions of one request from a page "
                                  f"boundary (page_size {ps}: position p sits at offset p % {ps} of its page)")
        c.value_distinct(op, "locs", pages)
        held = self._owned[pages]
        if not bool(held.all()):
            slot = int(pages[~held][0]) * ps
            raise c.ContractError(op, "locs", f"slot {slot} is not allocated (double free?)")

    def _merge(self) -> None:
        """Append the pages given back in default mode to the free list, dropping refused ones."""
        if self._returned.shape[0]:
            kept = self._returned[self._returned >= 0]
            self._free = torch.cat([self._free, kept])
            self._returned = self._returned[:0]

    def _ensure(self, num_pages: int) -> None:
        if num_pages > self._free.shape[0]:
            self._merge()
        if num_pages > self._free.shape[0]:
            raise OutOfSlotsError(num_pages * self.page_size, self.available(), self.page_size)

    def _take(self, num_pages: int) -> None:
        self._owned.index_fill_(0, self._free[:num_pages], True)
        self._free = self._free[num_pages:]

    def __repr__(self) -> str:
        return (f"SlotAllocator(slots={self.num_slots}, page_size={self.page_size}, "
                f"free_slots={self.available()}, device={self.device})")
