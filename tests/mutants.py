"""Planted-fault backends: the reference backend with one op broken the way a vendor might.

Each mutant overrides one op of :class:`CpuBackend` (or one of its model kernels, named in
:data:`MODEL_KERNELS`) with a plausible bug and records
``fault`` (its fault class, one of :data:`FAULTS`), ``op`` and ``caught_by``: the conformance
tests (stable ids without the strict-mode part) that must fail on it, in each of ``modes``
(``"on"``, ``"off"``: the strict modes where the fault applies). ``tests/conformance/test_mutants.py`` runs
the suite against every mutant with ``--backend mutants:<Class>``. Mutants may read device data
on the host: they are test doubles, not backends.
"""

from __future__ import annotations

import copy

import torch

from ngram_hal.backend import OPS
from ngram_hal.kernels.cpu import CpuLayerKernels
from ngram_hal.model_kernels import TorchLayerKernels
from ngram_hal.reference import CpuBackend
from ngram_hal.reference import attention, verify
from ngram_hal.speculative.lookup import record_and_draft

FAULTS = (
    "wrong dtype out",
    "off-by-one at page boundaries",
    "off-by-one",
    "sentinel mishandled",
    "sequential instead of parallel moves",
    "partial writes",
    "state changed before an error",
    "mask ignored",
    "wrong GQA head map",
    "greedy/sampling confusion",
    "bonus-token errors",
    "greedy walk errors",
    "silent repair of bad input",
    "BFS assumed",
    "wrong source",
    "capabilities lie",
    "formula slip",
    "narrowed to 32 bits",
    "an input used as scratch",
    "stops short at scale",
    "subnormals flushed",
    "signed zero lost",
    "softmax overflow",
    "half-precision accumulation",
    "wrong layer read",
    "batch invariance not kept",
)
BOTH = ("on", "off")
MODEL_KERNELS = ("norm", "rope_store", "norm_rope_store", "swiglu", "linear_add", "lookup")
"""The model kernels (:class:`~ngram_hal.model_kernels.TorchLayerKernels` methods) mutants break."""


class Mutant(CpuBackend):
    """Base of the planted-fault backends (not itself a mutant)."""

    fault: str = ""
    op: str = ""
    caught_by: tuple[str, ...] = ()
    modes: tuple[str, ...] = BOTH
    # A test the mutant must pass (its fault untouched); None: the registration test of its op.
    control: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = f"mutant-{cls.__name__}"


def mutants() -> list[type[Mutant]]:
    """Every mutant class of this module (the subclasses of :class:`Mutant` that name a fault), in
    definition order."""
    return [cls for cls in globals().values() if isinstance(cls, type) and issubclass(cls, Mutant) and cls.fault]


def _index(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


# ---------------------------------------------------------------- walks with planted mistakes

def greedy_walk(candidates, retrieve_next_token, retrieve_next_sibling, target_predict, *,
                last_match: bool = False, past_mismatch: bool = False):
    """``verify_tree_greedy`` as a per-request Python walk (retrieve_index ``b*D + i``), exact
    unless ``last_match`` (the last matching sibling wins) or ``past_mismatch`` (after a node
    with no matching child, the walk goes on below its first child and accepts later matches)."""
    B, D = candidates.shape
    tokens, first, sibling = candidates.tolist(), retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    target = target_predict.tolist()
    predicts, accept_index, accept_len = [0] * (B * D), [[-1] * D for _ in range(B)], []
    for b in range(B):
        node, at, accepted = 0, 0, [0]
        while True:
            kids, child = [], first[b][at]
            while child >= 0:
                kids.append(child)
                child = sibling[b][child]
            match = [k for k in kids if tokens[b][k] == target[b][at]]
            if match:
                node = at = match[-1] if last_match else match[0]
                accepted.append(node)
            elif past_mismatch and kids:
                at = kids[0]
            else:
                break
        for j, n in enumerate(accepted):
            accept_index[b][j] = b * D + n
            predicts[b * D + n] = target[b][n]
        accept_len.append(len(accepted))
    like = candidates
    return _index(predicts, like), _index(accept_index, like).view(B, D), _index(accept_len, like)


SAMPLING_MISTAKES = ("argmax_shortcut", "no_renormalise", "bonus_from_target", "retry_rejected", "shared_coin",
                     "argmax_bonus")


def mistaken_sampler(mistake: str | None):
    """``verify_tree_sample`` as a per-request Python walk, exact when ``mistake`` is None, else
    with one classic error (one of :data:`SAMPLING_MISTAKES`):

    * ``argmax_shortcut``: a draft that is the target's argmax is accepted with probability 1;
    * ``no_renormalise``: after a rejection the next draft is tested against ``q[t]`` alone,
      not ``q[t] / sum(q)`` of the reduced distribution;
    * ``bonus_from_target``: the bonus token is drawn from the node's full distribution rather
      than the residual left by the rejections;
    * ``retry_rejected``: a rejected token keeps its mass (a repeated sibling token is tried again);
    * ``shared_coin``: every sibling is tested with the first child's coin;
    * ``argmax_bonus``: the bonus token is the residual's argmax, not a draw.
    """
    def verify_sample(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_probs,
                      uniform_samples, uniform_final):
        B, D, _ = target_probs.shape
        tokens, first, sibling = candidates.tolist(), retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
        probs, coins, finals = target_probs.tolist(), uniform_samples.tolist(), uniform_final.tolist()
        predicts, accept_index, accept_len = [0] * (B * D), [[-1] * D for _ in range(B)], []
        for b in range(B):
            node, nodes, out = 0, [0], []
            while True:
                full = probs[b][node]
                q, child, chosen = list(full), first[b][node], None
                shared = coins[b][child] if child >= 0 else 0.0
                while child >= 0:
                    t, u = tokens[b][child], shared if mistake == "shared_coin" else coins[b][child]
                    if mistake == "argmax_shortcut" and q[t] == max(q):
                        ok = True
                    elif mistake == "no_renormalise":
                        ok = u < q[t]
                    else:
                        ok = u * sum(q) < q[t]
                    if ok:
                        chosen = child
                        break
                    if mistake != "retry_rejected":
                        q[t] = 0.0
                    child = sibling[b][child]
                if chosen is None:
                    residual = full if mistake == "bonus_from_target" else q
                    if mistake == "argmax_bonus":
                        t = max(range(len(residual)), key=residual.__getitem__)
                    else:
                        threshold, cdf = finals[b] * sum(residual), 0.0
                        for t, p in enumerate(residual):
                            cdf += p
                            if cdf > threshold:
                                break
                    out.append(t)
                    break
                out.append(tokens[b][chosen])
                nodes.append(chosen)
                node = chosen
            for j, (n, tok) in enumerate(zip(nodes, out)):
                accept_index[b][j] = b * D + n
                predicts[b * D + n] = tok
            accept_len.append(len(nodes))
        like = candidates
        return _index(predicts, like), _index(accept_index, like).view(B, D), _index(accept_len, like)

    return verify_sample


# ---------------------------------------------------------------- alloc_extend

class AllocInt32Slots(Mutant):
    """Hands out int32 slot ids (a kernel written for 32-bit indices)."""

    fault, op = "wrong dtype out", "alloc_extend"
    caught_by = ("test_contract.py::test_outputs[alloc_extend]", "test_alloc.py::test_alloc_extend_fills_partial_page_first")

    def _alloc_extend(self, *args):
        return super()._alloc_extend(*args).to(torch.int32)


def _alloc_loop(prefix_lens, seq_lens, last_loc, free_pages, page_size, opens_page):
    """Slots request by request; ``opens_page(pos, prefix)`` says whether position ``pos`` of a
    request extended from ``prefix`` takes the next free page (else it follows the previous slot)."""
    out, head, pages = [], 0, free_pages.tolist()
    for p, s, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
        slot = last
        for pos in range(p, s):
            if opens_page(pos, p):
                slot, head = pages[head] * page_size, head + 1
            else:
                slot += 1
            out.append(slot)
    return _index(out, prefix_lens)


class AllocBoundaryContinuesPage(Mutant):
    """A prefix that ends exactly on a page boundary is continued in place: its first new token
    lands on the first slot of the next page, which the request does not own."""

    fault, op = "off-by-one at page boundaries", "alloc_extend"
    caught_by = ("test_alloc.py::test_alloc_extend_page_boundaries[4]",)

    def _alloc_extend(self, prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens):
        return _alloc_loop(prefix_lens, seq_lens, last_loc, free_pages, page_size,
                           lambda pos, p: pos % page_size == 0 and not (pos == p and p > 0))


class AllocPartialPageOverrun(Mutant):
    """The rest of a partial page is filled one slot too far (``<=`` for ``<`` at the boundary)."""

    fault, op = "off-by-one at page boundaries", "alloc_extend"
    caught_by = ("test_alloc.py::test_alloc_extend_page_boundaries[4]",
                 "test_alloc.py::test_alloc_extend_fills_partial_page_first")

    def _alloc_extend(self, prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens):
        def opens_page(pos, p):
            boundary = -(-p // page_size) * page_size
            return pos % page_size == 0 and (pos > boundary or p % page_size == 0)
        return _alloc_loop(prefix_lens, seq_lens, last_loc, free_pages, page_size, opens_page)


class AllocClampsNegativePrefix(Mutant):
    """Clamps negative prefix lengths to 0 instead of refusing them."""

    fault, op = "silent repair of bad input", "alloc_extend"
    caught_by = ("test_strict.py::test_alloc_extend_negative_prefix",)
    modes = ("on",)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens):
        fixed = prefix_lens.clamp(min=0) if isinstance(prefix_lens, torch.Tensor) else prefix_lens
        return super().alloc_extend(fixed, seq_lens, last_loc, free_pages, page_size, num_new_tokens)


# ---------------------------------------------------------------- assign_req_to_token, gather_cache_locs

class AssignSkipsSentinelLocs(Mutant):
    """Treats a -1 loc as "no entry" and leaves the cell as it was, instead of writing it."""

    fault, op = "sentinel mishandled", "assign_req_to_token"
    caught_by = ("test_alloc.py::test_sentinel_locs_are_data",)

    def _assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        values, off = locs.tolist(), 0
        for r, a, b in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
            for col in range(a, b):
                if values[off] != -1:
                    req_to_token[r, col] = values[off]
                off += 1


class AssignNarrowsLocs(Mutant):
    """Writes each loc through 32 bits (a kernel reading the values as int32): slots past 2**31 wrap."""

    fault, op = "narrowed to 32 bits", "assign_req_to_token"
    caught_by = ("test_int64.py::test_request_table_keeps_slots_past_2_31",)

    def _assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        super()._assign_req_to_token(req_to_token, req_pool_indices, start, end, locs.to(torch.int32).to(torch.int64))


class TreePositionsNarrowed(Mutant):
    """Adds each node's depth to its root's position in 32 bits: positions past 2**31 wrap."""

    fault, op = "narrowed to 32 bits", "reconstruct_tree"
    caught_by = ("test_int64.py::test_tree_positions_past_2_31",)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        positions, *links = super()._reconstruct_tree(tree_mask, seq_lens)
        return (positions.to(torch.int32).to(torch.int64), *links)


class VerifyUsesTargetAsScratch(Mutant):
    """Greedy verify leaves its walk's marks in ``target_predict`` (an input reused as a buffer)."""

    fault, op = "an input used as scratch", "verify_tree_greedy"
    caught_by = ("test_contract.py::test_inputs_are_read_only[verify_tree_greedy]",)

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        out = super()._verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                          target_predict)
        target_predict.fill_(-1)
        return out


class AssignWritesBeforeChecking(Mutant):
    """Launches the write, then validates: a refused call has already changed the table."""

    fault, op = "state changed before an error", "assign_req_to_token"
    caught_by = ("test_contract.py::test_length_rejected[assign_req_to_token-start]",
                 "test_contract.py::test_dtype_rejected[assign_req_to_token-locs-int32]")

    def assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        values, off = locs.tolist(), 0
        for r, a, b in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
            for col in range(a, b):
                if off < len(values):
                    req_to_token[r, col] = int(values[off])
                off += 1
        super().assign_req_to_token(req_to_token, req_pool_indices, start, end, locs)


class GatherOrdersItsRange(Mutant):
    """Swaps ``start`` and ``end`` where ``end < start`` instead of refusing the range."""

    fault, op = "silent repair of bad input", "gather_cache_locs"
    caught_by = ("test_strict.py::test_req_range_ends_before_it_starts[gather_cache_locs]",)
    modes = ("on",)

    def gather_cache_locs(self, req_to_token, req_pool_indices, start, end, num_tokens=None):
        if isinstance(start, torch.Tensor) and isinstance(end, torch.Tensor) and start.shape == end.shape:
            start, end = torch.minimum(start, end), torch.maximum(start, end)
        return super().gather_cache_locs(req_to_token, req_pool_indices, start, end, num_tokens)


class GatherInt32Locs(Mutant):
    """Returns the gathered locs as int32 (the table read through a 32-bit view of its cells)."""

    fault, op = "wrong dtype out", "gather_cache_locs"
    caught_by = ("test_contract.py::test_outputs[gather_cache_locs]", "test_alloc.py::test_sentinel_locs_are_data")

    def _gather_cache_locs(self, *args):
        return super()._gather_cache_locs(*args).to(torch.int32)


class GatherClampsSentinel(Mutant):
    """Clamps the gathered cells to valid slots, so a -1 cell comes back as slot 0."""

    fault, op = "sentinel mishandled", "gather_cache_locs"
    caught_by = ("test_alloc.py::test_sentinel_locs_are_data",)

    def _gather_cache_locs(self, *args):
        return super()._gather_cache_locs(*args).clamp(min=0)


class GatherCastsIndices(Mutant):
    """Quietly casts int32 request-pool indices to int64 instead of refusing them."""

    fault, op = "silent repair of bad input", "gather_cache_locs"
    caught_by = ("test_contract.py::test_dtype_rejected[gather_cache_locs-req_pool_indices-int32]",)

    def gather_cache_locs(self, req_to_token, req_pool_indices, start, end, num_tokens=None):
        if isinstance(req_pool_indices, torch.Tensor) and req_pool_indices.dtype == torch.int32:
            req_pool_indices = req_pool_indices.long()
        return super().gather_cache_locs(req_to_token, req_pool_indices, start, end, num_tokens)


# ---------------------------------------------------------------- store_kv

class StoreKOnly(Mutant):
    """Writes the K rows and forgets V."""

    fault, op = "partial writes", "store_kv"
    caught_by = ("test_kv.py::test_store_kv_skips_sentinel",)

    def _store_kv(self, kv, layer, locs, k, v):
        rows = torch.where(locs == -1, kv.num_slots, locs)
        kv.k[layer].index_copy_(0, rows, k)


class StoreIntoLayerZero(Mutant):
    """Writes every layer's rows into layer 0 (the layer offset left out of the address)."""

    fault, op = "partial writes", "store_kv"
    caught_by = ("test_kv.py::test_store_kv_skips_sentinel",)

    def _store_kv(self, kv, layer, locs, k, v):
        super()._store_kv(kv, 0, locs, k, v)


class StoreSentinelClamps(Mutant):
    """Clamps locs into range, so rows aimed at -1 land in slot 0."""

    fault, op = "sentinel mishandled", "store_kv"
    caught_by = ("test_kv.py::test_store_kv_skips_sentinel",)

    def _store_kv(self, kv, layer, locs, k, v):
        super()._store_kv(kv, layer, locs.clamp(min=0), k, v)


class StoreCastsInt32Locs(Mutant):
    """Quietly casts int32 locs to int64 instead of refusing them."""

    fault, op = "silent repair of bad input", "store_kv"
    caught_by = ("test_contract.py::test_dtype_rejected[store_kv-locs-int32]",)

    def store_kv(self, kv, layer, locs, k, v):
        if isinstance(locs, torch.Tensor) and locs.dtype == torch.int32:
            locs = locs.long()
        super().store_kv(kv, layer, locs, k, v)


class StoreChecksValuesAfterWriting(Mutant):
    """Runs the strict value checks after the write (to keep them off the launch path), so a
    refused call has already written its rows."""

    fault, op = "state changed before an error", "store_kv"
    caught_by = ("test_strict.py::test_store_kv_duplicate",)
    modes = ("on",)

    def store_kv(self, kv, layer, locs, k, v):
        if self.strict:
            self.strict = False
            try:
                super().store_kv(kv, layer, locs, k, v)
            finally:
                self.strict = True
        super().store_kv(kv, layer, locs, k, v)


class StoreFlushesSubnormals(Mutant):
    """Writes subnormal values as zero (a conversion with flush-to-zero on the way to the cache)."""

    fault, op = "subnormals flushed", "store_kv"
    caught_by = tuple(f"test_edge.py::test_store_kv_keeps_special_values[{d}]" for d in ("float32", "float16"))

    def _store_kv(self, kv, layer, locs, k, v):
        tiny = torch.finfo(kv.dtype).tiny
        k, v = (torch.where(x.abs() < tiny, torch.zeros_like(x), x) for x in (k, v))
        super()._store_kv(kv, layer, locs, k, v)


# ---------------------------------------------------------------- move_kv

class MoveSequential(Mutant):
    """Copies pair by pair, so a move may read a row an earlier move already overwrote."""

    fault, op = "sequential instead of parallel moves", "move_kv"
    caught_by = tuple(f"test_kv.py::test_move_kv_overlapping_sets[{name}]"
                      for name in ("swap", "cycle3", "chain_forward"))

    def _move_kv(self, kv, src, dst):
        for s, d in zip(src.tolist(), dst.tolist()):
            if s != -1 and d != -1:
                kv.k[:, d] = kv.k[:, s]
                kv.v[:, d] = kv.v[:, s]


def _move_rows(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, scratch: int) -> None:
    skip = (src == -1) | (dst == -1) | (src == dst)
    cache.index_copy_(1, torch.where(skip, scratch, dst), cache.index_select(1, torch.where(skip, scratch, src)))


class MoveKOnly(Mutant):
    """Moves the K rows and forgets V."""

    fault, op = "partial writes", "move_kv"
    caught_by = ("test_kv.py::test_move_kv_overlapping_sets[tree_compaction]",)

    def _move_kv(self, kv, src, dst):
        _move_rows(kv.k, src, dst, kv.num_slots)


class MoveFirstLayerOnly(Mutant):
    """Moves the rows of layer 0 only (one layer's launch instead of all)."""

    fault, op = "partial writes", "move_kv"
    caught_by = ("test_kv.py::test_move_kv_overlapping_sets[tree_compaction]",)

    def _move_kv(self, kv, src, dst):
        _move_rows(kv.k[:1], src, dst, kv.num_slots)
        _move_rows(kv.v[:1], src, dst, kv.num_slots)


class MoveSkipsLastLayerK(Mutant):
    """Moves every buffer but the last layer's K (a layer loop one short for K). The engine's
    greedy tokens survive it on the conformance workload; the K/V the engine tier compares do not."""

    fault, op = "partial writes", "move_kv"
    caught_by = ("test_kv.py::test_move_kv_overlapping_sets[tree_compaction]",
                 "test_engine.py::test_greedy_decode_matches_reference[spec-4]")

    def _move_kv(self, kv, src, dst):
        _move_rows(kv.k[:-1], src, dst, kv.num_slots)
        _move_rows(kv.v, src, dst, kv.num_slots)


class MoveReadsSentinelSource(Mutant):
    """Skips pairs with dst -1 but lets src -1 index from the end: the scratch row is copied in."""

    fault, op = "sentinel mishandled", "move_kv"
    caught_by = ("test_kv.py::test_move_kv_skips_sentinel_and_identity", "test_kv.py::test_move_kv_dead_pair_may_share_dst")

    def _move_kv(self, kv, src, dst):
        rows = kv.num_slots + 1
        for cache in (kv.k, kv.v):
            skip = (dst == -1) | (src == dst)
            cache.index_copy_(1, torch.where(skip, kv.num_slots, dst),
                              cache.index_select(1, torch.where(skip, kv.num_slots, src % rows)))


class MoveFirst512Only(Mutant):
    """Moves the first 512 pairs only (one launch of a fixed 512-wide block, no grid over the rest)."""

    fault, op = "stops short at scale", "move_kv"
    caught_by = tuple(f"test_scale.py::test_move_kv_at_scale[{n}-{p}]" for n in (513, 2048) for p in ("random", "chain"))

    def _move_kv(self, kv, src, dst):
        super()._move_kv(kv, src[:512], dst[:512])


class MoveLosesSignedZero(Mutant):
    """Copies rows through an addition of +0.0, which turns -0.0 into +0.0."""

    fault, op = "signed zero lost", "move_kv"
    caught_by = tuple(f"test_edge.py::test_move_kv_keeps_special_values[{d}]" for d in ("float32", "bfloat16"))

    def _move_kv(self, kv, src, dst):
        for cache in (kv.k, kv.v):
            skip = (src == -1) | (dst == -1) | (src == dst)
            rows = cache.index_select(1, torch.where(skip, kv.num_slots, src)) + 0.0
            cache.index_copy_(1, torch.where(skip, kv.num_slots, dst), rows)


class MoveStaleCapabilities(Mutant):
    """move_kv is missing, yet capabilities() lists every op (a hand-written list)."""

    fault, op = "capabilities lie", "move_kv"
    caught_by = ("test_registration.py::test_op_present[move_kv]",)
    _move_kv = None

    def capabilities(self):
        return super().capabilities().model_copy(update={"ops": list(OPS)})


# ---------------------------------------------------------------- accepted_kv_moves

class AcceptedSentinelIndexWraps(Mutant):
    """Uses accept_index entries as indices without stopping at -1: padding wraps to the last
    node and becomes a move."""

    fault, op = "sentinel mishandled", "accepted_kv_moves"
    caught_by = ("test_kv.py::test_accepted_kv_moves_pads_with_sentinel",)

    def _accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        B, D = accept_index.shape
        src = out_cache_loc.index_select(0, accept_index.reshape(-1) % (B * D))
        j = torch.arange(D, dtype=torch.int64, device=accept_index.device)
        cell = ((req_pool_indices * req_to_token.shape[1] + seq_lens).unsqueeze(1) + j).reshape(-1)
        return src, req_to_token.view(-1).index_select(0, cell)


class AcceptedWrongSource(Mutant):
    """Takes the source of the j-th move from the j-th tree node instead of the j-th accepted
    node: right for a chain, wrong once a branch other than the first is accepted."""

    fault, op = "wrong source", "accepted_kv_moves"
    caught_by = ("test_kv.py::test_accepted_kv_moves_pads_with_sentinel",
                 "test_engine.py::test_greedy_decode_matches_reference[spec-4]")

    def _accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        src, dst = super()._accepted_kv_moves(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens)
        return torch.where(src == -1, -1, out_cache_loc), dst


class AcceptedDstOffByOne(Mutant):
    """Compacts to ``seq_len + j + 1``: the root's own position is skipped."""

    fault, op = "off-by-one", "accepted_kv_moves"
    caught_by = ("test_kv.py::test_accepted_kv_moves_pads_with_sentinel",)

    def _accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        return super()._accepted_kv_moves(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens + 1)


class AcceptedClampsForeignIndex(Mutant):
    """Clamps each request's accept_index into its own node range instead of refusing an entry
    that names another request's node."""

    fault, op = "silent repair of bad input", "accepted_kv_moves"
    caught_by = ("test_strict.py::test_accepted_kv_moves_index_of_another_request",)
    modes = ("on",)

    def accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        B, D = accept_index.shape
        first = torch.arange(B, dtype=torch.int64, device=accept_index.device).unsqueeze(1) * D
        own = torch.minimum(torch.maximum(accept_index, first), first + D - 1)
        accept_index = torch.where(accept_index == -1, -1, own)
        return super().accepted_kv_moves(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens)


class AcceptedClampsSeqLens(Mutant):
    """Clamps seq_lens into the rows (0 .. M - D) instead of refusing a tree that does not fit."""

    fault, op = "silent repair of bad input", "accepted_kv_moves"
    caught_by = tuple(f"test_strict.py::test_accepted_kv_moves_bad_rows_and_lengths[{case}]"
                      for case in ("seq_len_past_the_row", "negative_seq_len"))
    modes = ("on",)

    def accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        if all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (accept_index, req_to_token)):
            seq_lens = seq_lens.clamp(0, max(req_to_token.shape[1] - accept_index.shape[1], 0))
        return super().accepted_kv_moves(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens)


# ---------------------------------------------------------------- reconstruct_tree

class TreeInt32Positions(Mutant):
    """Returns positions as int32."""

    fault, op = "wrong dtype out", "reconstruct_tree"
    caught_by = ("test_contract.py::test_outputs[reconstruct_tree]",)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        positions, *links = super()._reconstruct_tree(tree_mask, seq_lens)
        return (positions.to(torch.int32), *links)


class TreeDepthCountsSelf(Mutant):
    """Counts a node among its own ancestors: every position is one too far."""

    fault, op = "off-by-one", "reconstruct_tree"
    caught_by = ("test_tree_verify.py::test_reconstruct_tree_any_topological_order[depth_first]",)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        positions, *links = super()._reconstruct_tree(tree_mask, seq_lens)
        return (positions + 1, *links)


class TreeSiblingsAssumedAdjacent(Mutant):
    """Links node i to node i + 1 as its next sibling when they share a parent: right in BFS
    order, wrong in the other topological orders the contract allows."""

    fault, op = "BFS assumed", "reconstruct_tree"
    caught_by = tuple(f"test_tree_verify.py::test_reconstruct_tree_any_topological_order[{name}]"
                      for name in ("depth_first", "interleaved"))

    def _reconstruct_tree(self, tree_mask, seq_lens):
        positions, index, first, _ = super()._reconstruct_tree(tree_mask, seq_lens)
        B, D, _ = tree_mask.shape
        node = torch.arange(D, dtype=torch.int64, device=tree_mask.device)
        strict = tree_mask & (node.view(D, 1) != node.view(1, D))
        depth = tree_mask.sum(-1) - 1
        parent = torch.where(strict, depth.unsqueeze(1).expand(B, D, D), -1).argmax(-1)
        sibling = torch.full_like(first, -1)
        if D > 2:
            same = parent[:, 2:] == parent[:, 1:-1]
            sibling[:, 1:-1] = torch.where(same, node[2:], -1)
        return positions, index, first, sibling


class TreeAncestry32Bit(Mutant):
    """Keeps each node's ancestors in a 32-bit mask: ancestors past node 31 are lost, so deep
    nodes of trees of more than 32 nodes get wrong depths and parents."""

    fault, op = "stops short at scale", "reconstruct_tree"
    caught_by = ("test_scale.py::test_reconstruct_tree_at_scale[64]",)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        D = tree_mask.shape[-1]
        kept = tree_mask.clone()
        kept[:, :, 32:] = False
        kept |= torch.eye(D, dtype=torch.bool, device=tree_mask.device)
        return super()._reconstruct_tree(kept, seq_lens)


class TreeClearsMaskDiagonal(Mutant):
    """Clears the tree mask's diagonal in place after reading it (the mask doubles as scratch)."""

    fault, op = "an input used as scratch", "reconstruct_tree"
    caught_by = ("test_contract.py::test_inputs_are_read_only[reconstruct_tree]",)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        out = super()._reconstruct_tree(tree_mask, seq_lens)
        tree_mask.diagonal(dim1=1, dim2=2).fill_(False)
        return out


# ---------------------------------------------------------------- verify_tree_greedy

class GreedyInt32AcceptLen(Mutant):
    """Returns accept_len as int32."""

    fault, op = "wrong dtype out", "verify_tree_greedy"
    caught_by = ("test_contract.py::test_outputs[verify_tree_greedy]",)

    def _verify_tree_greedy(self, *args):
        predicts, accept_index, accept_len = super()._verify_tree_greedy(*args)
        return predicts, accept_index, accept_len.to(torch.int32)


class GreedyNoBonus(Mutant):
    """Counts only the accepted drafts in accept_len, leaving out the bonus token."""

    fault, op = "bonus-token errors", "verify_tree_greedy"
    # The engine tier fails on it too: a step that commits no token is refused, not a stall.
    caught_by = (*(f"test_tree_verify.py::test_verify_tree_greedy_worked_examples[{name}]"
                   for name in ("stops_at_first_mismatch", "whole_chain")),
                 "test_engine.py::test_greedy_decode_matches_reference[spec-4]")

    def _verify_tree_greedy(self, *args):
        predicts, accept_index, accept_len = super()._verify_tree_greedy(*args)
        return predicts, accept_index, accept_len - 1


class GreedyBonusFromParent(Mutant):
    """Commits, after the last accepted node, the target's token at the node before it."""

    fault, op = "bonus-token errors", "verify_tree_greedy"
    caught_by = tuple(f"test_tree_verify.py::test_verify_tree_greedy_worked_examples[{name}]"
                      for name in ("first_matching_sibling", "whole_chain"))

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        predicts, accept_index, accept_len = super()._verify_tree_greedy(
            candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict)
        last = accept_index.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1)
        before = accept_index.gather(1, (accept_len - 2).clamp(min=0).unsqueeze(1)).squeeze(1)
        return predicts.index_copy(0, last, target_predict.reshape(-1)[before]), accept_index, accept_len


class GreedyContinuesPastMismatch(Mutant):
    """Does not stop at the first mismatch: walks on below the first child and accepts later matches."""

    fault, op = "greedy walk errors", "verify_tree_greedy"
    caught_by = ("test_tree_verify.py::test_verify_tree_greedy_worked_examples[stops_at_first_mismatch]",)

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        return greedy_walk(candidates, retrieve_next_token, retrieve_next_sibling, target_predict,
                           past_mismatch=True)


class GreedyLastMatchingSibling(Mutant):
    """Takes the last matching sibling (a race where the last writer wins) instead of the first."""

    fault, op = "greedy walk errors", "verify_tree_greedy"
    caught_by = ("test_tree_verify.py::test_verify_tree_greedy_worked_examples[first_matching_sibling]",)

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        return greedy_walk(candidates, retrieve_next_token, retrieve_next_sibling, target_predict, last_match=True)


class GreedyWalkCapped32(Mutant):
    """Walks at most 32 nodes deep (a loop of fixed trip count): a longer accepted path is cut."""

    fault, op = "stops short at scale", "verify_tree_greedy"
    caught_by = ("test_scale.py::test_verify_tree_greedy_at_scale[33]", "test_scale.py::test_verify_tree_greedy_at_scale[64]")

    def _verify_tree_greedy(self, *args):
        predicts, accept_index, accept_len = super()._verify_tree_greedy(*args)
        cut = accept_index[:, 32:]
        dropped = cut[cut >= 0]
        predicts = predicts.index_fill(0, dropped, 0)
        accept_index = accept_index.clone()
        accept_index[:, 32:] = -1
        return predicts, accept_index, accept_len.clamp(max=32)


class GreedyRepairsLayout(Mutant):
    """Copies non-contiguous arguments into contiguous ones instead of refusing them."""

    fault, op = "silent repair of bad input", "verify_tree_greedy"
    caught_by = ("test_contract.py::test_layout_rejected[verify_tree_greedy-target_predict]",
                 "test_contract.py::test_layout_rejected[verify_tree_greedy-candidates]")

    def verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                           target_predict):
        args = (candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict)
        return super().verify_tree_greedy(*(a.contiguous() for a in args))


# ---------------------------------------------------------------- verify_tree_sample

SAMPLE_CATCHER = "test_tree_verify.py::test_verify_tree_sample_follows_target_distribution"


class SampleAsGreedy(Mutant):
    """Verifies against the target's argmax: greedy where sampling was asked for."""

    fault, op = "greedy/sampling confusion", "verify_tree_sample"
    caught_by = (SAMPLE_CATCHER,)

    def _verify_tree_sample(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_probs, uniform_samples, uniform_final):
        return verify.verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                         target_probs.argmax(-1))


class SamplingMistake(Mutant):
    """Base of the mutants whose verify_tree_sample is :func:`mistaken_sampler` with ``mistake``
    (not itself a mutant)."""

    op = "verify_tree_sample"
    caught_by = (SAMPLE_CATCHER,)
    mistake = ""

    def _verify_tree_sample(self, *args):
        return mistaken_sampler(self.mistake)(*args)


class SampleArgmaxBonus(SamplingMistake):
    """Samples the drafts but takes the bonus token as the residual's argmax."""

    fault, mistake = "greedy/sampling confusion", "argmax_bonus"


class SampleBonusFromFullDistribution(SamplingMistake):
    """Draws the bonus token from the node's full distribution, not the residual of the rejections."""

    fault, mistake = "bonus-token errors", "bonus_from_target"


class SampleNoRenormalise(SamplingMistake):
    """After a rejection, tests the next draft against ``q[t]`` instead of ``q[t] / sum(q)``."""

    fault, mistake = "greedy/sampling confusion", "no_renormalise"


class SampleSharedCoin(SamplingMistake):
    """Tests every sibling with the first child's coin."""

    fault, mistake = "greedy/sampling confusion", "shared_coin"


# ---------------------------------------------------------------- attention

class AttentionFloat32Out(Mutant):
    """Returns float32 for half-precision queries (the accumulator, not cast back)."""

    fault, op = "wrong dtype out", "attention"
    caught_by = ("test_attention.py::test_decode[hq4-h2]", "test_attention.py::test_prefill[batch]")

    def _attention(self, q, kv, layer, layout, sm_scale):
        return super()._attention(q, kv, layer, layout, sm_scale).float()


def _plan(layout, tree_mask, kv_shift: int = 0):
    return attention.layout(layout.req_to_token, layout.req_pool_indices, layout.kv_lens + kv_shift, layout.q_lens,
                            tree_mask, layout.num_queries, layout.max_kv_len + kv_shift)


class AttentionTreeAsCausal(Mutant):
    """Ignores the tree mask and treats the D tree nodes as a causal run of tokens."""

    fault, op = "mask ignored", "attention"
    caught_by = ("test_attention.py::test_tree_verify[branching]",)

    def _attention_layout(self, layout):
        if layout.tree_mask is None:
            return super()._attention_layout(layout)
        B, D, _ = layout.tree_mask.shape
        causal = torch.ones(D, D, dtype=torch.bool, device=layout.tree_mask.device).tril().expand(B, D, D)
        return _plan(layout, causal.contiguous())


class AttentionTreeMaskIgnored(Mutant):
    """Lets every tree node see every other node of its tree."""

    fault, op = "mask ignored", "attention"
    caught_by = ("test_attention.py::test_tree_verify[chain]", "test_attention.py::test_tree_verify[branching]")

    def _attention_layout(self, layout):
        if layout.tree_mask is None:
            return super()._attention_layout(layout)
        return _plan(layout, torch.ones_like(layout.tree_mask))


class AttentionActiveIgnored(Mutant):
    """Computes every query, as if the layout had no ``q_active``."""

    fault, op = "mask ignored", "attention"
    caught_by = tuple(f"test_attention.py::test_active_queries[{m}]" for m in ("chain", "branching", "extend"))

    def _attention_layout(self, layout):
        return _plan(layout, layout.tree_mask)


class AttentionActiveOneShort(Mutant):
    """Zeroes one query more than ``q_active`` leaves out (``i >= q_active - 1``)."""

    fault, op = "off-by-one", "attention"
    caught_by = tuple(f"test_attention.py::test_active_queries[{m}]" for m in ("chain", "branching", "extend"))

    def _attention_layout(self, layout):
        return attention.layout(layout.req_to_token, layout.req_pool_indices, layout.kv_lens, layout.q_lens,
                                layout.tree_mask, layout.num_queries, layout.max_kv_len, layout.batch_invariant,
                                None if layout.q_active is None else (layout.q_active - 1).clamp(min=0))


class AttentionReadsOneKeyMore(Mutant):
    """Reads ``kv_lens + 1`` positions: each query sees the key after its own."""

    fault, op = "off-by-one", "attention"
    caught_by = ("test_attention.py::test_decode[hq2-h1]", "test_attention.py::test_prefill[batch]")

    def _attention_layout(self, layout):
        return _plan(layout, layout.tree_mask, kv_shift=1)


class AttentionGqaModulo(Mutant):
    """Maps query head h to KV head ``h % H`` instead of ``h // (Hq // H)``."""

    fault, op = "wrong GQA head map", "attention"
    caught_by = ("test_attention.py::test_decode[hq4-h2]", "test_attention.py::test_decode[hq6-h2]")

    def _attention(self, q, kv, layer, layout, sm_scale):
        Hq, H = q.shape[1], kv.num_heads
        h = torch.arange(Hq, device=q.device)
        # Head h of the reference, which reads KV head h // g, is fed query head perm[h] with
        # perm[h] % H == h // g: query head j then reads KV head j % H.
        perm = (h % (Hq // H)) * H + h // (Hq // H)
        out = super()._attention(q[:, perm].contiguous(), kv, layer, layout, sm_scale)
        return torch.empty_like(out).index_copy_(1, perm, out)


class AttentionRepairsIndices(Mutant):
    """Copies non-contiguous index tensors into contiguous ones instead of refusing them."""

    fault, op = "silent repair of bad input", "attention"
    caught_by = ("test_contract.py::test_layout_rejected[attention_layout-kv_lens]",
                 "test_contract.py::test_layout_rejected[attention-req_pool_indices]",
                 "test_contract.py::test_layout_rejected[attention-tree_mask]")

    def attention_layout(self, req_to_token, req_pool_indices, kv_lens, q_lens, num_queries, tree_mask=None,
                         max_kv_len=None):
        fix = [t.contiguous() if isinstance(t, torch.Tensor) else t
               for t in (req_to_token, req_pool_indices, kv_lens, q_lens, tree_mask)]
        return super().attention_layout(*fix[:4], num_queries, fix[4], max_kv_len)


def dense_naive(q, kv, layer, layout, sm_scale, subtract_max: bool = True, score_dtype=torch.float32):
    """Attention request by request from the layout's raw tensors, the scores in ``score_dtype``
    (the dot products accumulate there) and, unless ``subtract_max``, exponentiated as they are."""
    out = torch.zeros_like(q, dtype=torch.float32)
    table, pool = layout.req_to_token.tolist(), layout.req_pool_indices.tolist()
    off, g = 0, q.shape[1] // kv.num_heads
    for b, (T, n) in enumerate(zip(layout.kv_lens.tolist(), layout.q_lens.tolist())):
        rows = _index(table[pool[b]][:T], q)
        k = kv.k[layer].index_select(0, rows).repeat_interleave(g, dim=1)
        v = kv.v[layer].index_select(0, rows).repeat_interleave(g, dim=1).float()
        scores = torch.einsum("nhd,thd->hnt", q[off:off + n].to(score_dtype), k.to(score_dtype)).float() * sm_scale
        visible = torch.ones(n, T, dtype=torch.bool, device=q.device)
        if layout.tree_mask is not None:
            visible[:, T - n:] = layout.tree_mask[b]
        else:
            visible[:, T - n:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if subtract_max:
            scores = scores - scores.masked_fill(~visible, -torch.inf).amax(-1, keepdim=True)
        weights = scores.exp().masked_fill(~visible, 0.0)
        out[off:off + n] = torch.einsum("hnt,thd->nhd", weights / weights.sum(-1, keepdim=True), v)
        off += n
    return out.to(q.dtype)


class AttentionNoMaxSubtraction(Mutant):
    """Exponentiates the scores without subtracting their maximum: exp overflows past 88.7."""

    fault, op = "softmax overflow", "attention"
    caught_by = tuple(f"test_edge.py::test_attention_scores_past_exp_overflow[{d}-{m}]"
                      for d in ("float32", "bfloat16") for m in ("causal", "tree"))
    control = "test_attention.py::test_decode[hq4-h2]"

    def _attention(self, q, kv, layer, layout, sm_scale):
        return dense_naive(q, kv, layer, layout, sm_scale, subtract_max=False)


class AttentionInvariantLayoutIgnored(Mutant):
    """Claims batch invariance but builds every layout as the default one: a query's blocks and key
    columns follow the batch, and a tree node reads its ancestors where they sit in the tree."""

    fault, op = "batch invariance not kept", "attention"
    # Not test_attention_rows_do_not_depend_on_the_batch: whether the default layout's rows change
    # with the batch depends on the CPU's attention kernel (on an AVX-512 machine they did not for
    # its examples). A tree node reading its ancestors where they sit in the tree always differs.
    caught_by = ("test_invariance.py::test_tree_nodes_equal_the_decode_of_their_path[short-prefix]",
                 "test_invariance.py::test_tree_nodes_equal_the_decode_of_their_path[long-prefix]")

    def _attention_layout(self, layout):
        return attention.layout(layout.req_to_token, layout.req_pool_indices, layout.kv_lens, layout.q_lens,
                                layout.tree_mask, layout.num_queries, layout.max_kv_len)


class InvariantByDefaultWhereItFails(Mutant):
    """Runs the batch-invariant mode by default on a device where, by its own capabilities, the mode
    does not hold (a default written for one device, left on for another)."""

    fault, op = "capabilities lie", "attention"
    caught_by = ("test_registration.py::test_capabilities",)

    def invariance_holds(self) -> bool:
        return False

    def invariant_by_default(self) -> bool:
        return True


class AttentionHalfPrecisionScores(Mutant):
    """Accumulates the query-key dot products in the input dtype: float16 scores overflow."""

    fault, op = "half-precision accumulation", "attention"
    caught_by = tuple(f"test_edge.py::test_attention_dot_products_past_the_dtype[float16-{m}]"
                      for m in ("causal", "tree"))
    control = "test_attention.py::test_decode[hq4-h2]"

    def _attention(self, q, kv, layer, layout, sm_scale):
        return dense_naive(q, kv, layer, layout, sm_scale, score_dtype=q.dtype)


class AttentionFirstKeyTile(Mutant):
    """Reads only each request's first 256 keys (one key tile, no loop over the rest)."""

    fault, op = "stops short at scale", "attention"
    caught_by = tuple(f"test_scale.py::test_attention_long_context[{n}-{m}]" for n in (300, 1100)
                      for m in ("causal", "tree"))

    def _attention_layout(self, layout):
        plan = super()._attention_layout(layout)
        if plan is not None:
            plan.slots[:, 256:] = -1
        return plan


class AttentionKFromVInLayerZero(Mutant):
    """Reads layer 0's keys from the V cache (one layer's K pointer set to V's)."""

    fault, op = "wrong layer read", "attention"
    caught_by = ("test_scale.py::test_attention_reads_every_layer",)

    def _attention(self, q, kv, layer, layout, sm_scale):
        if layer == 0:
            kv = copy.copy(kv)
            kv.k = kv.v
        return super()._attention(q, kv, layer, layout, sm_scale)


# ---------------------------------------------------------------- model kernels


class KernelMutant(Mutant):
    """Base of the mutants whose model kernels are broken: :attr:`kernels` is the faulty
    :class:`TorchLayerKernels` subclass the backend gives the model."""

    kernels: type[TorchLayerKernels] = TorchLayerKernels
    control = "test_model_kernels.py::test_device_lookup_matches_torch[8]"

    def layer_kernels(self, config, dtype, batch_invariant=False):
        return self.kernels(config, self, dtype)


class _NormDropsResidual(TorchLayerKernels):
    def norm(self, x, weight, delta=None):
        return super().norm(x if delta is None else x + delta, weight)


class NormForgetsTheResidualStream(KernelMutant):
    """The fused norm adds the pending delta for its own input but never writes the sum back."""

    fault, op, kernels = "partial writes", "norm", _NormDropsResidual
    caught_by = tuple(f"test_model_kernels.py::test_norm_matches_torch[residual-{n}]" for n in (1, 3, 40))


class _RotaryIntoLayerZero(TorchLayerKernels):
    def rope_store(self, rope, qkv, kv, layer, out_cache_loc):
        return super().rope_store(rope, qkv, kv, 0, out_cache_loc)


class RotaryStoresIntoLayerZero(KernelMutant):
    """The rotary kernel stores every layer's K/V into layer 0 (the layer offset left out)."""

    fault, op, kernels = "partial writes", "rope_store", _RotaryIntoLayerZero
    caught_by = tuple(f"test_model_kernels.py::test_rotary_and_kv_store_match_torch[{n}]" for n in (1, 3, 40))


class _QkvStepShiftsSlots(TorchLayerKernels):
    def norm_rope_store(self, x, norm, linear, rope, kv, layer, out_cache_loc, delta=None):
        return super().norm_rope_store(x, norm, linear, rope, kv, layer, out_cache_loc.roll(1), delta)


class QkvStepStoresIntoTheNextRowsSlot(KernelMutant):
    """The fused QKV step writes each token's K/V into the slot of the token before it."""

    fault, op, kernels = "off-by-one", "norm_rope_store", _QkvStepShiftsSlots
    caught_by = tuple(f"test_model_kernels.py::test_qkv_step_matches_torch[{n}]" for n in (3, 40))


class _SwigluSwapped(TorchLayerKernels):
    def swiglu(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(up) * gate


class SwigluGatesTheWrongHalf(KernelMutant):
    """SwiGLU applies the SiLU to the up half instead of the gate half."""

    fault, op, kernels = "formula slip", "swiglu", _SwigluSwapped
    caught_by = (*(f"test_model_kernels.py::test_swiglu_matches_torch[{n}]" for n in (1, 3, 40)),
                 *(f"test_model_kernels.py::test_products_match_torch[{n}]" for n in (1, 3, 40)))


class _LinearAddLosesResidual(TorchLayerKernels):
    def linear_add(self, y, linear, x):
        x.copy_(linear(y))  # the product replaces the stream instead of adding to it
        return None


class LinearAddOverwritesTheStream(KernelMutant):
    """The product after attention and after the MLP overwrites the residual stream."""

    fault, op, kernels = "formula slip", "linear_add", _LinearAddLosesResidual
    caught_by = tuple(f"test_model_kernels.py::test_products_match_torch[{n}]" for n in (1, 3, 40))


class ProductsInvariantUpToKernelRows(KernelMutant):
    """Claims batch invariance but builds the products of the default mode: past the compiled
    kernel's rows they go to BLAS, which sums a row in blocks that depend on the call."""

    fault, op, kernels = "batch invariance not kept", "linear_add", CpuLayerKernels
    caught_by = ("test_invariance.py::test_model_kernel_rows_do_not_depend_on_the_batch[300]",)


def _lookup_repeats_its_first_draft(table, rows, accept_tokens, accept_lens, new_seq_lens, tree_size, max_ngram,
                                    min_ngram, live=None, out=None):
    chains = record_and_draft(table, rows, accept_tokens, accept_lens, new_seq_lens, tree_size, max_ngram, min_ngram,
                              live).view(-1, tree_size).clone()
    chains[:, 2:] = chains[:, 1:-1].clone()  # the copy's position advanced one draft late
    chains = chains.view(-1)
    return chains if out is None else out.copy_(chains)


class LookupRepeatsItsFirstDraft(KernelMutant):
    """The device drafter's lookup kernel drafts its first token twice: every later draft is one
    position behind the match it copies."""

    fault, op = "off-by-one", "lookup"
    control = "test_model_kernels.py::test_norm_matches_torch[residual-1]"
    caught_by = ("test_model_kernels.py::test_device_lookup_matches_torch[8]",)

    def lookup_kernel(self):
        return _lookup_repeats_its_first_draft


class HonestPartialBackend(CpuBackend):
    """Not a mutant: a partial backend without move_kv whose capabilities() says so. The suite
    must skip its move_kv tests, not fail them."""

    name = "partial-no-move"
    _move_kv = None
