"""Valid argument sets for the ops: the :class:`Call` type, the helpers builders share, and the
two calls every op registers beside its tests.

A :class:`Call` holds one op's keyword arguments. Builders take an ``rng`` and sizes, so the
same code serves fixed cases (a seeded ``random.Random``) and property tests (hypothesis's
``st.randoms()``, which shrinks). Every index tensor is int64 on ``device``.

Each op's test module registers a small valid call (:func:`minimal_call`, read by the contract
and strict tiers through :func:`minimal`) and a call at a size worth timing (:func:`timed_call`,
read by the performance tier through :func:`timed`), so an added op's cases sit in one module.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ngram_hal.backend import DECLARATIONS
from ngram_hal.declarations import TENSOR_KINDS
from ngram_hal.kv_cache import KVCache

# The tensor arguments of every public method of the HAL, in signature order, by kind: "index"
# (int64), "mask" (bool) or "float"; and those whose size is tied to another argument's (one entry
# short -> ContractError naming it). Both come from the ops' declarations; the keys are method
# names: "attention_layout" is the layout builder of the op "attention" (see OP_OF).
TENSOR_ARGS: dict[str, dict[str, str]] = {
    method: {a.name: a.kind for a in args if a.kind in TENSOR_KINDS}
    for decl in DECLARATIONS for method, args in decl.methods().items()}
TIED_ARGS: dict[str, tuple[str, ...]] = {
    method: tuple(a.name for a in args if a.tied) for decl in DECLARATIONS for method, args in decl.methods().items()}
OP_OF: dict[str, str] = {method: decl.name for decl in DECLARATIONS for method in decl.methods()}
WRITES: dict[str, tuple[str, ...]] = {decl.name: decl.writes for decl in DECLARATIONS}
"""The arguments each op writes in place (every other one is read only)."""
"""The op (a name in ``ngram_hal.backend.OPS``) each method of :data:`TENSOR_ARGS` belongs to."""


@dataclass
class Call:
    """One op's arguments. ``run`` calls it on a backend; ``clone`` deep-copies the tensors and
    the KV cache so that two backends can run the same call on separate state. ``method`` is the
    backend method to call when it is not the op itself (``attention_layout``)."""

    op: str
    args: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    method: str | None = None

    def run(self, backend):
        return getattr(backend, self.method or self.op)(**self.args)

    def replace(self, **changes) -> "Call":
        return Call(self.op, {**self.args, **changes}, self.info, self.method)

    def clone(self) -> "Call":
        return Call(self.op, {k: _clone(v) for k, v in self.args.items()}, self.info, self.method)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor the op could touch: each tensor argument and ``kv.k``/``kv.v``."""
        out = {}
        for name, value in self.args.items():
            if isinstance(value, KVCache):
                out[f"{name}.k"], out[f"{name}.v"] = value.k, value.v
            elif isinstance(value, torch.Tensor):
                out[name] = value
        return out


def clone_kv(kv: KVCache) -> KVCache:
    """A KV cache of the same shape, dtype and device holding a copy of ``kv``'s K and V."""
    copy = KVCache(kv.num_layers, kv.num_slots, kv.num_heads, kv.head_dim, kv.dtype, kv.device)
    copy.k.copy_(kv.k)
    copy.v.copy_(kv.v)
    return copy


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, KVCache):
        return clone_kv(value)
    return value


def index(values, device) -> torch.Tensor:
    """An int64 tensor on ``device``."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def random_kv(rng: random.Random, device, num_layers: int, num_slots: int, num_heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> KVCache:
    """A KV cache whose every row holds distinct random values."""
    kv = KVCache(num_layers, num_slots, num_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen).to(dtype))
    return kv


def random_rows(rng: random.Random, device, n: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    return torch.randn((n, num_heads, head_dim), generator=gen).to(dtype).to(device)


# ---------------------------------------------------------------- the calls each op registers

# Sizes of the timed calls: a decode step of 64 requests with 8-node trees, a 30-layer cache.
TIMED_BATCH, TIMED_NODES, TIMED_CONTEXT = 64, 8, 4096
TIMED_LAYERS, TIMED_SLOTS, TIMED_HEADS, TIMED_HEAD_DIM = 30, 2048, 4, 64

MinimalBuilder = Callable[[random.Random, object, int, torch.dtype], Call]
TimedBuilder = Callable[[random.Random, object, object], "tuple[Call, str]"]
_MINIMAL: dict[str, MinimalBuilder] = {}
_TIMED: dict[str, TimedBuilder] = {}


def minimal_call(method: str):
    """Register the decorated ``builder(rng, device, page_size, dtype) -> Call`` as the small valid
    call of ``method`` (an op, or ``"attention_layout"``)."""
    def mark(builder):
        _MINIMAL[method] = builder
        return builder
    return mark


def timed_call(op: str):
    """Register the decorated ``builder(rng, backend, device) -> (Call, what)`` as the performance
    tier's call of ``op`` (``what``: its size in words)."""
    def mark(builder):
        _TIMED[op] = builder
        return builder
    return mark


def _load_test_modules() -> None:
    """Import every test module of the suite: each registers its ops' calls when imported."""
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if module.name.startswith("test_"):
            importlib.import_module(f"{package}.{module.name}")


def _registered(table: dict, name: str, what: str):
    if name not in table:
        _load_test_modules()
    if name not in table:
        raise ValueError(f"no {what} call registered for {name!r}")
    return table[name]


def minimal(op: str, device, backend=None) -> Call:
    """A small, valid call of ``op`` (every op in ``ngram_hal.backend.OPS``, and
    ``"attention_layout"``, the layout builder of a minimal attention call).

    Given ``backend``, the page size and the KV dtype are ones its capabilities list (4 and
    float32 when it lists them or lists none).
    """
    return _registered(_MINIMAL, op, "minimal")(random.Random(op), device, *supported(backend))


def timed(op: str, backend, device) -> tuple[Call, str]:
    """The performance tier's call of ``op`` on ``backend``, and its size in words."""
    return _registered(_TIMED, op, "timed")(random.Random(op), backend, device)


def registered_ops() -> tuple[set[str], set[str]]:
    """The methods with a minimal call and the ops with a timed call, every test module loaded."""
    _load_test_modules()
    return set(_MINIMAL), set(_TIMED)


def supported(backend) -> tuple[int, torch.dtype]:
    """A page size and a KV dtype ``backend`` lists (4 and float32 where it can, or without one)."""
    if backend is None:
        return 4, torch.float32
    caps = backend.capabilities()
    page_size = 4 if not caps.page_sizes or 4 in caps.page_sizes else caps.page_sizes[0]
    dtype = "float32" if "float32" in caps.kv_dtypes else caps.kv_dtypes[0]
    return page_size, getattr(torch, dtype)




def kv_half_dtype(backend) -> torch.dtype:
    """A half type the backend lists (the usual KV dtype on accelerators), else its first."""
    listed = backend.capabilities().kv_dtypes
    name = next((d for d in ("float16", "bfloat16") if d in listed), listed[0])
    return getattr(torch, name)
