"""The pinned contract every backend honours.

* Every index-like tensor (slot locations, request-pool indices, positions, lengths, tree
  retrieve indices, accept index and lengths, token ids, the ``req_to_token`` table) is
  ``torch.int64``, contiguous and on the backend's device, in and out. Masks are ``torch.bool``.
* ``SENTINEL`` (-1) means "no entry"; ops skip sentinel entries.
* A wrong dtype, device, rank or shape raises :class:`ContractError` naming the op and the
  argument before any kernel runs. The ``check_*`` helpers read tensor metadata only (no host
  sync). The ``value_*`` helpers read data and run only in strict mode.
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
    """An argument broke the contract. ``op`` and ``arg`` name where."""

    def __init__(self, op: str, arg: str, message: str):
        self.op = op
        self.arg = arg
        super().__init__(f"{op}: argument '{arg}': {message}")


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


def _tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ContractError(op, name, f"expected a torch.Tensor, got {type(t).__name__}")
    return t


def _shape(op: str, name: str, t: torch.Tensor, ndim: int | None, shape: Sequence[int | None] | None):
    if ndim is not None and t.dim() != ndim:
        raise ContractError(op, name, f"expected rank {ndim}, got rank {t.dim()} (shape {tuple(t.shape)})")
    if shape is not None:
        if t.dim() != len(shape):
            raise ContractError(op, name, f"expected rank {len(shape)}, got shape {tuple(t.shape)}")
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ContractError(
                    op, name, f"expected shape {tuple('*' if s is None else s for s in shape)}, "
                    f"got {tuple(t.shape)} (axis {axis})")


def _place(op: str, name: str, t: torch.Tensor, device: torch.device):
    if not same_device(t.device, device):
        raise ContractError(op, name, f"expected a tensor on {device}, got one on {t.device}")
    if not t.is_contiguous():
        raise ContractError(op, name, "expected a contiguous tensor")


def check_index(op: str, name: str, t, device: torch.device, ndim: int | None = None,
                shape: Sequence[int | None] | None = None) -> torch.Tensor:
    """An index-like tensor: int64, contiguous, on ``device``, of the given rank/shape."""
    t = _tensor(op, name, t)
    if t.dtype != INDEX_DTYPE:
        raise ContractError(op, name, f"expected dtype torch.int64, got {t.dtype} (no implicit casts)")
    _shape(op, name, t, ndim, shape)
    _place(op, name, t, device)
    return t


def check_mask(op: str, name: str, t, device: torch.device, ndim: int | None = None,
               shape: Sequence[int | None] | None = None) -> torch.Tensor:
    """A mask: bool, contiguous, on ``device``."""
    t = _tensor(op, name, t)
    if t.dtype != MASK_DTYPE:
        raise ContractError(op, name, f"expected dtype torch.bool, got {t.dtype}")
    _shape(op, name, t, ndim, shape)
    _place(op, name, t, device)
    return t


def check_float(op: str, name: str, t, device: torch.device, ndim: int | None = None,
                shape: Sequence[int | None] | None = None,
                dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> torch.Tensor:
    """A floating tensor of one of ``dtypes``, contiguous, on ``device``."""
    t = _tensor(op, name, t)
    if t.dtype not in dtypes:
        raise ContractError(op, name, f"expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    _shape(op, name, t, ndim, shape)
    _place(op, name, t, device)
    return t


def check_int(op: str, name: str, value, minimum: int = 0) -> int:
    """A host-side Python integer argument (never a tensor: reading one would sync)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(op, name, f"expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ContractError(op, name, f"expected a value >= {minimum}, got {value}")
    return value


# Value checks: these read data (a host sync on accelerators) and run only in strict mode.

def value_range(op: str, name: str, t: torch.Tensor, low: int, high: int, allow_sentinel: bool = True):
    """Every entry in ``[low, high)``, or ``SENTINEL`` where allowed."""
    if t.numel() == 0:
        return
    bad = (t < low) | (t >= high)
    if allow_sentinel:
        bad &= t != SENTINEL
    if bool(bad.any()):
        first = t[bad][0].item()
        allowed = " or -1" if allow_sentinel else ""
        raise ContractError(op, name, f"value {first} outside [{low}, {high}){allowed}")


def value_distinct(op: str, name: str, t: torch.Tensor, ignore_sentinel: bool = True):
    """No entry repeated (sentinels excepted)."""
    vals = t[t != SENTINEL] if ignore_sentinel else t.reshape(-1)
    if vals.numel() != torch.unique(vals).numel():
        raise ContractError(op, name, "entries must be distinct")


def value_equal(op: str, name: str, got: int, want: int, what: str):
    """A data-derived count that must match a host-side one."""
    if got != want:
        raise ContractError(op, name, f"{what}: expected {want}, got {got}")


def value_tree_mask(op: str, name: str, mask: torch.Tensor):
    """``mask[b]`` encodes a BFS-ordered tree rooted at node 0.

    Node i sees itself; node 0 sees only itself; every other node i has exactly one parent p < i
    (its deepest ancestor) and sees exactly the nodes its parent sees plus itself.
    """
    if mask.numel() == 0:
        return
    B, D, _ = mask.shape
    eye = torch.eye(D, dtype=torch.bool, device=mask.device).expand(B, D, D)
    if not bool(mask[eye].all()):
        raise ContractError(op, name, "every node must see itself (diagonal must be true)")
    if bool(torch.triu(mask, diagonal=1).any()):
        raise ContractError(op, name, "a node may only see nodes before it (BFS order: parent < child)")
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
