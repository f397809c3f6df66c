"""The HAL: :class:`Backend`, the one interface the core calls.

Each op is declared once, by :func:`~ngram_hal.declarations.declare` on its public method here
(arguments and kinds, tied sizes, outputs, what it writes, its strict value rules); the op list
:data:`OPS`, the conformance suite's tables and ``docs/ops.md`` derive from those declarations.
Each public op validates its arguments through :mod:`ngram_hal.contract` (metadata only; value
checks too when ``strict``) and then calls the subclass's ``_<op>``; when ``strict``, it also
checks what ``_<op>`` returned (dtype, shape, device, sentinel range), so a backend's broken output
raises :class:`ContractError` naming the op and the output at run time. A subclass implements the
ops it can by defining ``_<op>``; :meth:`Backend.capabilities` lists exactly those, and calling
any other raises ``NotImplementedError`` naming the op and the backend.

Draft trees list parents before children: any topological order is valid, and the drafters emit
BFS. Sibling order is node order.

Shapes: B requests, D draft-tree nodes per request (node 0 the root), L layers, H kv heads,
Hq query heads, d head dim, S slots, V vocabulary, R request-pool rows, M max context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from . import collectives
from . import contract as c
from .declarations import declarations, declare, declare_builder
from .layout import AttentionLayout
from .model_kernels import TorchLayerKernels
from .runtime import Runtime

if TYPE_CHECKING:
    from .engine.config import LlamaConfig
    from .kv_cache import KVCache

_ROW_RULES = ("req_pool_indices in [0, R)", "0 <= start <= end <= M")
_TREE_RULES = ("retrieve_index in [0, B*D)", "retrieve links point to later nodes of the same tree, or -1")
_VERIFY_OUT = ("accept_len in [1, D]", "accept_index: the root, then the accepted nodes of the request's own tree, -1 padded")


class Capabilities(BaseModel):
    """What a backend instance offers. Serialises to JSON for reports."""

    model_config = ConfigDict(frozen=True)

    name: str
    ops: list[str]
    device: str
    proxy: bool
    warp_size: int | None = None
    graph_capture: bool = False
    page_sizes: list[int] | None = None
    kv_dtypes: list[str]
    collectives: str | None = None
    """The ``torch.distributed`` backend of :meth:`Backend.collective_backend`, or None."""
    batch_invariant: bool = False
    """Whether the batch-invariant mode gives a row the same bits whatever shares its call, on
    this device (:meth:`Backend.invariance_holds`): the conformance suite checks it where claimed."""


class Backend:
    """Base class of every backend.

    Args:
        device: torch device to run on; ``None`` takes the backend's default.
        strict: run value checks that read data (a host sync); ``None`` reads
            ``NGRAM_HAL_STRICT``.
    """

    name: ClassVar[str] = "base"
    default_device: ClassVar[str] = "cpu"
    proxy: ClassVar[bool] = False
    warp_size: ClassVar[int | None] = None
    page_sizes: ClassVar[list[int] | None] = None
    kv_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    # Whether layer_kernels and attention offer a mode whose results do not depend on the rows
    # sharing a call (``batch_invariant=True``).
    batch_invariant: ClassVar[bool] = False

    def __init__(self, device: torch.device | str | None = None, strict: bool | None = None):
        self.device = torch.device(device if device is not None else self.default_device)
        self.strict = c.strict_from_env() if strict is None else bool(strict)
        self.runtime = Runtime(self.device)

    # ---------------------------------------------------------------- discovery

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """``(True, "")`` when the backend can run here, else ``(False, why not)``."""
        return True, ""

    @classmethod
    def implemented_ops(cls) -> list[str]:
        """The ops this backend class defines an ``_<op>`` for, in :data:`OPS` order."""
        return [op for op in OPS if callable(getattr(cls, "_" + op, None))]

    def capabilities(self) -> Capabilities:
        """Ops implemented, device, proxy flag, warp width, graph capture, page sizes, KV dtypes,
        the ``torch.distributed`` backend of its collectives."""
        return Capabilities(
            name=self.name,
            ops=self.implemented_ops(),
            device=str(self.device),
            proxy=self.proxy,
            warp_size=self.warp_size,
            graph_capture=self.runtime.graph_capture,
            page_sizes=self.page_sizes,
            kv_dtypes=[str(d).removeprefix("torch.") for d in self.kv_dtypes],
            collectives=self.collective_backend(),
            batch_invariant=self.invariance_holds(),
        )

    def invariance_holds(self) -> bool:
        """Whether the batch-invariant mode holds bit for bit here: a query's attention output
        (with ``batch_invariant=True`` and the same ``max_kv_len``) does not depend on the rest of
        the batch, a tree node's equals the decode of its path once accepted, and a row of
        ``layer_kernels(..., batch_invariant=True)`` does not depend on the other rows."""
        return self.batch_invariant

    def invariant_by_default(self) -> bool:
        """Whether an engine on this backend runs the batch-invariant mode unless told otherwise
        (``ngram-hal run`` with neither ``--batch-invariant`` nor ``--no-batch-invariant``): False
        here; a backend turns it on where the mode holds and costs little beside its other numerics."""
        return False

    def _impl(self, op: str):
        fn = getattr(self, "_" + op, None)
        if not callable(fn):
            raise NotImplementedError(f"op '{op}' is not implemented by backend '{self.name}'")
        return fn

    def __repr__(self) -> str:
        mode = "strict" if self.strict else "default"
        return f"{type(self).__name__}(device={self.device}, {mode})"

    # ---------------------------------------------------------------- model kernels

    def layer_kernels(self, config: LlamaConfig, dtype: torch.dtype, batch_invariant: bool = False
                      ) -> TorchLayerKernels:
        """The per-layer compute the model runs on this backend (:mod:`ngram_hal.model_kernels`):
        plain torch here. A backend with kernels of its own returns a subclass, which the
        conformance suite's model tier checks against this one. ``batch_invariant`` asks for
        results that do not depend on the rows sharing a call, which plain torch does not promise."""
        if batch_invariant:
            raise ValueError(f"backend '{self.name}' has no batch-invariant mode")
        return TorchLayerKernels(config, self, dtype)

    def lookup_kernel(self):
        """The device drafter's record-and-draft kernel (the signature of
        :func:`ngram_hal.speculative.lookup.record_and_draft`, which the conformance suite's model
        tier checks it against), or None for that plain-torch one."""
        return None

    # ---------------------------------------------------------------- runtime

    def synchronize(self) -> None:
        """Block the host until the device is idle."""
        self.runtime.synchronize()

    # ---------------------------------------------------------------- collectives

    def collective_backend(self) -> str | None:
        """The ``torch.distributed`` backend that moves this backend's tensors between ranks
        (:func:`~ngram_hal.collectives.device_group_backend` of its device by default: ``gloo`` on
        the CPU, ``nccl`` on CUDA and ROCm); None where there is none. A backend whose vendor
        library registers under another name overrides this."""
        return collectives.device_group_backend(self.device)

    @staticmethod
    def _group(what: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{what}: no process group (ngram_hal.collectives.init_group or launch makes one)")

    def _group_tensor(self, what: str, t: torch.Tensor) -> None:
        self._group(what)
        c.check_tensor(what, "tensor", t, self.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape and dtype, on this backend's device) over the ranks of the process
        group, in place on every rank, in the order of the current stream; returns ``t``."""
        self._group_tensor("all_reduce", t)
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (the same shape ``[n, ...]`` and dtype on every rank), concatenated in
        rank order along dim 0: ``[world_size * n, ...]``, the same on every rank."""
        self._group_tensor("all_gather", t)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def collective_rank(self) -> int:
        """This process's rank in the process group (what :meth:`all_gather` orders by)."""
        self._group("collective_rank")
        return dist.get_rank()

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` copied into ``t`` on every rank, in place; returns ``t``."""
        self._group_tensor("broadcast", t)
        if not 0 <= src < dist.get_world_size():
            raise ValueError(f"broadcast: src {src} outside the group's ranks [0, {dist.get_world_size()})")
        dist.broadcast(t, src)
        return t

    # ---------------------------------------------------------------- allocation

    @declare("prefix_lens:index, seq_lens:index=, last_loc:index=, free_pages:index, page_size:int, num_new_tokens:int",
             ("slots",), summary="slots for extending B requests: the rest of each last page, then whole free pages",
             rules=("0 <= prefix_lens <= seq_lens", "num_new_tokens == sum(seq_lens - prefix_lens)",
                    "enough free pages for every request", "last_loc >= 0 where the prefix is not empty",
                    "free_pages distinct and >= 0", "out: slots >= 0"))
    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     free_pages: torch.Tensor, page_size: int, num_new_tokens: int) -> torch.Tensor:
        """Slots for extending B requests from ``prefix_lens`` to ``seq_lens``.

        Request b first fills the rest of its last partial page (slots ``last_loc[b]+1, ...``),
        then takes whole pages from the head of ``free_pages``, requests in order. Page ``p``
        holds slots ``p*page_size ... p*page_size + page_size - 1``.

        Args:
            prefix_lens, seq_lens: int64[B], ``prefix_lens <= seq_lens``.
            last_loc: int64[B], slot of token ``prefix_lens[b]-1``, or -1 when the prefix is empty.
            free_pages: int64[P], the free list of page ids (slot ids when ``page_size == 1``).
            page_size: host int >= 1.
            num_new_tokens: host int, ``sum(seq_lens - prefix_lens)``.
        Returns:
            ``slots``: int64[num_new_tokens] slot ids (>= 0), request by request. Pure: the caller
            pops the pages.
        """
        op, dev = "alloc_extend", self.device
        c.check_index(op, "prefix_lens", prefix_lens, dev, ndim=1)
        B = prefix_lens.shape[0]
        c.check_index(op, "seq_lens", seq_lens, dev, shape=(B,))
        c.check_index(op, "last_loc", last_loc, dev, shape=(B,))
        c.check_index(op, "free_pages", free_pages, dev, ndim=1)
        c.check_int(op, "page_size", page_size, minimum=1)
        c.check_int(op, "num_new_tokens", num_new_tokens)
        fn = self._impl(op)
        if self.strict:
            if bool((seq_lens < prefix_lens).any()) or bool((prefix_lens < 0).any()):
                raise c.ContractError(op, "seq_lens", "need 0 <= prefix_lens <= seq_lens")
            c.value_equal(op, "num_new_tokens", int((seq_lens - prefix_lens).sum()), num_new_tokens,
                          "sum(seq_lens - prefix_lens)")
            pages = (-(-seq_lens // page_size) - (-(-prefix_lens // page_size))).sum()
            if int(pages) > free_pages.numel():
                raise c.ContractError(op, "free_pages", f"{int(pages)} pages needed, {free_pages.numel()} free")
            bad = (prefix_lens > 0) & (last_loc < 0)
            if bool(bad.any()):
                raise c.ContractError(op, "last_loc", "-1 given for a request with a non-empty prefix")
            c.value_range(op, "free_pages", free_pages, 0, 2**62, allow_sentinel=False)
            c.value_distinct(op, "free_pages", free_pages)
        slots = fn(prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens)
        if self.strict:
            c.check_index(op, "slots", slots, dev, shape=(num_new_tokens,), output=True)
            c.value_range(op, "slots", slots, 0, 2**62, allow_sentinel=False, output=True)
        return slots

    # ---------------------------------------------------------------- cache locations

    def _check_req_rows(self, op, req_to_token, req_pool_indices, start, end):
        dev = self.device
        c.check_index(op, "req_to_token", req_to_token, dev, ndim=2)
        c.check_index(op, "req_pool_indices", req_pool_indices, dev, ndim=1)
        B = req_pool_indices.shape[0]
        c.check_index(op, "start", start, dev, shape=(B,))
        c.check_index(op, "end", end, dev, shape=(B,))
        if self.strict:
            R, M = req_to_token.shape
            c.value_range(op, "req_pool_indices", req_pool_indices, 0, R, allow_sentinel=False)
            c.value_range(op, "start", start, 0, M + 1, allow_sentinel=False)
            c.value_range(op, "end", end, 0, M + 1, allow_sentinel=False)
            if bool((end < start).any()):
                raise c.ContractError(op, "end", "need start <= end")

    @declare("req_to_token:index, req_pool_indices:index, start:index=, end:index=, locs:index",
             summary="in place: req_to_token[r_b, start_b:end_b] = the request's run of locs",
             rules=(*_ROW_RULES, "len(locs) == sum(end - start)", "requests share a row only with disjoint ranges"),
             writes=("req_to_token",))
    def assign_req_to_token(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            start: torch.Tensor, end: torch.Tensor, locs: torch.Tensor) -> None:
        """In place: ``req_to_token[r_b, start_b:end_b] = locs[off_b : off_b + end_b - start_b]``.

        Requests may share a row only with disjoint ranges (strict mode checks it), so the result
        never depends on the order of the writes. ``locs`` are written as given, -1 included.

        Args:
            req_to_token: int64[R, M]. req_pool_indices, start, end: int64[B].
            locs: int64[N], ``N = sum(end - start)``; ``off`` is the running sum.
        """
        op = "assign_req_to_token"
        self._check_req_rows(op, req_to_token, req_pool_indices, start, end)
        c.check_index(op, "locs", locs, self.device, ndim=1)
        fn = self._impl(op)
        if self.strict:
            c.value_equal(op, "locs", locs.numel(), int((end - start).sum()), "length vs sum(end - start)")
            c.value_disjoint_rows(op, "req_pool_indices", req_pool_indices, start, end)
        fn(req_to_token, req_pool_indices, start, end, locs)

    @declare("req_to_token:index, req_pool_indices:index, start:index=, end:index=, num_tokens:int", ("locs",),
             summary="the cells req_to_token[r_b, start_b:end_b], request after request",
             rules=(*_ROW_RULES, "num_tokens == sum(end - start)"))
    def gather_cache_locs(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          start: torch.Tensor, end: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """The inverse of :meth:`assign_req_to_token`: the cells ``req_to_token[r_b, start_b:end_b]``.

        Args:
            req_to_token: int64[R, M]. req_pool_indices, start, end: int64[B].
            num_tokens: host int ``sum(end - start)``; pass it to avoid a host sync.
        Returns:
            ``locs``: int64[num_tokens], concatenated in request order.
        """
        op = "gather_cache_locs"
        self._check_req_rows(op, req_to_token, req_pool_indices, start, end)
        if num_tokens is None:
            num_tokens = int((end - start).sum())
        c.check_int(op, "num_tokens", num_tokens)
        fn = self._impl(op)
        if self.strict:
            c.value_equal(op, "num_tokens", int((end - start).sum()), num_tokens, "sum(end - start)")
        locs = fn(req_to_token, req_pool_indices, start, end, num_tokens)
        if self.strict:
            c.check_index(op, "locs", locs, self.device, shape=(num_tokens,), output=True)
        return locs

    # ---------------------------------------------------------------- KV

    def _check_kv(self, op, kv: "KVCache"):
        from .kv_cache import KVCache

        if not isinstance(kv, KVCache):
            raise c.ContractError(op, "kv", f"expected a KVCache, got {type(kv).__name__}")
        if not c.same_device(kv.device, self.device):
            raise c.ContractError(op, "kv", f"expected a cache on {self.device}, got one on {kv.device}")

    @declare("kv:kv, layer:int, locs:index, k:float=, v:float=",
             summary="in place: one layer's K/V rows at locs (-1 skipped)",
             rules=("layer in [0, L)", "locs in [0, S) or -1", "locs distinct"), writes=("kv",))
    def store_kv(self, kv: "KVCache", layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows: ``kv.k[layer, locs[i]] = k[i]`` (same for v); locs of -1 are skipped.

        Args:
            locs: int64[N]. k, v: [N, H, d] of the cache's dtype.
        """
        op, dev = "store_kv", self.device
        self._check_kv(op, kv)
        c.check_int(op, "layer", layer)
        if layer >= kv.num_layers:
            raise c.ContractError(op, "layer", f"layer {layer} outside [0, {kv.num_layers})")
        c.check_index(op, "locs", locs, dev, ndim=1)
        N = locs.shape[0]
        shape = (N, kv.num_heads, kv.head_dim)
        c.check_float(op, "k", k, dev, shape=shape, dtypes=(kv.dtype,))
        c.check_float(op, "v", v, dev, shape=shape, dtypes=(kv.dtype,))
        fn = self._impl(op)
        if self.strict:
            c.value_range(op, "locs", locs, 0, kv.num_slots)
            c.value_distinct(op, "locs", locs)
        fn(kv, layer, locs, k, v)

    @declare("kv:kv, src:index, dst:index=",
             summary="in place, every layer: row[dst[i]] = row[src[i]], every read before any write",
             rules=("src and dst in [0, S) or -1", "dst distinct where both sides are live"), writes=("kv",))
    def move_kv(self, kv: "KVCache", src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every layer, K and V: ``row[dst[i]] = row[src[i]]``, all reads before any write.

        ``src`` may overlap ``dst``; ``dst`` entries are distinct; pairs with -1 on either side
        and pairs with ``src == dst`` are no-ops.

        Args:
            src, dst: int64[N].
        """
        op, dev = "move_kv", self.device
        self._check_kv(op, kv)
        c.check_index(op, "src", src, dev, ndim=1)
        c.check_index(op, "dst", dst, dev, shape=(src.shape[0],))
        fn = self._impl(op)
        if self.strict:
            c.value_range(op, "src", src, 0, kv.num_slots)
            c.value_range(op, "dst", dst, 0, kv.num_slots)
            live = (src != c.SENTINEL) & (dst != c.SENTINEL)
            c.value_distinct(op, "dst", dst[live])
        fn(kv, src, dst)

    @declare("out_cache_loc:index=, accept_index:index, req_to_token:index, req_pool_indices:index=, seq_lens:index=",
             ("src", "dst"), summary="the moves that compact each request's accepted nodes into its next positions",
             rules=("accept_index rows hold the request's own nodes, or -1", "req_pool_indices in [0, R)",
                    "0 <= seq_lens and seq_lens + D <= M", "out: -1 from a request's first -1 in accept_index on"))
    def accepted_kv_moves(self, out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moves that compact accepted tree nodes into the request's next positions.

        For request b and ``j < accept_len_b`` (the entries of ``accept_index[b]`` before the
        first -1): ``src = out_cache_loc[accept_index[b, j]]``,
        ``dst = req_to_token[r_b, seq_lens[b] + j]``.

        Args:
            out_cache_loc: int64[B*D] slots of the tree nodes.
            accept_index: int64[B, D]; row b holds flat ids ``b*D + i`` of its own nodes, -1 padded.
            req_to_token: int64[R, M]. req_pool_indices, seq_lens: int64[B].
        Returns:
            ``(src, dst)``, each int64[B*D], entry ``b*D + j``, -1 from ``accept_len_b`` on. No
            host sync.
        """
        op, dev = "accepted_kv_moves", self.device
        c.check_index(op, "accept_index", accept_index, dev, ndim=2)
        B, D = accept_index.shape
        c.check_index(op, "out_cache_loc", out_cache_loc, dev, shape=(B * D,))
        c.check_index(op, "req_to_token", req_to_token, dev, ndim=2)
        c.check_index(op, "req_pool_indices", req_pool_indices, dev, shape=(B,))
        c.check_index(op, "seq_lens", seq_lens, dev, shape=(B,))
        fn = self._impl(op)
        if self.strict:
            R, M = req_to_token.shape
            c.value_range(op, "accept_index", accept_index, 0, B * D)
            c.value_own_nodes(op, "accept_index", accept_index)
            c.value_range(op, "req_pool_indices", req_pool_indices, 0, R, allow_sentinel=False)
            if bool((seq_lens < 0).any()) or bool((seq_lens + D > M).any()):
                raise c.ContractError(op, "seq_lens", f"need 0 <= seq_lens and seq_lens + D <= {M}")
        moves = fn(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens)
        if self.strict:
            src, dst = _unpack(op, moves, ("src", "dst"))
            padding = ~torch.cumprod(accept_index != c.SENTINEL, dim=1).bool().reshape(-1)
            for name, t in (("src", src), ("dst", dst)):
                c.check_index(op, name, t, dev, shape=(B * D,), output=True)
                c.value_range(op, name, t, 0, 2**62, output=True)
                if bool((t[padding] != c.SENTINEL).any()):
                    raise c.ContractError(op, name, "entries from a request's first -1 in accept_index on "
                                          "must be -1", output=True)
        return moves

    # ---------------------------------------------------------------- tree and verify

    @declare("tree_mask:mask, seq_lens:index=",
             ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"),
             summary="positions and retrieve links of B draft trees",
             rules=("tree_mask: each node sees itself and its ancestors, parents before children", "seq_lens >= 0",
                    "out: positions >= 0", "out: retrieve_index in [0, B*D)", "out: links point to later nodes, or -1"))
    def reconstruct_tree(self, tree_mask: torch.Tensor, seq_lens: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions and retrieve links of B draft trees.

        Nodes list parents before children (any topological order; the drafters emit BFS).

        Args:
            tree_mask: bool[B, D, D]; ``tree_mask[b, i, j]`` when node j is node i or an ancestor.
            seq_lens: int64[B], the position of each root.
        Returns:
            ``positions`` int64[B*D] (seq_len + depth), ``retrieve_index`` int64[B, D] (b*D + i),
            ``retrieve_next_token`` int64[B, D] (first child or -1), ``retrieve_next_sibling``
            int64[B, D] (next node with the same parent or -1).
        """
        op, dev = "reconstruct_tree", self.device
        c.check_mask(op, "tree_mask", tree_mask, dev, ndim=3)
        B, D, D2 = tree_mask.shape
        if D != D2 or D < 1:
            raise c.ContractError(op, "tree_mask", f"expected shape (B, D, D) with D >= 1, got {tuple(tree_mask.shape)}")
        c.check_index(op, "seq_lens", seq_lens, dev, shape=(B,))
        fn = self._impl(op)
        if self.strict:
            c.value_tree_mask(op, "tree_mask", tree_mask)
            c.value_range(op, "seq_lens", seq_lens, 0, 2**62, allow_sentinel=False)
        tree = fn(tree_mask, seq_lens)
        if self.strict:
            names = ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")
            outs = _unpack(op, tree, names)
            for name, t, shape in zip(names, outs, ((B * D,), (B, D), (B, D), (B, D))):
                c.check_index(op, name, t, dev, shape=shape, output=True)
            c.value_range(op, "positions", outs[0], 0, 2**62, allow_sentinel=False, output=True)
            c.value_range(op, "retrieve_index", outs[1], 0, B * D, allow_sentinel=False, output=True)
            c.value_tree_links(op, outs[2], outs[3], output=True)
        return tree

    def _check_retrieve(self, op, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling):
        dev = self.device
        c.check_index(op, "candidates", candidates, dev, ndim=2)
        B, D = candidates.shape
        for name, t in (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
                        ("retrieve_next_sibling", retrieve_next_sibling)):
            c.check_index(op, name, t, dev, shape=(B, D))
        if self.strict:
            c.value_range(op, "retrieve_index", retrieve_index, 0, B * D, allow_sentinel=False)
            c.value_tree_links(op, retrieve_next_token, retrieve_next_sibling)
        return B, D

    def _check_verify_outputs(self, op, out, retrieve_index: torch.Tensor, vocab: int | None):
        B, D = retrieve_index.shape
        predicts, accept_index, accept_len = _unpack(op, out, ("predicts", "accept_index", "accept_len"))
        dev = self.device
        c.check_index(op, "predicts", predicts, dev, shape=(B * D,), output=True)
        c.check_index(op, "accept_index", accept_index, dev, shape=(B, D), output=True)
        c.check_index(op, "accept_len", accept_len, dev, shape=(B,), output=True)
        if B * D == 0:
            return
        c.value_range(op, "accept_len", accept_len, 1, D + 1, allow_sentinel=False, output=True)
        if vocab is not None:
            c.value_range(op, "predicts", predicts, 0, vocab, allow_sentinel=False, output=True)
        c.value_accept_rows(op, accept_index, accept_len, retrieve_index)

    @declare("candidates:index, retrieve_index:index=, retrieve_next_token:index=, retrieve_next_sibling:index=, "
             "target_predict:index=", ("predicts", "accept_index", "accept_len"),
             summary="greedy tree verification against the target's argmax",
             rules=(*_TREE_RULES, *(f"out: {rule}" for rule in _VERIFY_OUT)))
    def verify_tree_greedy(self, candidates: torch.Tensor, retrieve_index: torch.Tensor,
                           retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                           target_predict: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy tree verification.

        Walk from the root; at each node take the child whose token equals the target's argmax
        there; stop when none does.

        Args:
            candidates: int64[B, D] draft tokens (node 0 the root token).
            retrieve_*: int64[B, D] from :meth:`reconstruct_tree` (links point to later nodes).
            target_predict: int64[B, D], the target's argmax after each node.
        Returns:
            ``predicts`` int64[B*D] (at each accepted node, the target's token after it; 0
            elsewhere), ``accept_index`` int64[B, D] (flat ids of the root and accepted nodes,
            in order, -1 padded), ``accept_len`` int64[B] (accepted drafts + 1).
            Committed tokens: ``predicts[accept_index[b, :accept_len[b]]]``.
        """
        op = "verify_tree_greedy"
        B, D = self._check_retrieve(op, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling)
        c.check_index(op, "target_predict", target_predict, self.device, shape=(B, D))
        fn = self._impl(op)
        out = fn(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict)
        if self.strict:
            self._check_verify_outputs(op, out, retrieve_index, None)
        return out

    @declare("candidates:index, retrieve_index:index=, retrieve_next_token:index=, retrieve_next_sibling:index=, "
             "target_probs:float=, uniform_samples:float=, uniform_final:float=", ("predicts", "accept_index", "accept_len"),
             summary="tree rejection sampling: committed tokens follow target_probs exactly",
             rules=(*_TREE_RULES, "candidates in [0, V)", "target_probs rows >= 0, summing to 1",
                    "uniform_samples and uniform_final in [0, 1)", "out: predicts in [0, V)",
                    *(f"out: {rule}" for rule in _VERIFY_OUT)))
    def verify_tree_sample(self, candidates: torch.Tensor, retrieve_index: torch.Tensor,
                           retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                           target_probs: torch.Tensor, uniform_samples: torch.Tensor,
                           uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Target-only tree rejection sampling: committed tokens follow ``target_probs`` exactly.

        At a node with target distribution q (initially ``target_probs[b, node]``), children are
        tried in sibling order: child i with token t is accepted when
        ``uniform_samples[b, i] * sum(q) < q[t]``; otherwise ``q[t] = 0`` and the next child is
        tried. An accepted child becomes the current node; when all children are rejected (or
        the node has none), the bonus token is drawn from the residual q by inverse CDF with
        ``uniform_final[b]``: the smallest t with ``cumsum(q)[t] > uniform_final[b] * sum(q)``
        (so a token of zero probability is never drawn). ``predicts`` holds, at each accepted
        node, the accepted child's token or, at the last one, the bonus token.

        Args:
            candidates, retrieve_*: as in :meth:`verify_tree_greedy`.
            target_probs: float[B, D, V], rows >= 0 summing to 1 (temperature/top-k/top-p already
                applied).
            uniform_samples: float[B, D] in [0, 1), the coin for each node's acceptance test.
            uniform_final: float[B] in [0, 1), the coin for the bonus token.
        Returns:
            The outputs of :meth:`verify_tree_greedy`.
        """
        op, dev = "verify_tree_sample", self.device
        B, D = self._check_retrieve(op, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling)
        c.check_float(op, "target_probs", target_probs, dev, ndim=3)
        if tuple(target_probs.shape[:2]) != (B, D):
            raise c.ContractError(op, "target_probs", f"expected shape ({B}, {D}, V), got {tuple(target_probs.shape)}")
        c.check_float(op, "uniform_samples", uniform_samples, dev, shape=(B, D))
        c.check_float(op, "uniform_final", uniform_final, dev, shape=(B,))
        fn = self._impl(op)
        V = target_probs.shape[2]
        if self.strict:
            c.value_range(op, "candidates", candidates, 0, V, allow_sentinel=False)
            c.value_probabilities(op, "target_probs", target_probs)
            c.value_unit_interval(op, "uniform_samples", uniform_samples)
            c.value_unit_interval(op, "uniform_final", uniform_final)
        out = fn(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                 target_probs, uniform_samples, uniform_final)
        if self.strict:
            self._check_verify_outputs(op, out, retrieve_index, V)
        return out

    # ---------------------------------------------------------------- attention

    @declare_builder("attention", "req_to_token:index, req_pool_indices:index, kv_lens:index=, q_lens:index=, "
                     "num_queries:int, tree_mask:mask=, max_kv_len:int, batch_invariant:flag, q_active:index=")
    def attention_layout(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         kv_lens: torch.Tensor, q_lens: torch.Tensor, num_queries: int,
                         tree_mask: torch.Tensor | None = None, max_kv_len: int | None = None,
                         batch_invariant: bool = False, q_active: torch.Tensor | None = None) -> "AttentionLayout":
        """The work split of one batch's attention, built once and reused by every layer.

        Which queries of which request each program handles and which KV rows it reads depend
        only on these metadata tensors, so a forward pass builds the layout once and passes it to
        :meth:`attention` in every layer. A layout is valid while its tensors are unchanged; the
        backend that built it is the only one that can use it.

        Args:
            req_to_token: int64[R, M]. req_pool_indices, kv_lens, q_lens: int64[B],
                ``q_lens <= kv_lens``.
            num_queries: host int N = ``sum(q_lens)``, the rows of ``q``.
            tree_mask: bool[B, D, D] for tree verify (then every ``q_lens[b] == D``), parents before
                children, or None.
            max_kv_len: host int >= max(kv_lens); None reads it from the device (a host sync).
            batch_invariant: split the work so that a query's result does not depend on the rest
                of the batch (same tiling and key chunks whatever B, N or the lengths; together with
                a fixed ``max_kv_len``). A backend that cannot do better may ignore it only if its
                results are invariant anyway.
            q_active: int64[B] or None: only request b's first ``q_active[b]`` queries attend (a
                verify step's nodes worth verifying); the others read no key and their rows of the
                output are zero, which lets a backend skip their work. None: every query attends.
        Returns:
            An :class:`AttentionLayout`.
        """
        op, dev = "attention", self.device
        c.check_index(op, "req_to_token", req_to_token, dev, ndim=2)
        c.check_index(op, "req_pool_indices", req_pool_indices, dev, ndim=1)
        B = req_pool_indices.shape[0]
        c.check_index(op, "kv_lens", kv_lens, dev, shape=(B,))
        c.check_index(op, "q_lens", q_lens, dev, shape=(B,))
        c.check_int(op, "num_queries", num_queries)
        if q_active is not None:
            c.check_index(op, "q_active", q_active, dev, shape=(B,))
        if tree_mask is not None:
            c.check_mask(op, "tree_mask", tree_mask, dev, ndim=3)
            if tree_mask.shape[0] != B or tree_mask.shape[1] != tree_mask.shape[2]:
                raise c.ContractError(op, "tree_mask", f"expected shape ({B}, D, D), got {tuple(tree_mask.shape)}")
            if num_queries != B * tree_mask.shape[1]:
                raise c.ContractError(op, "q", f"with a tree mask q needs B*D = {B * tree_mask.shape[1]} rows, "
                                      f"got {num_queries}")
        if max_kv_len is not None:
            c.check_int(op, "max_kv_len", max_kv_len)
        self._impl(op)
        if self.strict:
            c.value_equal(op, "q", num_queries, int(q_lens.sum()), "rows vs sum(q_lens)")
            if bool((q_lens > kv_lens).any()) or bool((q_lens < 0).any()):
                raise c.ContractError(op, "q_lens", "need 0 <= q_lens <= kv_lens")
            if q_active is not None and bool((q_active < 0).any()):
                raise c.ContractError(op, "q_active", "need q_active >= 0")
            R, M = req_to_token.shape
            c.value_range(op, "req_pool_indices", req_pool_indices, 0, R, allow_sentinel=False)
            c.value_range(op, "kv_lens", kv_lens, 0, M + 1, allow_sentinel=False)
            if max_kv_len is not None and B and int(kv_lens.max()) > max_kv_len:
                raise c.ContractError(op, "max_kv_len", "smaller than max(kv_lens)")
            if tree_mask is not None:
                D = tree_mask.shape[1]
                if bool((q_lens != D).any()):
                    raise c.ContractError(op, "q_lens", f"with a tree mask every request has D = {D} queries")
                c.value_tree_mask(op, "tree_mask", tree_mask)
            max_slot = c.value_read_slots(op, "req_to_token", req_to_token, req_pool_indices, kv_lens)
        if max_kv_len is None:
            max_kv_len = int(kv_lens.max()) if B else 0
        layout = AttentionLayout(backend=self, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                                 kv_lens=kv_lens, q_lens=q_lens, tree_mask=tree_mask,
                                 num_queries=num_queries, max_kv_len=max_kv_len, batch_invariant=bool(batch_invariant),
                                 q_active=q_active)
        if self.strict:
            layout.max_slot = max_slot
        layout.plan = self._attention_layout(layout)
        return layout

    def _attention_layout(self, layout: "AttentionLayout"):
        """The backend's own precomputed work split for ``layout`` (None: nothing to precompute)."""
        return None

    @declare("q:float=, kv:kv, layer:int, req_to_token:index, req_pool_indices:index, kv_lens:index=, q_lens:index=, "
             "sm_scale:scalar, tree_mask:mask=, max_kv_len:int, layout:layout", ("out",),
             summary="paged attention of B requests' queries over the cache: prefill, decode or tree",
             rules=("rows of q == sum(q_lens)", "0 <= q_lens <= kv_lens", "req_pool_indices in [0, R)", "kv_lens <= M",
                    "max_kv_len >= max(kv_lens)", "with a tree mask, every q_lens == D and a valid tree",
                    "every slot read in [0, S)", "q_active >= 0"))
    def attention(self, q: torch.Tensor, kv: "KVCache", layer: int, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, kv_lens: torch.Tensor, q_lens: torch.Tensor,
                  sm_scale: float, tree_mask: torch.Tensor | None = None,
                  max_kv_len: int | None = None, layout: "AttentionLayout | None" = None) -> torch.Tensor:
        """Paged attention of B requests' queries over the KV cache (prefill, decode, tree).

        Request b has ``q_lens[b]`` queries (rows of ``q``, requests concatenated in order) for
        its last ``q_lens[b]`` positions out of ``kv_lens[b]``; its KV rows are
        ``kv[layer, req_to_token[r_b, :kv_lens[b]]]``. Query i sees every position before the
        block of new ones and, inside the block, position j when ``j <= i`` (causal) or, given
        ``tree_mask`` (all ``q_lens == D``), when ``tree_mask[b, i, j]``. Grouped-query: query
        head h reads kv head ``h // (Hq // H)``.

        Args:
            q: float[N, Hq, d], ``N = sum(q_lens)``, the cache's dtype.
            kv_lens, q_lens: int64[B], ``q_lens <= kv_lens``.
            sm_scale: softmax scale. tree_mask: bool[B, D, D] or None.
            max_kv_len: host int >= max(kv_lens); lets a backend size buffers without a sync.
            layout: from :meth:`attention_layout` over these same tensors (every layer of a
                forward shares one); None builds it here. A layout built with ``q_active`` zeroes
                the rows of the queries it leaves out.
        Returns:
            ``out``: float[N, Hq, d] in q's dtype.
        """
        op, dev = "attention", self.device
        self._check_kv(op, kv)
        c.check_int(op, "layer", layer)
        if layer >= kv.num_layers:
            raise c.ContractError(op, "layer", f"layer {layer} outside [0, {kv.num_layers})")
        c.check_float(op, "q", q, dev, ndim=3, dtypes=(kv.dtype,))
        if q.shape[2] != kv.head_dim or q.shape[1] % kv.num_heads != 0:
            raise c.ContractError(op, "q", f"expected shape (N, k*{kv.num_heads}, {kv.head_dim}), got {tuple(q.shape)}")
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            raise c.ContractError(op, "sm_scale", f"expected a Python float, got {type(sm_scale).__name__}")
        if layout is None:
            layout = self.attention_layout(req_to_token, req_pool_indices, kv_lens, q_lens, q.shape[0],
                                           tree_mask, max_kv_len)
        elif not isinstance(layout, AttentionLayout):
            raise c.ContractError(op, "layout", f"expected an AttentionLayout, got {type(layout).__name__}")
        else:
            layout.check_matches(self, req_to_token, req_pool_indices, kv_lens, q_lens, tree_mask, q.shape[0])
        if layout.max_slot is not None and layout.max_slot >= kv.num_slots:
            raise c.ContractError(op, "req_to_token", f"slot {layout.max_slot} read by a request is outside "
                                  f"the cache's [0, {kv.num_slots})")
        out = self._impl(op)(q, kv, layer, layout, float(sm_scale))
        if self.strict:
            c.check_float(op, "out", out, dev, shape=tuple(q.shape), dtypes=(q.dtype,), output=True)
        return out


DECLARATIONS = declarations(Backend)
"""Every op's declaration, in the order :class:`Backend` defines them (:mod:`ngram_hal.declarations`)."""
OPS: tuple[str, ...] = tuple(decl.name for decl in DECLARATIONS)
"""The ops, in declaration order."""


def _unpack(op: str, out, names: tuple[str, ...]) -> tuple:
    """``out`` as the tuple of ``len(names)`` results an op returns (strict output check)."""
    if not isinstance(out, tuple) or len(out) != len(names):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise c.ContractError(op, ", ".join(names), f"expected a tuple ({', '.join(names)}), got {got}", output=True)
    return out

