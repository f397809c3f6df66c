"""Strict mode checks what every op returns: a backend's bad output raises a ContractError that
names the op and the output at run time; default mode returns it unchecked (no host sync)."""

from __future__ import annotations

import random

import pytest
import torch
from mutants import (AcceptedSentinelIndexWraps, AllocInt32Slots, AttentionFloat32Out, GatherInt32Locs,
                     GreedyNoBonus, TreeInt32Positions)
from ngram_hal_conformance import cases

from ngram_hal import ContractError
from ngram_hal.reference import CpuBackend

# (mutant, op, output named, words of the message)
BAD_OUTPUTS = [
    (AllocInt32Slots, "alloc_extend", "slots", "expected dtype torch.int64, got torch.int32"),
    (GatherInt32Locs, "gather_cache_locs", "locs", "got torch.int32"),
    (AcceptedSentinelIndexWraps, "accepted_kv_moves", "src", "must be -1"),
    (TreeInt32Positions, "reconstruct_tree", "positions", "got torch.int32"),
    (GreedyNoBonus, "verify_tree_greedy", "accept_len", "outside [1, 4)"),
]


def _call(op: str) -> cases.Call:
    return cases.minimal(op, "cpu")


@pytest.mark.parametrize("mutant,op,name,words", BAD_OUTPUTS, ids=[m.__name__ for m, *_ in BAD_OUTPUTS])
def test_strict_names_the_bad_output(mutant, op, name, words):
    with pytest.raises(ContractError) as info:
        _call(op).run(mutant(strict=True))
    err = info.value
    assert (err.op, err.arg, err.output) == (op, name, True)
    assert str(err).startswith(f"{op}: output '{name}': ") and words in str(err)


@pytest.mark.parametrize("mutant,op", [(m, op) for m, op, *_ in BAD_OUTPUTS], ids=[m.__name__ for m, *_ in BAD_OUTPUTS])
def test_default_mode_returns_it_unchecked(mutant, op):
    call = _call(op)
    out = call.run(mutant(strict=False))
    direct = getattr(mutant(), "_" + op)(*call.args.values())
    for got, want in zip(out if isinstance(out, tuple) else (out,), direct if isinstance(direct, tuple) else (direct,)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_accept_index_must_start_at_the_root_and_pad_with_sentinels():
    class Shifted(CpuBackend):
        def _verify_tree_greedy(self, *args):
            predicts, accept_index, accept_len = super()._verify_tree_greedy(*args)
            return predicts, accept_index.roll(1, dims=1), accept_len

    with pytest.raises(ContractError, match="verify_tree_greedy: output .accept_index.: row b must start at its root"):
        _call("verify_tree_greedy").run(Shifted(strict=True))


def test_a_result_of_the_wrong_arity_is_refused():
    class Pair(CpuBackend):
        def _reconstruct_tree(self, tree_mask, seq_lens):
            return super()._reconstruct_tree(tree_mask, seq_lens)[:2]

    with pytest.raises(ContractError, match="reconstruct_tree: output .*expected a tuple .*got a tuple of 2"):
        _call("reconstruct_tree").run(Pair(strict=True))


def test_attention_output_dtype_is_q_dtype():
    call = cases.minimal("attention", "cpu")
    half = call.replace(q=call.args["q"].half(), kv=cases.random_kv(random.Random(0), "cpu", 2, 12, 1, 4, torch.float16))
    with pytest.raises(ContractError, match="attention: output 'out': expected dtype in \\['torch.float16'\\]"):
        half.run(AttentionFloat32Out(strict=True))
    assert half.run(AttentionFloat32Out(strict=False)).dtype == torch.float32
