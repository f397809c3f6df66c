"""The engine on a GPU through the cuda backend: captured step graphs, bfloat16, the fused model
kernels and the batch-invariant mode. Skipped where no CUDA device is present.

* Replaying captured graphs (decode and verify steps, and padded prefills) gives the
  tokens of eager forwards (batch-invariant mode, where both read the keys in the same fixed
  chunks).
* Greedy with speculation equals greedy without it in the batch-invariant mode, for chain-shaped
  drafts (prompt lookup, on the host or the device) and branching trie trees: each tree node reads
  its path at the positions plain decoding gives it once accepted. So does seeded sampling: a
  verify step draws each node's token from the bits a plain step draws it from.
* Captured steps draft the device drafter's next chains in their graphs, as eager steps do after
  the step.
* After warm-up, a run with graphs makes no hidden host sync.
* The layer kernels launched early (programmatic dependent launch) give the tokens of serial
  launches; the QKV product that rotates and stores K/V, those of the rotary kernel after it.
* Engines taking turns on the device count none of each other's turns as their own idle time or
  step costs.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.graphs import batch_buckets
from ngram_hal.engine.model import LlamaModel
from ngram_hal.engine.request import SamplingParams
from ngram_hal.engine.workload import PromptSpec, run_side_by_side

CUDA = torch.cuda.is_available() and torch.version.cuda is not None
CONFIG = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=6,
                     num_kv_heads=2, head_dim=64, tie_word_embeddings=False, eos_token_id=None,
                     max_position_embeddings=512)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def backend():
    from ngram_hal_cuda import CudaBackend

    return CudaBackend()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 512, (12,), generator=g).tolist()
    return [base * 4, base[:5] * 6 + base, torch.randint(0, 512, (40,), generator=g).tolist(), base * 2]


def _generate(engine, prompts, alone=False):
    """Token ids of ``prompts`` run as one batch, or one after another (each prefilled alone)."""
    params = SamplingParams(max_new_tokens=40)
    outs = [engine.generate([p], params)[0] for p in prompts] if alone else engine.generate(prompts, params)
    return [o.token_ids for o in outs]


def _run(model, prompts, alone=False, **cfg):
    engine = Engine(model, None, EngineConfig(num_slots=4096, max_context_len=512, max_running=8, **cfg))
    return engine, _generate(engine, prompts, alone)


@gpu
@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
def test_graphs_replay_the_eager_forward(backend, prompts, alone):
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=3, batch_invariant=True)
    for tree_size in (1, 4):
        engine, with_graphs = _run(model, prompts, alone, tree_size=tree_size, graphs=True)
        assert engine.graphs is not None and engine.graphs.captures > 0
        # Prompts of 24-48 tokens prefilled alone replay the padded prefills of 32 and 64 tokens;
        # the four prefilled together (154 tokens), the prefill of four requests and 256 tokens.
        assert engine.graphs.prefill_sizes == ([(1, 32), (1, 64)] if alone else [(4, 256)])
        assert engine.sched.prefill_cap == (4, 512), "admissions take what the largest captured prefill holds"
        _, eager = _run(model, prompts, alone, tree_size=tree_size, graphs=False)
        assert with_graphs == eager


@gpu
@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
def test_captured_steps_draft_what_eager_steps_draft(backend, prompts, alone):
    """With the device drafter, a captured step drafts the next step's chains inside its graph; the
    eager steps draft them after the step. In the batch-invariant mode both give the same tokens,
    so the same drafts must be accepted at the same steps."""
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=4, batch_invariant=True)
    runs = {}
    for graphs in (True, False):
        engine, ids = _run(model, prompts, alone, tree_size=8, drafter="device", graphs=graphs)
        runs[graphs] = (ids, engine.stats.decode_steps, engine.stats.decode_tokens)
    assert runs[True] == runs[False]
    assert runs[True][2] > runs[True][1], "the prompts must accept drafts for this test to cover speculation"


@gpu
def test_on_a_device_auto_runs_plain_while_the_drafter_records(backend, prompts):
    """While the drafter still records in the background (a batch of prompts), ``auto`` on a
    device runs plain steps instead of waiting for it, and speculates once it is done; ``always``
    waits. Outputs are exact either way."""
    from test_engine import sizes_chosen, slow_to_record

    from ngram_hal.speculative.drafter import TrieDrafter

    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=5, batch_invariant=True)
    _, want = _run(model, prompts, tree_size=1)
    for policy in ("auto", "always"):
        engine = Engine(model, None, EngineConfig(num_slots=4096, max_context_len=512, max_running=8, tree_size=8,
                                                  spec_policy=policy, probe_every=2),
                        drafter=slow_to_record(TrieDrafter))
        sizes = sizes_chosen(engine)
        assert _generate(engine, prompts) == want
        steps = engine.stats.decode_steps
        if policy == "auto":
            assert len(sizes) < steps and any(n > 1 for n in sizes)
        else:
            assert len(sizes) == steps and set(sizes) == {8}


@gpu
def test_dependent_launch_changes_no_token(backend, prompts):
    """The layer kernels launched early (programmatic dependent launch, on sm_90 and later) wait for
    the kernel before them: captured plain and verify steps give the tokens of serial launches."""
    from ngram_hal_cuda import CudaBackend

    if not backend.launch.pdl:
        pytest.skip("the device predates programmatic dependent launch")
    serial = CudaBackend()
    serial.launch = dataclasses.replace(serial.launch, pdl=False)
    runs = {}
    for b in (backend, serial):
        model = LlamaModel.random(CONFIG, b, dtype=torch.bfloat16, seed=5, batch_invariant=False)
        assert model.kernels.launch.pdl == b.launch.pdl
        runs[b.launch.pdl] = [_run(model, prompts, tree_size=d, drafter="device", graphs=True)[1] for d in (1, 8)]
    assert runs[True] == runs[False]


@gpu
def test_rotating_qkv_product_changes_no_token(backend, prompts):
    """The QKV product that rotates queries and keys and stores K/V itself gives the tokens of the
    product followed by the rotary kernel, in captured plain and verify steps (batch 1 to 4, so
    that every step's QKV runs as a fused product)."""
    from ngram_hal_cuda import CudaBackend

    apart = CudaBackend()
    apart.launch = dataclasses.replace(apart.launch, rope_in_product=False)
    runs = {}
    for b in (backend, apart):
        model = LlamaModel.random(CONFIG, b, dtype=torch.bfloat16, seed=6, batch_invariant=False)
        runs[b.launch.rope_in_product] = [_run(model, prompts, tree_size=d, drafter="device", graphs=True)[1]
                                          for d in (1, 8)]
    assert runs[True] == runs[False]


@pytest.fixture(scope="module")
def long_prompts(prompts):
    """Prompts of 200-400 tokens: their keys fill whole attention splits before a verify step's tree."""
    g = torch.Generator().manual_seed(2)
    return [p * (400 // len(p)) for p in prompts[:3]] + [torch.randint(0, 512, (300,), generator=g).tolist()]


@gpu
@pytest.mark.parametrize("length", ["short", "long"])
@pytest.mark.parametrize("drafter", ["linear", "trie", "device"])
def test_invariant_greedy_speculation_equals_plain(backend, prompts, long_prompts, drafter, length):
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=4, batch_invariant=True)
    prompts = long_prompts if length == "long" else prompts
    _, plain = _run(model, prompts, tree_size=1)
    engine, spec = _run(model, prompts, tree_size=8, drafter=drafter)
    assert engine.stats.tokens_per_step > 1.0, "the prompts must accept drafts for this test to cover speculation"
    assert spec == plain


@gpu
@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
@pytest.mark.parametrize("drafter", ["trie", "device"])
def test_invariant_seeded_sampling_with_speculation_equals_plain(backend, prompts, drafter, alone):
    """Hot requests (temperature 0.8) sample for real; nearly greedy ones (0.01) repeat their
    prompts, so that drafts are accepted. Alone, a plain step samples one row, a verify step many."""
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=4, batch_invariant=True)
    params = [SamplingParams(temperature=0.01 if i % 2 else 0.8, seed=100 + i, max_new_tokens=40)
              for i in range(len(prompts))]

    def run(**cfg):
        engine = Engine(model, None, EngineConfig(num_slots=4096, max_context_len=512, max_running=8, **cfg))
        if alone:
            return engine, [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        return engine, [o.token_ids for o in engine.generate(prompts, params)]

    _, plain = run(tree_size=1)
    engine, spec = run(tree_size=8, spec_policy="always", drafter=drafter)
    assert engine.stats.tokens_per_step > 1.0, "no draft was accepted: the comparison would not involve speculation"
    assert spec == plain


@gpu
@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
@pytest.mark.parametrize("tree_size,drafter", [(1, "trie"), (8, "trie"), (8, "device")])
def test_graph_steps_make_no_hidden_sync(backend, prompts, tree_size, drafter, alone):
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=5, batch_invariant=False)
    engine = Engine(model, None, EngineConfig(num_slots=4096, max_context_len=512, max_running=8,
                                              tree_size=tree_size, spec_policy="always", drafter=drafter))
    _generate(engine, prompts, alone)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = _generate(engine, prompts, alone)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(ids) == 40 for ids in outs)
    assert engine.stats.device_busy_s > 0
    assert engine.sched.slots.available() == engine.sched.slots.num_slots


@gpu
def test_calibration_reads_a_context_and_gives_everything_back(backend, prompts):
    """``auto`` replays every captured size at two contexts before the first request: the request
    table and the KV cache are as a fresh engine has them, every size of every bucket has a cost,
    and greedy output equals an engine that never calibrated."""
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=6, batch_invariant=True)
    cfg = dict(num_slots=4096, max_context_len=512, max_running=8, tree_size=8, drafter="device")
    engine = Engine(model, None, EngineConfig(spec_policy="auto", **cfg))
    assert bool((engine.sched.req_to_token == -1).all())
    assert not engine.kv.k.any() and not engine.kv.v.any()
    table = engine.policy.costs.table(context=128)
    assert sorted(map(int, table)) == engine.graphs.buckets
    assert all(sorted(map(int, sizes)) == [1, 2, 4, 8] and min(sizes.values()) > 0 for sizes in table.values())
    auto = _generate(engine, prompts)
    _, always = _run(model, prompts, tree_size=8, drafter="device", spec_policy="always")
    assert auto == always


@gpu
def test_engines_taking_turns_count_no_idle_time_for_each_others_turns(backend, prompts):
    """Side by side (``run_side_by_side``: the CLI's ``--compare``) each engine drains and pauses at
    the end of its slice while the other runs: those pauses are not the device idling between the
    engine's steps (nor, by the same interval, a step cost for ``auto``). The model is small, so
    its steps are host-bound and much of a run's device time is idle between them anyway; but the
    device's busy and idle time lie within the engine's own slices, where counting the other
    engine's turns (as long again, with slices of 5 ms) would add them on top."""
    model = LlamaModel.random(CONFIG, backend, dtype=torch.bfloat16, seed=7)
    cfg = dict(num_slots=4096, max_context_len=512, max_running=8)
    engines = [(name, Engine(model, None, EngineConfig(**cfg, **extra)))
               for name, extra in (("plain", {}), ("auto", dict(tree_size=8, drafter="device", spec_policy="auto")))]
    for _, engine in engines:
        _generate(engine, prompts)
    specs = [PromptSpec(id=str(i), messages=[{"role": "user", "content": str(i)}]) for i in range(len(prompts))]
    tokenizer = types.SimpleNamespace(encode_chat=lambda messages: prompts[int(messages[0]["content"])])
    results = run_side_by_side(engines, tokenizer, specs, SamplingParams(max_new_tokens=200), slice_s=0.005)
    for result in results:
        totals = result.totals
        assert totals.device_busy_s > 0 and totals.device_busy_s + totals.device_idle_s < 1.25 * totals.decode_s, totals
