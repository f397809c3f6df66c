"""The Triton kernels of ``reconstruct_tree``, ``verify_tree_greedy`` and ``verify_tree_sample``,
run in Triton's interpreter on CPU tensors.

Each op is checked against the reference backend and the conformance suite's oracles on random
trees (BFS and other parent-first orders), under launch configurations that put many requests,
or one, in a program and split the vocabulary into few or many blocks; sampling exactly on dyadic
inputs in float32, float16 and bfloat16. Then inputs that break the contract (links that are no
tree, tokens outside the vocabulary, flat ids out of range, NaN probabilities) must still give
well-formed outputs, read nothing outside the inputs and not depend on the blocking.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")


from ngram_hal.kernels.triton import LaunchConfig, interpreting  # noqa: E402
from ngram_hal.kernels.triton import tree, verify  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal.reference import tree as ref_tree  # noqa: E402
from ngram_hal.reference import verify as ref_verify  # noqa: E402
from ngram_hal_conformance import cases  # noqa: E402
from ngram_hal_conformance import test_tree_verify as conf  # noqa: E402
from ngram_hal_conformance.checks import assert_equal, assert_index_output  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tree_cases import tree_verify_cases  # noqa: E402

DEVICE = "cpu"
pytestmark = pytest.mark.skipif(not interpreting(), reason="checks the kernels on CPU tensors in Triton's interpreter; "
                                                           "on a GPU the conformance suite runs them natively")

CONFIGS = {
    # All the requests of a test in one program: the interpreter's default.
    "batched": LaunchConfig(),
    # One request of 16 nodes per program, as on a GPU, and vocabulary blocks of 64.
    "per-request": LaunchConfig(tile=256, interpreted_tile=256, vocab_block=64),
    # 64-lane wavefronts, a few requests per program, vocabulary blocks of 128.
    "wave64": LaunchConfig(warp_size=64, num_warps=2, max_num_warps=16, tile=1024, interpreted_tile=1024,
                           vocab_block=128),
}
CONFIG_NAMES = sorted(CONFIGS)
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=12, deadline=None)


def assert_same(got, want, what: str) -> None:
    """Tuples of int64 outputs equal entry by entry."""
    assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_index_output(g, w.device, tuple(w.shape), f"{what} output {i}")
        assert_equal(g, w, f"{what} output {i}")


def split(flat: list, B: int, D: int) -> list[list]:
    return [flat[b * D:(b + 1) * D] for b in range(B)]


# ---------------------------------------------------------------- launch configuration

def test_rows_per_program_fills_the_tile_in_powers_of_two():
    cfg = LaunchConfig(tile=256, interpreted_tile=256)
    assert cfg.rows_per_program(64, 256) == 1
    assert cfg.rows_per_program(64, 16) == 16
    assert cfg.rows_per_program(3, 16) == 4
    assert cfg.rows_per_program(64, 1000) == 1
    assert cfg.rows_per_program(0, 4) == 1


# ---------------------------------------------------------------- reconstruct_tree

@SETTINGS
@given(parents=conf.tree_batches(), cfg=st.sampled_from(CONFIG_NAMES), data=st.data())
def test_reconstruct_tree_matches_oracle_and_reference(parents, cfg, data):
    B, D = len(parents), len(parents[0])
    seq_lens = data.draw(st.lists(st.integers(0, 2**40), min_size=B, max_size=B), label="seq_lens")
    mask, seq = conf.mask_of(parents, DEVICE), cases.index(seq_lens, DEVICE)
    got = tree.reconstruct_tree(mask, seq, CONFIGS[cfg])
    assert_same(got, ref_tree.reconstruct_tree(mask, seq), "reconstruct_tree vs reference")
    want = [conf.oracle_tree(p, s) for p, s in zip(parents, seq_lens)]
    assert_equal(got[0], [x for w in want for x in w[0]], "positions")
    assert_equal(got[1], [[b * D + i for i in range(D)] for b in range(B)], "retrieve_index")
    assert_equal(got[2], [w[1] for w in want], "retrieve_next_token")
    assert_equal(got[3], [w[2] for w in want], "retrieve_next_sibling")


@SETTINGS
@given(B=st.integers(1, 6), D=st.integers(1, 12), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31),
       cfg=st.sampled_from(CONFIG_NAMES))
def test_reconstruct_tree_of_any_mask_matches_reference(B, D, density, seed, cfg):
    """A mask that is not a tree (no diagonal, cycles, later ancestors) gives the reference's
    outputs: depth from the row count, parent the deepest marked node (the first on ties)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand((B, D, D), generator=gen) < density
    seq = torch.randint(0, 100, (B,), generator=gen)
    assert_same(tree.reconstruct_tree(mask, seq, CONFIGS[cfg]), ref_tree.reconstruct_tree(mask, seq),
                "reconstruct_tree on a non-tree mask")


# ---------------------------------------------------------------- verify_tree_greedy

@SETTINGS
@given(case=conf.greedy_cases(), cfg=st.sampled_from(CONFIG_NAMES))
def test_verify_tree_greedy_matches_oracle_and_reference(case, cfg):
    parents, tokens, target = case
    B, D = len(parents), len(parents[0])
    candidates, predict = cases.index(tokens, DEVICE).view(B, D), cases.index(target, DEVICE).view(B, D)
    links = conf.links_of(parents, DEVICE)
    got = verify.verify_tree_greedy(candidates, *links, predict, CONFIGS[cfg])
    assert_same(got, ref_verify.verify_tree_greedy(candidates, *links, predict), "greedy vs reference")
    walks = [conf.oracle_greedy(p, t, g) for p, t, g in zip(parents, split(tokens, B, D), split(target, B, D))]
    conf.assert_verify_outputs(got, conf.expected_outputs([w[0] for w in walks], [w[1] for w in walks], D),
                               DEVICE, "greedy")


# ---------------------------------------------------------------- verify_tree_sample

def check_sample(parents, tokens, probs: torch.Tensor, coins: torch.Tensor, final: torch.Tensor, cfg: str) -> None:
    """The kernel against the reference and the oracle, which reads the inputs as float32."""
    B, D = len(parents), len(parents[0])
    candidates, links = cases.index(tokens, DEVICE).view(B, D), conf.links_of(parents, DEVICE)
    got = verify.verify_tree_sample(candidates, *links, probs, coins, final, CONFIGS[cfg])
    assert_same(got, ref_verify.verify_tree_sample(candidates, *links, probs, coins, final), "sample vs reference")
    q, u, f = probs.float().tolist(), coins.float().tolist(), final.float().tolist()
    walks = [conf.oracle_sample(p, t, q[b], u[b], f[b]) for b, (p, t) in enumerate(zip(parents, split(tokens, B, D)))]
    conf.assert_verify_outputs(got, conf.expected_outputs([w[0] for w in walks], [w[1] for w in walks], D),
                               DEVICE, "sample")


@SETTINGS
@given(parents=conf.tree_batches(), vocab=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(FLOATS), cfg=st.sampled_from(CONFIG_NAMES), data=st.data())
def test_verify_tree_sample_matches_oracle_on_dyadic_inputs(parents, vocab, seed, dtype, cfg, data):
    """Multiples of 1/64 are exact in all three dtypes; the coins are rounded to the dtype first
    and the oracle sees the rounded values, so every comparison is exact."""
    B, D = len(parents), len(parents[0])
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=B * D, max_size=B * D), label="tokens")
    probs, coins, final = conf.dyadic_inputs(np.random.default_rng(seed), B, D, vocab)
    check_sample(parents, tokens, conf.floats(probs, DEVICE).to(dtype), conf.floats(coins, DEVICE).to(dtype),
                 conf.floats(final, DEVICE).to(dtype), cfg)


@settings(max_examples=6, deadline=None)
@given(parents=conf.tree_batches(max_batch=4), vocab=st.integers(65, 700), seed=st.integers(0, 2**32 - 1),
       cfg=st.sampled_from(["per-request", "wave64"]))
def test_verify_tree_sample_scans_many_vocabulary_blocks(parents, vocab, seed, cfg):
    """Vocabularies of several blocks, peaked dyadic distributions (multiples of 2**-12) and
    drafts drawn from them, so that children are accepted and rejected and the bonus token's
    block is found from the block sums less the rejected masses."""
    rng = np.random.default_rng(seed)
    B, D = len(parents), len(parents[0])
    units = 2**12
    weights = rng.random((B, D, vocab)) ** 8 * (rng.random((B, D, vocab)) < 0.5)
    weights[..., rng.integers(vocab)] += 1e-3
    counts = np.stack([[rng.multinomial(units, w / w.sum()) for w in row] for row in weights])
    probs = counts / units
    # Each draft is a likely token of its parent's distribution (or any token, one time in four).
    tokens = [0] * (B * D)
    for b, tree_parents in enumerate(parents):
        for j in range(1, D):
            row = probs[b, tree_parents[j]]
            tokens[b * D + j] = int(rng.integers(vocab) if rng.random() < 0.25 else rng.choice(vocab, p=row))
    coins = rng.integers(0, 2**10, size=(B, D)) / 2**10
    final = rng.integers(0, 2**10, size=B) / 2**10
    check_sample(parents, tokens, conf.floats(probs, DEVICE), conf.floats(coins, DEVICE), conf.floats(final, DEVICE), cfg)


# ---------------------------------------------------------------- edge sizes

def single_node_calls(B: int):
    """One-node trees (D = 1) for the three ops, B requests."""
    gen = torch.Generator().manual_seed(B)
    links = {"retrieve_index": torch.arange(B, dtype=torch.int64).view(B, 1),
             "retrieve_next_token": torch.full((B, 1), -1), "retrieve_next_sibling": torch.full((B, 1), -1)}
    candidates = torch.randint(0, 6, (B, 1), generator=gen)
    return {
        "reconstruct_tree": (tree.reconstruct_tree, ref_tree.reconstruct_tree,
                             (torch.ones(B, 1, 1, dtype=torch.bool), torch.randint(0, 50, (B,), generator=gen))),
        "verify_tree_greedy": (verify.verify_tree_greedy, ref_verify.verify_tree_greedy,
                               (candidates, *links.values(), torch.randint(0, 6, (B, 1), generator=gen))),
        "verify_tree_sample": (verify.verify_tree_sample, ref_verify.verify_tree_sample,
                               (candidates, *links.values(), torch.softmax(torch.randn(B, 1, 6, generator=gen), -1),
                                torch.rand((B, 1), generator=gen), torch.rand((B,), generator=gen))),
    }


@pytest.mark.parametrize("B", [0, 1, 5])
@pytest.mark.parametrize("op", ["reconstruct_tree", "verify_tree_greedy", "verify_tree_sample"])
def test_one_node_trees_and_empty_batches(op, B):
    kernel, reference, args = single_node_calls(B)[op]
    for cfg in CONFIGS.values():
        assert_same(kernel(*args, cfg), reference(*args), f"{op} B={B} D=1")


def test_wrappers_refuse_non_contiguous_arguments():
    mask = torch.ones(2, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="reconstruct_tree: argument 'seq_lens' must be contiguous"):
        tree.reconstruct_tree(mask, torch.zeros(2, 2, dtype=torch.int64)[:, 0], LaunchConfig())
    links = conf.links_of([[-1, 0, 0]] * 2, DEVICE)
    probs = torch.full((2, 3, 8), 1 / 8).transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="verify_tree_sample: argument 'target_probs' must be contiguous"):
        verify.verify_tree_sample(torch.zeros(2, 3, dtype=torch.int64), *links, probs, torch.rand(2, 3),
                                  torch.rand(2), LaunchConfig())


# ---------------------------------------------------------------- inputs that break the contract

@st.composite
def broken_inputs(draw):
    """Arguments of both verify ops with links anywhere in [-3, D+3), tokens outside the
    vocabulary (some huge), NaN, infinite and negative probabilities and coins outside [0, 1)."""
    B, D = draw(st.integers(1, 6), label="B"), draw(st.integers(1, 12), label="D")
    V = draw(st.integers(1, 6), label="V")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    tokens = rng.integers(-2, V + 2, size=(B, D))
    tokens[rng.random((B, D)) < 0.1] = 2**40
    probs = rng.random((B, D, V))
    probs[rng.random((B, D, V)) < 0.1] = np.nan
    probs[rng.random((B, D, V)) < 0.1] = -1.0
    probs[rng.random((B, D, V)) < 0.05] = np.inf
    index = torch.arange(B * D, dtype=torch.int64).view(B, D)
    links = [cases.index(rng.integers(-3, D + 3, size=(B, D)).tolist(), DEVICE) for _ in range(2)]
    return {
        "candidates": torch.from_numpy(tokens), "retrieve_index": index,
        "retrieve_next_token": links[0], "retrieve_next_sibling": links[1],
        "target_predict": torch.from_numpy(rng.integers(-2, V + 2, size=(B, D))),
        "target_probs": torch.from_numpy(probs).float(),
        "uniform_samples": torch.from_numpy(rng.random((B, D)) * 2 - 0.5).float(),
        "uniform_final": torch.from_numpy(rng.random(B) * 2 - 0.5).float(),
    }


def run_both(args: dict, cfg: LaunchConfig):
    links = [args[k] for k in ("candidates", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")]
    return (verify.verify_tree_greedy(*links, args["target_predict"], cfg),
            verify.verify_tree_sample(*links, args["target_probs"], args["uniform_samples"], args["uniform_final"],
                                      cfg))


def embedded(t: torch.Tensor, poison) -> torch.Tensor:
    """``t`` copied into the middle of a larger buffer filled with ``poison``: a contiguous view."""
    pad = 64
    buf = torch.full((t.numel() + 2 * pad,), poison, dtype=t.dtype)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view


# NaN probabilities make the interpreter's numpy warn; the kernels must cope, not stay quiet.
NAN_WARNINGS = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning",
                                          "ignore:invalid value encountered:RuntimeWarning")


@NAN_WARNINGS
@SETTINGS
@given(args=broken_inputs())
def test_verify_on_broken_inputs_is_well_formed_and_independent_of_blocking(args):
    B, D = args["candidates"].shape
    V = args["target_probs"].shape[2]
    outputs = {name: run_both(args, cfg) for name, cfg in CONFIGS.items()}
    for name in CONFIG_NAMES[1:]:
        for op, got, want in zip(("greedy", "sample"), outputs[name], outputs[CONFIG_NAMES[0]]):
            assert_same(got, want, f"{op} under {name} vs {CONFIG_NAMES[0]}")
    for op, (predicts, accept_index, accept_len) in zip(("greedy", "sample"), outputs[CONFIG_NAMES[0]]):
        assert_index_output(predicts, DEVICE, (B * D,), f"{op} predicts")
        assert bool(((accept_len >= 1) & (accept_len <= D)).all()), f"{op}: accept_len {accept_len.tolist()}"
        filled = torch.arange(D) < accept_len.unsqueeze(1)
        assert bool((accept_index[~filled] == -1).all()), f"{op}: accept_index not -1 padded"
        owner = accept_index[filled] // D
        assert bool((owner == torch.arange(B).unsqueeze(1).expand(B, D)[filled]).all()), f"{op}: foreign node"
        committed = predicts[accept_index[filled]]
        if op == "sample":
            assert bool(((committed >= 0) & (committed < V)).all()), f"sample committed {committed.tolist()}"


@NAN_WARNINGS
@SETTINGS
@given(args=broken_inputs(), cfg=st.sampled_from(CONFIG_NAMES))
def test_verify_reads_nothing_outside_its_inputs(args, cfg):
    """Each input sits in a buffer whose other entries would change the result if read."""
    poison = {"target_probs": float("nan"), "uniform_samples": -1.0, "uniform_final": float("nan"),
              "retrieve_index": 0}
    boxed = {name: embedded(t, poison.get(name, 1)) for name, t in args.items()}
    for op, got, want in zip(("greedy", "sample"), run_both(boxed, CONFIGS[cfg]), run_both(args, CONFIGS[cfg])):
        assert_same(got, want, f"{op} with poisoned surroundings")


@pytest.mark.parametrize("cfg", CONFIG_NAMES)
def test_verify_skips_flat_ids_out_of_range(cfg):
    """``retrieve_index`` entries outside [0, B*D) are reported in ``accept_index`` but not written."""
    parents = [[-1, 0, 1], [-1, 0, 0]]
    links = conf.links_of(parents, DEVICE)
    index = cases.index([[0, 7, -4], [3, 4, 2**40]], DEVICE)
    candidates = cases.index([[5, 6, 7], [1, 2, 3]], DEVICE)
    predicts, accept_index, accept_len = verify.verify_tree_greedy(
        candidates, index, *links[1:], cases.index([[6, 7, 8], [9, 9, 9]], DEVICE), CONFIGS[cfg])
    assert accept_len.tolist() == [3, 1]
    assert accept_index.tolist() == [[0, 7, -4], [3, -1, -1]]
    assert predicts.tolist() == [6, 0, 0, 9, 0, 0]


# ---------------------------------------------------------------- compiling for GPUs

# Compiles the three kernels with the launches the wrappers choose at B = 64, D = 16, V = 49152
# for a GPU target given on the command line, without a GPU (the interpreter accepts code that
# the compiler may not). Runs in its own process: TRITON_INTERPRET must be unset when the kernel
# modules are imported.
COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ngram_hal.kernels.triton import LaunchConfig, tree, verify

B, D, V = 64, 16, 49152
target, cfg = {"sm90": (GPUTarget("cuda", 90, 32), LaunchConfig()),
               "gfx942": (GPUTarget("hip", "gfx942", 64), LaunchConfig(warp_size=64, max_num_warps=16))}[sys.argv[1]]

def build(kernel, launch, **types):
    constants = {k: v for k, v in launch.items() if k != "num_warps"}
    signature = {n: "constexpr" if n in constants else types.get(n, "*i64") for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if signature[n].startswith("*") or n in ("D", "V")}
    triton.compile(ASTSource(kernel, signature, constants, aligned), target=target,
                   options={"num_warps": launch["num_warps"]})

build(tree.reconstruct_tree_kernel, tree.tree_launch(B, D, cfg), mask_ptr="*u8", B="i32", D="i32")
build(verify.verify_greedy_kernel, verify.greedy_launch(B, D, cfg), B="i32", D="i32")
for dtype in ("fp32", "fp16", "bf16"):
    build(verify.verify_sample_kernel, verify.sample_launch(B, D, V, cfg), probs_ptr="*" + dtype,
          coins_ptr="*fp32", final_ptr="*fp32", B="i32", D="i32", V="i32")
"""


@pytest.mark.parametrize("target, backend", [("sm90", "nvidia"), ("gfx942", "amd")])
def test_kernels_compile_for_gpu_targets(target, backend):
    import triton.backends

    if backend not in triton.backends.backends:
        pytest.skip(f"this Triton has no {backend} backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, target], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------- benchmark cases

@pytest.mark.parametrize("dtype", FLOATS)
def test_benchmark_cases_are_valid_calls_with_accepted_drafts(dtype):
    backend = CpuBackend(strict=True)
    for case in tree_verify_cases(DEVICE, dtype, vocab=512):
        want = case.run(backend)
        kernel = tree.reconstruct_tree if case.op == "reconstruct_tree" else getattr(verify, case.op)
        got = kernel(*case.args.values(), LaunchConfig())
        if case.op == "verify_tree_sample":
            assert case.args["target_probs"].dtype == dtype
            assert got[2].float().mean() > 1, f"{case.name}: no draft accepted"
        else:
            assert_same(got, want, case.name)
        if case.op == "verify_tree_greedy":
            assert want[2].float().mean() > 1, f"{case.name}: no draft accepted"
