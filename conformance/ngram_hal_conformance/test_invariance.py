"""Batch invariance, for a backend that claims it (``capabilities().batch_invariant``): bit for bit,
a row's result does not depend on the rows that share its call.

* ``attention`` with ``batch_invariant=True`` and one ``max_kv_len``: a request's queries give the
  same output alone and in a batch (decodes, extends, prefills and tree verify); a draft-tree
  node's output equals the decode of the same query once its path (its ancestors, then itself) is
  accepted, i.e. its K/V sit right after the prefix. That is what makes speculative decoding give
  exactly the tokens of plain decoding.
* The same for a batch as large as serving reaches (scale tier), which a backend may spread over
  its programs otherwise than a small one.
* The model kernels of ``layer_kernels(..., batch_invariant=True)`` in the engine's dtype for the
  device: rows alone and in calls of more rows, across the row counts where a backend changes tiling.

A backend that does not claim it skips these tests, with the reason in the report.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.model_kernels import default_dtype

from .checks import host
from .test_attention import HEADS, attention_call, kv_dtypes, random_batch, random_parents

rngs = st.randoms(use_true_random=False)
KEYS = 400
"""``max_kv_len`` of every call here: room for prefixes that fill several key splits."""
CONFIG = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=64, tie_word_embeddings=False, eos_token_id=None,
                     max_position_embeddings=512)
"""Products long enough (256 and 512 terms) that a library product sums them in blocks."""


def _claims(backend) -> None:
    caps = backend.capabilities()
    if not caps.batch_invariant:
        pytest.skip(f"backend '{caps.name}' does not claim batch invariance on {caps.device}")


def _invariant(backend, a: dict, **changes) -> torch.Tensor:
    """``attention`` of call arguments ``a`` (with ``changes``) through a batch-invariant layout."""
    a = {**a, **changes, "max_kv_len": KEYS}
    layout = backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"], a["q_lens"],
                                      a["q"].shape[0], a["tree_mask"], KEYS, batch_invariant=True)
    return backend.attention(**a, layout=layout)


def _request(a: dict, b: int, first: int, rows: int) -> dict:
    """The arguments of request b alone: its rows of q (``first .. first + rows - 1``), its table
    row, lengths and tree."""
    one = {"q": a["q"][first:first + rows].contiguous()}
    for name in ("req_pool_indices", "kv_lens", "q_lens", "tree_mask"):
        one[name] = None if a[name] is None else a[name][b:b + 1].contiguous()
    return one


@pytest.mark.conformance(op="attention", tier="semantics")
@given(data=st.data(), rng=rngs, heads=st.sampled_from(HEADS), batch=st.integers(2, 5),
       mode=st.sampled_from(["decode", "mixed", "tree"]))
def test_attention_rows_do_not_depend_on_the_batch(backend, device, data, rng, heads, batch, mode):
    """Each request of a random batch alone gives its rows of the batch's output, bit for bit."""
    _claims(backend)
    dtype = data.draw(st.sampled_from(kv_dtypes(backend)), label="dtype")
    kv_lens, q_lens, trees = random_batch(data, rng, batch, mode, max_keys=KEYS - 8, max_nodes=8, max_queries=24)
    a = attention_call(rng, device, dtype, kv_lens, q_lens, heads=heads, head_dim=16, trees=trees).args
    out = host(_invariant(backend, a))
    first = 0
    for b, n in enumerate(q_lens):
        alone = host(_invariant(backend, a, **_request(a, b, first, n)))
        assert torch.equal(alone, out[first:first + n]), f"{mode} {dtype}: request {b} of {batch} alone differs"
        first += n


@pytest.mark.conformance(op="attention", tier="semantics")
@pytest.mark.parametrize("prefix", [0, 29, 300], ids=["no-prefix", "short-prefix", "long-prefix"])
def test_tree_nodes_equal_the_decode_of_their_path(backend, device, prefix):
    """Two requests verify branching trees after a prefix; each node's output equals the decode of
    its query alone, with its path's K/V moved right after the prefix."""
    _claims(backend)
    parents = [[-1, 0, 0, 1, 2, 1, 3, 4, 6, 7, 5, 8], [-1, 0, 1, 2, 3, 0, 5, 5, 1, 8, 9, 2]]
    D = len(parents[0])
    for dtype in kv_dtypes(backend):
        a = attention_call(random.Random(f"path-{prefix}-{dtype}"), device, dtype, [prefix + D, prefix + 3 + D],
                           [D, D], heads=(6, 2), head_dim=16, trees=parents, extra_cols=8).args
        tree = host(_invariant(backend, a))
        for b in range(2):
            r, start = int(a["req_pool_indices"][b]), int(a["kv_lens"][b]) - D
            for i in range(D):
                path = [i]
                while parents[b][path[-1]] >= 0:
                    path.append(parents[b][path[-1]])
                path.reverse()
                table = a["req_to_token"].clone()
                table[r, start:start + len(path)] = a["req_to_token"][r, [start + j for j in path]]
                one = _request(a, b, b * D + i, 1)
                one.update(req_to_token=table, tree_mask=None, kv_lens=one["kv_lens"] - D + len(path),
                           q_lens=torch.ones_like(one["q_lens"]))
                decode = host(_invariant(backend, a, **one))
                assert torch.equal(decode[0], tree[b * D + i]), (
                    f"{dtype}: request {b} node {i} (path {path}) differs from the decode of its path")


@pytest.mark.conformance(op="attention", tier="scale")
@pytest.mark.parametrize("mode", ["decode", "tree"])
def test_attention_rows_do_not_depend_on_a_large_batch(backend, device, scale, mode):
    """A batch as large as serving reaches (512 requests at ``--scale full``, 6 at ``reduced``),
    which a backend may spread over its programs otherwise than a small one (the cuda backend folds
    the key splits in the attention kernel from a size on, where a small call merges them apart):
    its first, last and a random request alone give their rows of the batch's output, bit for bit.
    Decodes, or 8-node random trees, after prefixes of 150-380 keys: several key splits."""
    _claims(backend)
    batch = 512 if scale == "full" else 6
    nodes = 8 if mode == "tree" else 1
    for dtype in kv_dtypes(backend):
        rng = random.Random(f"large-{mode}-{dtype}")
        kv_lens = [rng.randint(150, 380) + nodes for _ in range(batch)]
        trees = [random_parents(rng, nodes) for _ in range(batch)] if mode == "tree" else None
        a = attention_call(rng, device, dtype, kv_lens, [nodes] * batch, heads=(8, 4), head_dim=16, trees=trees).args
        out = host(_invariant(backend, a))
        for b in sorted({0, batch - 1, rng.randrange(batch)}):
            alone = host(_invariant(backend, a, **_request(a, b, b * nodes, nodes)))
            assert torch.equal(alone, out[b * nodes:(b + 1) * nodes]), (
                f"{mode} {dtype}: request {b} of {batch} alone differs")


def _rows_alone(run, inputs: tuple[torch.Tensor, ...], what: str) -> None:
    """``run(*inputs)`` against ``run`` of the same rows of every input alone (a few single rows,
    and rows 1-3 together)."""
    full = host(run(*inputs))
    rows = inputs[0].shape[0]
    for part in [slice(i, i + 1) for i in range(0, rows, max(1, rows // 5))] + [slice(1, 4)]:
        got = host(run(*(t[part].contiguous() for t in inputs)))
        assert torch.equal(got, full[part]), f"{what}: rows {part.start}..{part.stop - 1} of {rows} differ"


@pytest.mark.conformance(op=None, tier="model")
@pytest.mark.parametrize("rows", [4, 40, 300])
def test_model_kernel_rows_do_not_depend_on_the_batch(backend, rows):
    """``norm`` (with the residual), ``norm_linear``, ``norm_swiglu`` and ``linear_add`` of the
    batch-invariant kernels, in the device's engine dtype: rows alone equal the same rows in a call
    of ``rows`` rows."""
    _claims(backend)
    dtype = default_dtype(backend.device)
    kernels = backend.layer_kernels(CONFIG, dtype, batch_invariant=True)
    gen = torch.Generator().manual_seed(500 + rows)
    dev, cfg = backend.device, CONFIG
    Hd, inter = cfg.hidden_size, cfg.intermediate_size

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=dev)

    x, y, delta = randn(rows, Hd), randn(rows, inter), randn(rows, Hd)
    norm = randn(Hd, scale=0.1) + 1
    _rows_alone(lambda t, d: kernels.norm(t.clone(), norm, d), (x, delta), "norm")
    for what, out in (("norm_linear", cfg.vocab_size), ("norm_swiglu", 2 * inter)):
        kept_norm, weight = kernels.fold_norm(norm, randn(out, Hd, scale=Hd ** -0.5))
        linear = kernels.linear(weight)
        _rows_alone(lambda t, d, f=getattr(kernels, what): f(t.clone(), kept_norm, linear, d), (x, delta), what)
    down = kernels.linear(randn(Hd, inter, scale=inter ** -0.5))

    def linear_add(stream: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        stream = stream.clone()
        pending = kernels.linear_add(t, down, stream)
        return stream if pending is None else stream + pending

    _rows_alone(linear_add, (x, y), "linear_add")
