"""Engine behaviour on a tiny random Llama (untied head, so its greedy output wanders and loops).

The references are runs of the same engine without speculation and without overlap; every other
configuration must reproduce them token for token, and stop conditions must cut them exactly.
"""

from __future__ import annotations

import pytest
import torch

from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine.engine import Engine, EngineConfig
from ngram_hal.engine.model import LlamaModel
from ngram_hal.engine.request import SamplingParams
from ngram_hal.reference import CpuBackend
from ngram_hal.speculative.drafter import DraftBatch, TrieDrafter

VOCAB = 256


class ByteTokenizer:
    """One token per Latin-1 character: lets stop strings be checked against known token ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    return LlamaModel.random(cfg, CpuBackend(), seed=2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


def make(model, tokenizer=None, **cfg) -> Engine:
    cfg.setdefault("num_slots", 1024)
    cfg.setdefault("max_context_len", 256)
    return Engine(model, tokenizer, EngineConfig(**cfg))


def run_steps(engine: Engine, prompt, params) -> list[list[int]]:
    """The committed runs of one request, one list per step that produced tokens."""
    return [out.new_token_ids for out in engine.stream([prompt], params) if out.new_token_ids]


@pytest.fixture(scope="module")
def reference(model, prompts):
    outs = make(model, tree_size=1, overlap=False).generate(prompts, SamplingParams(max_new_tokens=48, logprobs=True))
    return outs


def assert_all_free(engine: Engine):
    assert engine.sched.slots.available() == engine.sched.slots.num_slots
    assert engine.sched.pool.available() == engine.sched.pool.size
    assert not engine.sched.running and engine.runner.relay.batch_size == 0


@pytest.mark.parametrize("tree_size,drafter,overlap", [
    (1, "trie", True), (4, "trie", False), (8, "trie", True), (8, "linear", True), (16, "trie", False),
    (8, "device", True), (16, "device", False)])
def test_greedy_spec_equals_no_spec(model, prompts, reference, tree_size, drafter, overlap):
    engine = make(model, tree_size=tree_size, drafter=drafter, overlap=overlap)
    _check_against_reference(engine, prompts, reference)
    if tree_size > 1:
        assert engine.stats.tokens_per_step > 1.2


class ShortDrafts(TrieDrafter):
    """A trie drafter whose trees keep at most ``limit`` drafted nodes (the rest is padding)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def draft(self, rids, tree_size):
        batch = super().draft(rids, tree_size)
        drafted = batch.drafted.clamp(max=self.limit)
        B = batch.batch_size
        tokens = batch.tokens.view(B, tree_size).clone()
        mask = batch.tree_mask.clone()
        for b in range(B):
            n = int(drafted[b])
            tokens[b, n:] = tokens[b, 0]
            mask[b, n:] = torch.tril(torch.ones(tree_size, tree_size, dtype=torch.bool))[n:]
            mask[b, n:, 1:n] = False
        return DraftBatch(tokens.view(-1), mask, drafted)


@pytest.mark.parametrize("limit", [1, 3])
def test_steps_run_only_the_drafted_nodes(model, prompts, reference, limit):
    """Padding past the fullest draft of the batch is not run: with nothing drafted a step is a
    plain decode step; with at most 3 drafted nodes a step runs 3 nodes. Output stays exact."""
    engine = Engine(model, None, EngineConfig(tree_size=8, num_slots=1024, max_context_len=256),
                    drafter=lambda: ShortDrafts(limit))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert_all_free(engine)
    if limit == 1:
        assert engine.stats.tree_nodes == engine.stats.decode_steps
    else:
        assert engine.stats.decode_steps < engine.stats.tree_nodes <= limit * engine.stats.decode_steps


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_policy_switches_modes_and_stays_exact(model, prompts, reference, overlap):
    engine = make(model, tree_size=8, overlap=overlap, spec_policy="auto", probe_every=2)
    _check_against_reference(engine, prompts, reference)
    chosen = engine.policy.chosen
    assert chosen[1] > 0 and sum(c for n, c in chosen.items() if n > 1) > 0


def _check_against_reference(engine, prompts, reference):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48, logprobs=True))
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == "length"
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    if engine.tree_size > 1:
        assert sum(o.verify_steps for o in outs) < sum(r.verify_steps for r in reference)
    assert_all_free(engine)


def test_logprobs_are_the_model_distribution(model, prompts, reference):
    # Recompute the log-probability of every committed token with a plain full forward.
    from ngram_hal.engine.model import ForwardBatch

    prompt, out = prompts[1], reference[1]
    seq = prompt + out.token_ids
    n = len(seq)
    locs, r2t = torch.arange(n), torch.arange(n).unsqueeze(0)
    lens = torch.tensor([n])
    logits = model.forward(ForwardBatch(torch.tensor(seq), torch.arange(n), locs, r2t, torch.tensor([0]), lens, lens,
                                        None, n, None), model.new_kv_cache(n))
    lp = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, n - 1), torch.tensor(out.token_ids)]
    torch.testing.assert_close(out.logprobs, lp.tolist(), atol=1e-4, rtol=0)


def _inner_position(runs: list[list[int]], fresh: bool) -> int | None:
    """Index into the output of a token strictly inside an accepted run (of a value not seen before if ``fresh``)."""
    pos, seen = 0, set()
    for run in runs:
        for j, token in enumerate(run):
            if 0 < j < len(run) - 1 and not (fresh and token in seen):
                return pos + j
            seen.add(token)
        pos += len(run)
    return None


def test_stop_token_in_the_middle_of_a_run(model, prompts, reference):
    engine = make(model, tree_size=8)
    params = SamplingParams(max_new_tokens=48)
    for prompt, ref in zip(prompts, reference):
        runs = run_steps(engine, prompt, params)
        assert sum(runs, []) == ref.token_ids
        k = _inner_position(runs, fresh=True)
        if k is None:
            continue
        stop = ref.token_ids[k]
        outs = list(engine.stream([prompt], SamplingParams(max_new_tokens=48, stop_token_ids=(stop,))))
        final = outs[-1]
        assert final.token_ids == ref.token_ids[:k + 1]
        assert final.finish_reason == "stop"
        assert sum((o.new_token_ids for o in outs), []) == final.token_ids
        assert_all_free(engine)
        return
    pytest.fail("no prompt produced an accepted run of 3 tokens")


def test_max_tokens_reached_mid_run(model, prompts, reference):
    engine = make(model, tree_size=8, overlap=True)
    i, k = next((i, k) for i, p in enumerate(prompts)
                if (k := _inner_position(run_steps(engine, p, SamplingParams(max_new_tokens=48)), fresh=False)))
    out = engine.generate([prompts[i]], SamplingParams(max_new_tokens=k + 1, logprobs=True))[0]
    assert out.token_ids == reference[i].token_ids[:k + 1]
    assert len(out.logprobs) == k + 1
    assert out.finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_strings_inside_a_run_and_across_steps(model, prompts, reference, overlap):
    tok = ByteTokenizer()
    engine = make(model, tok, tree_size=8, overlap=overlap)
    prompt, ref = prompts[1], reference[1].token_ids
    runs = run_steps(engine, prompt, SamplingParams(max_new_tokens=48))
    assert sum(runs, []) == ref
    text = tok.decode(ref)
    bounds = [sum(len(r) for r in runs[:i]) for i in range(1, len(runs))]
    inner = [k for k in range(1, len(ref)) if k not in bounds and k - 1 not in bounds]
    across = [k for k in bounds if k >= 1]
    cases = [(k, "inside") for k in inner] + [(k, "across") for k in across]
    checked = set()
    for k, kind in cases:
        stop = text[k - 1:k + 1]
        if kind in checked or text.find(stop) != k - 1:
            continue
        pieces = list(engine.stream([prompt], SamplingParams(max_new_tokens=48, stop=(stop,))))
        out = pieces[-1]
        assert "".join(p.new_text for p in pieces) == out.text
        assert out.finish_reason == "stop", kind
        assert out.token_ids == ref[:k + 1], kind
        assert out.text == text[:k - 1], kind
        checked.add(kind)
    assert checked == {"inside", "across"}
    assert_all_free(engine)


def test_stream_increments_add_up(model, prompts, reference):
    engine = make(model, ByteTokenizer(), tree_size=8)
    outs = list(engine.stream(prompts[:2], SamplingParams(max_new_tokens=48, logprobs=True)))
    for rid_outs, ref in zip(_by_rid(outs), reference):
        assert sum((o.new_token_ids for o in rid_outs), []) == ref.token_ids
        assert "".join(o.new_text for o in rid_outs) == rid_outs[-1].text
        assert sum((o.new_logprobs for o in rid_outs), []) == rid_outs[-1].logprobs
        assert [o.finished for o in rid_outs] == [False] * (len(rid_outs) - 1) + [True]


def _by_rid(outs):
    order = list(dict.fromkeys(o.rid for o in outs))
    return [[o for o in outs if o.rid == rid] for rid in order]


def test_members_finish_at_different_steps(model, prompts, reference):
    engine = make(model, tree_size=8)
    limits = [1, 48, 20, 9]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in limits])
    for out, ref, n in zip(outs, reference, limits):
        assert out.token_ids == ref.token_ids[:n]
        assert out.finish_reason == "length"
    assert len({o.verify_steps for o in outs}) > 2
    assert_all_free(engine)


@pytest.mark.parametrize("tree_size,drafter", [(1, "trie"), (8, "trie"), (8, "device")])
def test_abort_while_its_step_is_in_flight(model, prompts, reference, tree_size, drafter):
    engine = make(model, tree_size=tree_size, overlap=True, drafter=drafter)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts]
    outputs = []
    while not (engine.loop.inflight is not None and engine.loop.inflight.kind == "decode"):
        outputs += engine.step()
    victim = rids[2]
    assert any(r.rid == victim for r in engine.loop.inflight.reqs)
    assert engine.abort(victim)
    assert not engine.abort(victim)
    while engine.has_unfinished():
        outputs += engine.step()
    final = {o.rid: o for o in outputs if o.finished}
    assert final[victim].finish_reason == "abort"
    assert len([o for o in outputs if o.rid == victim and o.finished]) == 1
    for rid, ref in zip(rids, reference):
        if rid != victim:
            assert final[rid].token_ids == ref.token_ids
    assert ref_prefix(final[victim].token_ids, reference[2].token_ids)
    assert_all_free(engine)


def test_pausing_between_any_steps_changes_no_token(model, prompts, reference):
    """``Engine.pause`` (another engine's turn) marks the step in flight as the last of a run, so
    the next step's device time starts afresh; the tokens are those of an engine never paused."""
    engine = make(model, tree_size=8, overlap=True, drafter="device")
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts]
    outputs, marked = [], 0
    while engine.has_unfinished():
        outputs += engine.step()
        engine.pause()
        marked += engine.loop.inflight is not None and engine.loop.inflight.last_of_run
    assert marked > 10
    final = {o.rid: o for o in outputs if o.finished}
    assert [final[rid].token_ids for rid in rids] == [ref.token_ids for ref in reference]
    assert_all_free(engine)


def ref_prefix(a, b):
    return b[:len(a)] == a


@pytest.mark.parametrize("drafter", ["trie", "device"])
def test_slots_exhausted_and_recovered(model, prompts, reference, drafter):
    # Each request needs prompt + 48 + 3*8 slots (77 to 102); 200 slots hold two at a time, so
    # later requests reuse the rows (and, drafting on the device, the token-table rows) of earlier ones.
    engine = make(model, tree_size=8, num_slots=200, drafter=drafter)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts]
    outputs, peak_waiting = [], 0
    while engine.has_unfinished():
        outputs += engine.step()
        if engine.sched.running:
            peak_waiting = max(peak_waiting, len(engine.sched.waiting))
    assert peak_waiting >= 1
    final = {o.rid: o for o in outputs if o.finished}
    for rid, ref in zip(rids, reference):
        assert final[rid].token_ids == ref.token_ids
    assert_all_free(engine)
    again = engine.generate(prompts[:1], SamplingParams(max_new_tokens=48))[0]
    assert again.token_ids == reference[0].token_ids


@pytest.mark.parametrize("page_size", [1, 16, 7])
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_pages_of_any_size_give_the_same_tokens(prompts, reference, page_size, strict):
    """Slots come in pages through the HAL's alloc_extend: with pages of 1, 16 or 7 slots (a
    request fills its last page before taking another) greedy speculation commits the reference
    tokens, each request's slots lie page by page, and every page comes back; a second pass takes
    the pages the first gave back. The cache holds every request at once, so the batches are the
    reference's (the CPU products are row-invariant only up to their kernel's row count)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    backend = CpuBackend(strict=strict)
    engine = make(LlamaModel.random(cfg, backend, seed=2), tree_size=8, num_slots=512, page_size=page_size)
    calls = []
    alloc_extend = backend.alloc_extend
    backend.alloc_extend = lambda *args: calls.append(args[4]) or alloc_extend(*args)
    for _ in range(2):
        rids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts]
        outputs, layouts = [], []
        while engine.has_unfinished():
            outputs += engine.step()
            for r in engine.sched.running:
                # Position p sits at offset p % page_size of the page that holds its page's first position.
                slots, pos = engine.sched.req_to_token[r.row, :r.allocated], torch.arange(r.allocated)
                pages = slots // page_size
                layouts.append(bool((slots % page_size == pos % page_size).all()
                                    and (pages == pages[pos // page_size * page_size]).all()))
        final = {o.rid: o for o in outputs if o.finished}
        assert [final[rid].token_ids for rid in rids] == [r.token_ids for r in reference]
        assert calls and set(calls) == {page_size} and all(layouts)
        assert engine.sched.slots.num_slots == 512 // page_size * page_size
        assert_all_free(engine)


@pytest.mark.parametrize("tree_size", [1, 8])
def test_slots_are_taken_at_admission_only(model, prompts, reference, tree_size):
    """Admission takes each request's whole slot budget in the prefill's one alloc_extend, so no
    decode step allocates (no launch, no upload for slots); continuous batching through two
    seats still commits the reference tokens and every slot comes back."""
    engine = make(model, tree_size=tree_size, max_running=2)
    calls = []
    alloc_extend = engine.backend.alloc_extend
    engine.backend.alloc_extend = lambda *args: calls.append(engine.stats.prefill_steps) or alloc_extend(*args)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=48)) for p in prompts]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        assert all(r.allocated == r.slot_budget for r in engine.sched.running)
    final = {o.rid: o for o in outputs if o.finished}
    assert [final[rid].token_ids for rid in rids] == [r.token_ids for r in reference]
    assert engine.stats.decode_steps > engine.stats.prefill_steps
    # One allocation per prefill, made before that prefill was counted.
    assert calls == list(range(engine.stats.prefill_steps))
    assert_all_free(engine)


def test_request_larger_than_the_cache_fails_alone(model, prompts, reference):
    engine = make(model, tree_size=8, num_slots=100)
    outs = engine.generate([prompts[0], prompts[3], prompts[2]],
                           [SamplingParams(max_new_tokens=48), SamplingParams(max_new_tokens=200),
                            SamplingParams(max_new_tokens=48)])
    assert outs[1].finish_reason == "error" and "KV slots" in outs[1].error
    assert outs[0].token_ids == reference[0].token_ids
    assert outs[2].token_ids == reference[2].token_ids
    assert_all_free(engine)


def test_prompt_longer_than_the_context_fails_alone(model, prompts, reference):
    engine = make(model, tree_size=8, max_context_len=128)
    long_prompt = (prompts[3] * 5)[:120]
    outs = engine.generate([prompts[0], long_prompt, prompts[1]], SamplingParams(max_new_tokens=48))
    assert outs[1].finish_reason == "error"
    assert "does not fit the context" in outs[1].error and outs[1].token_ids == []
    assert outs[0].token_ids == reference[0].token_ids
    assert outs[2].token_ids == reference[1].token_ids
    assert_all_free(engine)


def test_output_is_clamped_to_the_context(model, prompts, reference):
    engine = make(model, tree_size=4, max_context_len=64)
    out = engine.generate([prompts[3]], SamplingParams(max_new_tokens=48))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference[3].token_ids[:64 - 30 - 12]


def test_top_k_one_and_tiny_top_p_sample_the_argmax(model, prompts, reference):
    engine = make(model, tree_size=8)
    for params in (SamplingParams(temperature=1.0, top_k=1, max_new_tokens=48, seed=3),
                   SamplingParams(temperature=0.7, top_p=1e-6, max_new_tokens=48, seed=4)):
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


def test_sampling_is_seeded_and_mixes_with_greedy(model, prompts, reference):
    params = [SamplingParams(temperature=1.0, seed=11, max_new_tokens=32), SamplingParams(max_new_tokens=48)]
    first = make(model, tree_size=8).generate(prompts[:2], params)
    engine = make(model, tree_size=8)
    second = engine.generate(prompts[:2], params)
    assert first[0].token_ids == second[0].token_ids
    assert first[1].token_ids == reference[1].token_ids
    other = engine.generate(prompts[:1], SamplingParams(temperature=1.0, seed=12, max_new_tokens=32))[0]
    assert other.token_ids != first[0].token_ids
    assert all(0 <= t < VOCAB for t in first[0].token_ids)
    assert_all_free(engine)


def test_bad_requests_raise_and_change_nothing(model):
    engine = make(model, tree_size=8)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([1, VOCAB])
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("text without a tokenizer")
    with pytest.raises(ValueError, match="stop"):
        engine.add_request([1, 2], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[1, 2], [3, VOCAB + 5]])
    assert not engine.has_unfinished()
    rid = engine.add_request([1, 2], rid="a")
    with pytest.raises(ValueError, match="rid"):
        engine.add_request([3], rid="a")
    assert list(engine.sched.waiting)[0].rid == rid and len(engine.sched.waiting) == 1
    engine.abort(rid)
    assert engine.step()[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_all_free(engine)


@pytest.mark.parametrize("bad", [
    {"prompt": None}, {"prompt": 7}, {"prompt": [1, 2.5]}, {"params": {"temperature": 0.5}},
    {"params": "greedy"}, {"params": SamplingParams(stop_token_ids=(VOCAB,))}],
    ids=["none-prompt", "int-prompt", "float-token", "dict-params", "str-params", "stop-id-outside"])
def test_any_bad_argument_is_a_value_error_and_admits_nothing(model, bad):
    """A refused request changes nothing: no request is left in the engine, no slot is taken and
    no seed is drawn (the next unseeded sampled requests get what a fresh engine gives them)."""
    engine = make(model, tree_size=4)
    request = {"prompt": [1, 2], "params": None, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        engine.add_request(request["prompt"], request["params"])
    with pytest.raises(ValueError, match="rid: expected a string"):
        engine.add_request([1, 2], rid=12)
    # In a batch, the good requests before and after the bad one are not admitted either.
    good = SamplingParams(temperature=0.7, max_new_tokens=4)
    prompts = [[1, 2], request["prompt"], [3, 4]]
    params = [good, request["params"], good]
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate(prompts, params)
    assert not engine.has_unfinished() and not engine.sched.waiting
    assert_all_free(engine)
    after = engine.generate([[1, 2], [3, 4]], good)
    fresh = make(model, tree_size=4).generate([[1, 2], [3, 4]], good)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh], "a refused request drew a seed"


def test_bad_prompt_lists_and_params_lists_raise(model):
    engine = make(model)
    with pytest.raises(ValueError, match="prompts: expected a list"):
        engine.generate("one text, not a list of prompts")
    with pytest.raises(ValueError, match="params: 1 given for 2"):
        engine.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="params: expected"):
        engine.generate([[1]], {"max_new_tokens": 3})
    assert not engine.has_unfinished()


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-6])
def test_tiny_temperatures_decode_greedily(model, prompts, reference, temperature):
    engine = make(model, tree_size=4)
    outs = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


def test_sampling_params_reject_non_finite_and_negative_values():
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1.0},
                {"top_p": float("nan")}, {"stop_token_ids": (-1,)}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_engine_config_needs_room_for_the_draft_trees():
    with pytest.raises(ValueError, match="tree_size 100000 leaves no room in max_context_len 2048.*at most 682"):
        EngineConfig(tree_size=100000)
    assert EngineConfig(tree_size=682).tree_size == 682
    with pytest.raises(ValueError, match="page_size 64 exceeds num_slots 32"):
        EngineConfig(num_slots=32, page_size=64)


def test_a_page_size_the_backend_does_not_take_is_refused(model):
    backend = CpuBackend()
    backend.page_sizes = [1, 16]  # as a backend whose alloc_extend takes only some sizes lists them
    listing = LlamaModel.random(model.config, backend, seed=2)
    with pytest.raises(ValueError, match="page_size 8: the 'cpu' backend's alloc_extend takes pages of 1, 16"):
        Engine(listing, None, EngineConfig(page_size=8, num_slots=256))
    assert Engine(listing, None, EngineConfig(page_size=16, num_slots=256)).sched.slots.page_size == 16


def test_strict_backend_runs_the_loop(prompts, reference):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=None)
    strict = LlamaModel.random(cfg, CpuBackend(strict=True), seed=2)
    engine = make(strict, tree_size=8, overlap=True, num_slots=200)
    outs = engine.generate(prompts[:2], SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in outs] == [r.token_ids[:24] for r in reference[:2]]
    assert_all_free(engine)


def test_auto_runs_its_one_node_steps_overlapped(model, prompts, reference):
    # When the policy picks one node, the step drafts nothing: it is launched before the host
    # waits for the previous step, as without speculation.
    engine = make(model, tree_size=8, overlap=True, spec_policy="auto")
    engine.policy.peek = engine.policy.choose = lambda bucket, requests, context: 1
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert_all_free(engine)
    assert engine.stats.decode_steps > 1 and engine.stats.critical_decodes <= 1, "only the last may wait"


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_device_drafts_overlap_every_step(model, prompts, reference, policy):
    """Drafted on the device, a speculative step is launched before the host waits for the one
    before it: no decode step's tokens are on the critical path (but the last one's). The drafts
    are the linear drafter's, so a step of 8 nodes commits more than one token on average; the
    sizes ``auto`` picks follow measured times, so there only some step speculates. Each step
    drafts the next one's chains; a separate drafting launch runs only where the batch changed
    (a prefill joined, a request left)."""
    engine = make(model, tree_size=8, overlap=True, drafter="device", spec_policy=policy, probe_every=2)
    assert engine.drafts.ahead
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert_all_free(engine)
    stats = engine.stats
    assert 1 <= engine.drafts.launches <= stats.prefill_steps + len(prompts) < stats.decode_steps
    assert stats.critical_decodes <= 1, "only the last decode step's tokens may be waited for"
    assert stats.tree_nodes > stats.decode_steps, "some step speculated"
    if policy == "always":
        assert engine.stats.tokens_per_step > 1.2


@pytest.mark.parametrize("tree_size", [1, 8])
def test_admission_does_not_wait_for_the_step_in_flight(model, prompts, reference, tree_size):
    """Requests waiting for a seat do not take the overlap away: with two seats for four
    requests, every speculative step drafted on the device is launched before the host waits for
    the one before it, as plain steps are, and the tokens are the reference's."""
    engine = make(model, tree_size=tree_size, overlap=True, drafter="device", max_running=2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert_all_free(engine)
    stats = engine.stats
    assert stats.prefill_steps >= 2, "later requests were admitted as seats freed"
    assert stats.critical_decodes <= 1, "only the last decode step's tokens may be waited for"


def test_device_drafts_sample_and_mix_with_greedy(model, prompts, reference):
    params = [SamplingParams(temperature=1.0, seed=11, max_new_tokens=32), SamplingParams(max_new_tokens=48)]
    first = make(model, tree_size=8, drafter="device").generate(prompts[:2], params)
    engine = make(model, tree_size=8, drafter="device")
    second = engine.generate(prompts[:2], params)
    assert first[0].token_ids == second[0].token_ids and len(first[0].token_ids) == 32
    assert first[1].token_ids == reference[1].token_ids
    assert all(0 <= t < VOCAB for t in first[0].token_ids)
    assert_all_free(engine)


def slow_to_record(base: type) -> type:
    """``base``, a drafter class, busy for its first six queries of ``busy`` (a recording that
    takes time)."""

    class SlowToRecord(base):
        busy_steps = 6

        @property
        def busy(self):
            self.busy_steps -= 1
            return self.busy_steps >= 0

    return SlowToRecord


def sizes_chosen(engine: Engine) -> list[int]:
    """The tree sizes ``engine``'s policy chooses from now on, appended as it chooses them."""
    sizes = []
    choose = engine.policy.choose
    engine.policy.choose = lambda *args: sizes.append(choose(*args)) or sizes[-1]
    return sizes


def test_on_a_host_runtime_auto_waits_for_the_drafters_recording(model, prompts, reference):
    """On the CPU, whose steps would take the cores of a background recording, ``auto`` waits for
    it as ``always`` does: every step is the policy's choice (on a device it runs plain steps
    meanwhile: ``test_engine_gpu.py``). Outputs are exact."""
    from ngram_hal.speculative.drafter import TrieDrafter

    for policy in ("auto", "always"):
        engine = Engine(model, None, EngineConfig(num_slots=1024, max_context_len=256, tree_size=8,
                                                  spec_policy=policy, probe_every=2),
                        drafter=slow_to_record(TrieDrafter))
        sizes = sizes_chosen(engine)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        assert_all_free(engine)
        assert len(sizes) == engine.stats.decode_steps and any(n > 1 for n in sizes)
        if policy == "always":
            assert set(sizes) == {8}


@pytest.mark.parametrize("setting", [
    dict(tree_size=8, spec_policy="always", drafter="trie"),
    dict(tree_size=8, spec_policy="always", drafter="linear"),
    dict(tree_size=8, spec_policy="always", drafter="device"),
    dict(tree_size=8, spec_policy="auto", drafter="trie", probe_every=2),
    dict(tree_size=8, spec_policy="auto", drafter="device", probe_every=2),
    dict(tree_size=8, spec_policy="random sizes", drafter="trie"),
], ids=["always-trie", "always-linear", "always-device", "auto-trie", "auto-device", "random-sizes"])
def test_seeded_sampling_commits_the_same_tokens_whatever_the_speculation(model, prompts, setting):
    """A seeded sampled request commits the tokens plain decoding with the same seed commits, on
    two fresh engines, whatever the drafter, the policy, or sizes changing at random from step to
    step: its random numbers depend on its seed and positions only. Hot requests (temperature
    0.8) sample for real; nearly greedy ones (0.01) loop, so that drafts are accepted."""
    params = [SamplingParams(temperature=0.01 if i % 2 else 0.8, seed=100 + i, max_new_tokens=40)
              for i in range(len(prompts))]
    plain = [o.token_ids for o in make(model, tree_size=1).generate(prompts, params)]
    greedy = [o.token_ids for o in make(model, tree_size=1).generate(prompts, SamplingParams(max_new_tokens=40))]
    assert plain[0] != greedy[0] and plain[2] != greedy[2]
    setting = dict(setting)
    sizes = setting.pop("spec_policy")
    runs, speculated = [], 0
    for attempt in range(2):
        engine = make(model, spec_policy="auto" if sizes == "random sizes" else sizes, **setting)
        if sizes == "random sizes":
            rng = torch.Generator().manual_seed(attempt)
            engine.policy.peek = engine.policy.choose = (
                lambda *args: engine.policy.sizes[int(torch.randint(4, (1,), generator=rng))])
        runs.append([o.token_ids for o in engine.generate(prompts, params)])
        speculated += engine.stats.decode_tokens - engine.stats.decode_rows
        assert_all_free(engine)
    assert runs[0] == runs[1] == plain
    assert speculated > 0, "no draft was accepted: the comparison would not involve speculation"


@pytest.mark.parametrize("drafter, overlap", [("device", True), ("linear", True), ("trie", False)])
def test_auto_scores_the_drafts_of_its_plain_steps(model, prompts, reference, drafter, overlap):
    """Under ``auto`` a plain step still learns from its drafts: each request's first draft
    (drafted on the device anyway, or by a host drafter from the tokens before the step's) is
    compared with the token the step committed, and the request's acceptance record counts it (a
    host drafter's: the record of its match length); the tokens stay exact."""
    _plain_step_hits(model, prompts, reference, drafter, overlap)


def _plain_step_hits(model, prompts, reference, drafter: str, overlap: bool) -> int:
    """Plain steps only under ``auto``: checks as the test above says; the first drafts that hit."""
    engine = make(model, tree_size=8, overlap=overlap, drafter=drafter, spec_policy="auto")
    engine.policy.peek = engine.policy.choose = lambda bucket, requests, context: 1
    records, drop = {}, engine.policy.drop

    def keep(rids):
        records.update({rid: engine.policy.records[rid] for rid in rids if rid in engine.policy.records})
        drop(rids)

    engine.policy.drop = keep
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = engine.stats
    # Every plain step scored every request's first draft (a host drafter's where it matched).
    assert stats.shadow_drafts == stats.decode_rows if drafter == "device" else 0 < stats.shadow_drafts <= stats.decode_rows
    assert 0 < stats.shadow_hits < stats.shadow_drafts, "the loops of the model's greedy output are drafted, not all of it"
    if drafter == "device":
        assert len(records) == len(prompts) and all(sum(a.first) > 0 for a in records.values())
    else:
        assert not records and all(sum(a.first) > 0 for a in engine.policy.by_match[:2])
    assert_all_free(engine)
    return stats.shadow_hits


def test_host_prompt_lookup_scores_its_plain_steps_as_the_device_drafter_does(model, prompts, reference):
    """The linear drafter is the device drafter's prompt lookup on the host: scored from the tokens
    before each plain step's, its first drafts hit exactly as often, so each guess is of the
    position the step committed (with overlap, the step after it is enqueued first)."""
    hits = [_plain_step_hits(model, prompts, reference, drafter, True) for drafter in ("device", "linear")]
    assert hits[0] == hits[1]


def test_prefill_row_counts_compiled_before_serving(model, monkeypatch):
    """The one-time prefills run every row count 2**k - 1 and 2**k up to max_prefill_tokens (the
    counts past one request's room split over requests that one step takes together), and leave
    the engine empty with every slot free."""
    engine = make(model, num_slots=2048, max_context_len=64, max_prefill_tokens=200, max_running=8, tree_size=4)
    rows = []
    forward_argmax = model.forward_argmax

    def counting(batch, kv):
        rows.append(batch.input_ids.shape[0])
        return forward_argmax(batch, kv)

    monkeypatch.setattr(model, "forward_argmax", counting)
    engine.compile_prefill_rows(SamplingParams())
    want = {1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128}
    assert want <= set(rows), sorted(want - set(rows))
    assert max(rows) <= 200
    assert not engine.has_unfinished()
    assert engine.sched.slots.available() == engine.sched.slots.num_slots


@pytest.mark.parametrize("cap,prefills", [(None, 2), ((2, 10**6), 3), ((4, 20), 5)])
def test_admissions_take_what_one_captured_prefill_holds(model, prompts, cap, prefills):
    """One admission takes at most ``Scheduler.prefill_cap``'s requests and prompt tokens (where
    steps are captured, a captured prefill's), the first fill too: with three seats and prompts of
    5, 17, 9, 30 and 9 tokens, the first fill is one prefill and the two that wait until two
    seats free another without a cap; two requests a prefill take the first fill in two; 20 tokens
    a prefill take every prompt alone (the 30-token one alone although it passes the bound). The
    tokens do not change."""
    five = prompts + prompts[2:3]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 10, 10, 40, 40)]
    expected = [o.token_ids for o in make(model, tree_size=1, max_running=3).generate(five, params)]
    engine = make(model, tree_size=1, max_running=3)
    engine.sched.prefill_cap = cap
    assert [o.token_ids for o in engine.generate(five, params)] == expected
    assert engine.stats.prefill_steps == prefills and engine.stats.prefill_s > 0
    assert_all_free(engine)
