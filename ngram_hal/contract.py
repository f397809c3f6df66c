"""The pinned contract every backend honours.

* Every index-like tensor (slot locations, request-pool indices, positions, lengths, tree
  retrieve indices, accept index and lengths, token ids, the ``req_to_token`` table) is
  ``torch.int64``, contiguous and on the backend's device, in and out. Masks are ``torch.bool``.
* ``SENTINEL`` (-1) means "no entry"; ops skip sentinel entries.
* A wrong dtype, device, rank or shape raises :class:`ContractError` naming the op and the
  argument before any kernel runs. The ``check_*`` helpers read tensor metadata only (no host
  sync). The ``value_*`` helpers read data and run only in strict mode.
* In strict mode the outputs of every op are checked too (dtype, shape, device, sentinel range);
  an output that breaks the contract raises :class:`ContractError` naming the op and the output.
* Draft trees list parents before children (any topological order; the drafters emit BFS).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

INDEX_DTYPE = torch.int64
MASK_DTYPE = torch.bool
SENTINEL = -1
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STRICT_ENV = "NGRAM_HAL_STRICT"


class ContractError(TypeError, ValueError):
    """An argument or an output broke the contract.

    ``op`` and ``arg`` name where; ``output`` is True when ``arg`` names one of the op's outputs
    (checked in strict mode) rather than an argument.
    """

    def __init__(self, op: str, arg: str, message: str, output: bool = False):
        self.op = op
        self.arg = arg
        self.output = output
        super().__init__(f"{op}: {'output' if output else 'argument'} '{arg}': {message}")


def strict_from_env() -> bool:
    """True when ``NGRAM_HAL_STRICT`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` and ``cuda:0`` name the same current device."""
    if a == b:
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return True
    return a.index == b.index


def _tensor(op: str, name: str, t, output: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ContractError(op, name, f"expected a torch.Tensor, got {type(t).__name__}", output)
    return t


def _shape(op: str, name: str, t: torch.Tensor, ndim: int | None, shape: Sequence[int | None] | None,
           output: bool):
    if ndim is not None and t.dim() != ndim:
        raise ContractError(op, name, f"expected rank {ndim}, got rank {t.dim()} (shape {tuple(t.shape)})", output)
    if shape is not None:
        if t.dim() != len(shape):
            raise ContractError(op, name, f"expected rank {len(shape)}, got shape {tuple(t.shape)}", output)
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ContractError(
                    op, name, f"expected shape {tuple('*' if s is None else s for s in shape)}, "
                    f"got {tuple(t.shape)} (axis {axis})", output)


def _place(op: str, name: str, t: torch.Tensor, device: torch.device, output: bool):
    if not same_device(t.device, device):
        raise ContractError(op, name, f"expected a tensor on {device}, got one on {t.device}", output)
    if not t.is_contiguous():
        raise ContractError(op, name, "expected a contiguous tensor", output)


def check_tensor(op: str, name: str, t, device: torch.device) -> None:
    """A contiguous tensor of any dtype and shape on ``device``."""
    _place(op, name, _tensor(op, name, t, False), device, False)


def check_index(op: str, name: str, t, device: torch.device, ndim: int | None = None,
                shape: Sequence[int | None] | None = None, output: bool = False) -> torch.Tensor:
    """An index-like tensor: int64, contiguous, on ``device``, of the given rank/shape.

    ``output=True`` checks an op's result (the error then names an output, not an argument).
    """
    t = _tensor(op, name, t, output)
    if t.dtype != INDEX_DTYPE:
        raise ContractError(op, name, f"expected dtype torch.int64, got {t.dtype} (no implicit casts)", output)
    _shape(op, name, t, ndim, shape, output)
    _place(op, name, t, device, output)
    return t


def check_mask(op: str, name: str, t, device: torch.device, ndim: int | None = None,
               shape: Sequence[int | None] | None = None) -> torch.Tensor:
    """A mask: bool, contiguous, on ``device``."""
    t = _tensor(op, name, t, False)
    if t.dtype != MASK_DTYPE:
        raise ContractError(op, name, f"expected dtype torch.bool, got {t.dtype}")
    _shape(op, name, t, ndim, shape, False)
    _place(op, name, t, device, False)
    return t


def check_float(op: str, name: str, t, device: torch.device, ndim: int | None = None,
                shape: Sequence[int | None] | None = None,
                dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, output: bool = False) -> torch.Tensor:
    """A floating tensor of one of ``dtypes``, contiguous, on ``device`` (``output``: as in
    :func:`check_index`)."""
    t = _tensor(op, name, t, output)
    if t.dtype not in dtypes:
        raise ContractError(op, name, f"expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}", output)
    _shape(op, name, t, ndim, shape, output)
    _place(op, name, t, device, output)
    return t


def check_int(op: str, name: str, value, minimum: int = 0) -> int:
    """A host-side Python integer argument (never a tensor: reading one would sync)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(op, name, f"expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ContractError(op, name, f"expected a value >= {minimum}, got {value}")
    return value


# Value checks: these read data (a host sync on accelerators) and run only in strict mode.

def value_range(op: str, name: str, t: torch.Tensor, low: int, high: int, allow_sentinel: bool = True,
                output: bool = False):
    """Every entry in ``[low, high)``, or ``SENTINEL`` where allowed."""
    if t.numel() == 0:
        return
    bad = (t < low) | (t >= high)
    if allow_sentinel:
        bad &= t != SENTINEL
    if bool(bad.any()):
        first = t[bad][0].item()
        allowed = " or -1" if allow_sentinel else ""
        raise ContractError(op, name, f"value {first} outside [{low}, {high}){allowed}", output)


def value_distinct(op: str, name: str, t: torch.Tensor, ignore_sentinel: bool = True):
    """No entry repeated (sentinels excepted)."""
    vals = t[t != SENTINEL] if ignore_sentinel else t.reshape(-1)
    if vals.numel() != torch.unique(vals).numel():
        raise ContractError(op, name, "entries must be distinct")


def value_equal(op: str, name: str, got: int, want: int, what: str):
    """A data-derived count that must match a host-side one."""
    if got != want:
        raise ContractError(op, name, f"{what}: expected {want}, got {got}")


def value_disjoint_rows(op: str, name: str, rows: torch.Tensor, start: torch.Tensor, end: torch.Tensor):
    """No two requests write overlapping ranges of one row: ``[start, end)`` of requests that
    share a row of ``rows`` are disjoint (the result would otherwise depend on write order)."""
    B = rows.shape[0]
    if B < 2:
        return
    same = rows.unsqueeze(1) == rows.unsqueeze(0)
    nonempty = start < end
    overlap = (start.unsqueeze(1) < end.unsqueeze(0)) & (start.unsqueeze(0) < end.unsqueeze(1))
    clash = same & overlap & nonempty.unsqueeze(1) & nonempty.unsqueeze(0)
    clash &= ~torch.eye(B, dtype=torch.bool, device=rows.device)
    if bool(clash.any()):
        i, j = clash.nonzero()[0].tolist()
        raise ContractError(op, name, f"requests {i} and {j} write overlapping ranges of row {rows[i].item()}")


def value_probabilities(op: str, name: str, probs: torch.Tensor):
    """Rows of ``probs`` (last axis) are distributions: finite, >= 0, summing to 1.

    The sum is compared in float64 within 1e-3 (float32) or 1e-2 (half types), the rounding of a
    normalised row stored in that dtype.
    """
    if probs.numel() == 0:
        return
    wide = probs.double()
    if not bool(torch.isfinite(wide).all()) or bool((wide < 0).any()):
        raise ContractError(op, name, "probabilities must be finite and >= 0")
    tol = 1e-3 if probs.dtype == torch.float32 else 1e-2
    sums = wide.sum(-1)
    bad = (sums - 1).abs() > tol
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise ContractError(op, name, f"row {at} sums to {sums[at].item():.6g}, expected 1 (within {tol})")


def value_unit_interval(op: str, name: str, t: torch.Tensor):
    """Every entry in ``[0, 1)`` (a uniform coin)."""
    bad = ~((t >= 0) & (t < 1))
    if bool(bad.any()):
        raise ContractError(op, name, f"value {t[bad][0].item()} outside [0, 1)")


def value_tree_mask(op: str, name: str, mask: torch.Tensor):
    """``mask[b]`` encodes a tree rooted at node 0 whose nodes list parents before children.

    Any topological order is valid (the drafters emit BFS, which is one). Node i sees itself;
    node 0 sees only itself; every other node i has exactly one parent p < i (its deepest
    ancestor) and sees exactly the nodes its parent sees plus itself.
    """
    if mask.numel() == 0:
        return
    B, D, _ = mask.shape
    eye = torch.eye(D, dtype=torch.bool, device=mask.device).expand(B, D, D)
    if not bool(mask[eye].all()):
        raise ContractError(op, name, "every node must see itself (diagonal must be true)")
    if bool(torch.triu(mask, diagonal=1).any()):
        raise ContractError(op, name, "a node may only see nodes before it (parents come before their children)")
    if D == 1:
        return
    if bool(mask[:, 0, 1:].any()):
        raise ContractError(op, name, "node 0 is the root and sees only itself")
    if not bool(mask[:, 1:, 0].all()):
        raise ContractError(op, name, "every node must see the root")
    strict_anc = mask & ~eye
    depth = strict_anc.sum(-1)
    # The parent is the strict ancestor of largest depth; ancestors must be a chain ending there.
    anc_depth = torch.where(strict_anc, depth.unsqueeze(1).expand(B, D, D), -1)
    parent = anc_depth.argmax(-1)
    parent_row = torch.gather(mask, 1, parent.unsqueeze(-1).expand(B, D, D))
    expected = parent_row | eye
    if not bool((expected[:, 1:] == mask[:, 1:]).all()):
        raise ContractError(op, name, "ancestor sets must form a tree (each node: its parent's ancestors + itself)")


def value_tree_links(op: str, next_token: torch.Tensor, next_sibling: torch.Tensor, output: bool = False):
    """``retrieve_next_token`` / ``retrieve_next_sibling`` (int64[B, D]) link a tree of D nodes
    listed parents before children: each link points to a later node or is -1, the root has no
    sibling, and every node but the root is reached by exactly one link."""
    B, D = next_token.shape
    if B * D == 0:
        return
    node = torch.arange(D, dtype=torch.int64, device=next_token.device)
    for name, links in (("retrieve_next_token", next_token), ("retrieve_next_sibling", next_sibling)):
        bad = (links != SENTINEL) & ((links <= node) | (links >= D))
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ContractError(op, name, f"request {b}, node {i} links to {links[b, i].item()}: links point "
                                f"to a later node (parents come before their children) or are -1", output)
    if bool((next_sibling[:, 0] != SENTINEL).any()):
        raise ContractError(op, "retrieve_next_sibling", "the root (node 0) has no sibling", output)
    reached = torch.zeros(B, D + 1, dtype=torch.int64, device=next_token.device)
    for links in (next_token, next_sibling):
        reached.scatter_add_(1, torch.where(links == SENTINEL, D, links), torch.ones_like(links))
    want = torch.ones(D, dtype=torch.int64, device=next_token.device)
    want[0] = 0
    bad = reached[:, :D] != want
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise ContractError(op, "retrieve_next_token", f"request {b}: node {i} is reached by "
                            f"{reached[b, i].item()} links, expected {want[i].item()} (the links must form a tree)",
                            output)


def value_own_nodes(op: str, name: str, accept_index: torch.Tensor, output: bool = False):
    """Row b of ``accept_index`` (int64[B, D]) holds -1 or flat ids of request b's own nodes,
    ``b*D .. b*D + D - 1``."""
    B, D = accept_index.shape
    first = torch.arange(B, dtype=torch.int64, device=accept_index.device).unsqueeze(1) * D
    bad = (accept_index != SENTINEL) & ((accept_index < first) | (accept_index >= first + D))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ContractError(op, name, f"entry [{b}, {j}] = {accept_index[b, j].item()} is not a node of request "
                            f"{b} (ids {b * D} to {b * D + D - 1})", output)


def value_accept_rows(op: str, accept_index: torch.Tensor, accept_len: torch.Tensor, retrieve_index: torch.Tensor):
    """Outputs of tree verification: row b of ``accept_index`` (int64[B, D]) starts at its root
    ``retrieve_index[b, 0]``, holds ``accept_len[b]`` ids taken from ``retrieve_index[b]``, then -1."""
    D = accept_index.shape[1]
    filled = torch.arange(D, dtype=torch.int64, device=accept_index.device) < accept_len.unsqueeze(1)
    own = (accept_index.unsqueeze(2) == retrieve_index.unsqueeze(1)).any(-1)
    if (bool((accept_index[:, 0] != retrieve_index[:, 0]).any()) or bool((filled & ~own).any())
            or bool((~filled & (accept_index != SENTINEL)).any())):
        raise ContractError(op, "accept_index", "row b must start at its root, hold accept_len[b] ids of its own "
                            "nodes, then -1", output=True)


def value_read_slots(op: str, name: str, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_lens: torch.Tensor) -> int | None:
    """The largest slot attention reads (the cells ``req_to_token[r_b, :kv_lens[b]]``), None when
    it reads none; a negative slot among them is a ContractError naming ``name``."""
    M = req_to_token.shape[1]
    if req_pool_indices.numel() == 0 or M == 0:
        return None
    cols = torch.arange(M, dtype=torch.int64, device=req_to_token.device)
    read = req_to_token.index_select(0, req_pool_indices)[cols < kv_lens.unsqueeze(1)]
    if read.numel() == 0:
        return None
    if bool((read < 0).any()):
        raise ContractError(op, name, "a request reads a -1 (or negative) slot within its first kv_lens columns")
    return int(read.max())


def check_record_and_draft(op: str, table: torch.Tensor, rows: torch.Tensor, accept_tokens: torch.Tensor,
                           accept_lens: torch.Tensor, new_seq_lens: torch.Tensor, tree_size: int,
                           live: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           match: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check the arguments of the device drafter's record-and-draft kernel
    (:func:`ngram_hal.speculative.lookup.record_and_draft` and its Triton implementation) from
    their metadata alone; ``(B, W, S, n)``. A wrong one raises ``ContractError`` naming it."""
    dev = table.device
    W = check_index(op, "table", table, dev, ndim=2).shape[1]
    B = check_index(op, "accept_lens", accept_lens, dev, ndim=1).shape[0]
    check_index(op, "rows", rows, dev, shape=(B,))
    check_index(op, "new_seq_lens", new_seq_lens, dev, shape=(B,))
    total = check_index(op, "accept_tokens", accept_tokens, dev, ndim=1).shape[0]
    if B and total % B:
        raise ContractError(op, "accept_tokens", f"expected a multiple of B={B} entries, got {total}")
    n = check_int(op, "tree_size", tree_size, minimum=1)
    if live is not None:
        check_index(op, "live", live, dev, shape=(1,))
    if out is not None:
        check_index(op, "out", out, dev, shape=(B * n,))
    if match is not None:
        check_index(op, "match", match, dev, shape=(B,))
    return B, W, total // B if B else 1, n
