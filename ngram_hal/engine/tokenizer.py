"""The model's tokenizer, rebuilt from GGUF metadata: byte-level BPE plus the Jinja chat template.

A ``gpt2`` GGUF tokenizer stores its vocabulary already spelled in the byte-to-unicode alphabet and
its merges as ``"left right"`` strings. The pre-tokenizer follows ``tokenizer.ggml.pre``: for
``smollm`` every digit is split off on its own before the usual byte-level split. Tokens the file
marks as control (type 3), such as ``<|im_start|>``, are special tokens matched whole.
"""

from __future__ import annotations

import os

import gguf
import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _BPETokenizer

from .gguf_loader import TokenizerMetadata, find_model_file, read_tokenizer_metadata

CONTROL = 3
USER_DEFINED = 4
# Pre-tokenizers known to split digits one by one before the byte-level regex.
_DIGIT_SPLIT = ("smollm",)


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class Tokenizer:
    """Byte-level BPE tokenizer and chat template of a GGUF model.

    Args:
        meta: the file's tokenizer metadata (``tokenizer.ggml.model`` must be ``gpt2``), e.g.
            ``LlamaModel.tokenizer_metadata`` or the third item :func:`load_gguf` returns.
    """

    def __init__(self, meta: TokenizerMetadata):
        if meta.model != "gpt2":
            raise ValueError(f"tokenizer model {meta.model!r} is not supported (only byte-level BPE, 'gpt2')")
        vocab = {tok: i for i, tok in enumerate(meta.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
        self._tok = _BPETokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        self._tok.pre_tokenizer = _pre_tokenizer(meta.pre)
        self._tok.decoder = decoders.ByteLevel()
        types = meta.token_types or [1] * len(meta.tokens)
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t, kind in zip(meta.tokens, types) if kind == CONTROL])
        self._tok.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t, kind in zip(meta.tokens, types) if kind == USER_DEFINED])
        self.meta = meta
        self.vocab_size = len(meta.tokens)
        self.bos_token_id = meta.bos_token_id
        self.eos_token_id = meta.eos_token_id
        self.pad_token_id = meta.pad_token_id
        self.chat_template = meta.chat_template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(meta.chat_template) if meta.chat_template else None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None) -> "Tokenizer":
        """Read only the metadata of a GGUF file (default: see :func:`find_model_file`)."""
        found = find_model_file(path)
        return cls(read_tokenizer_metadata(gguf.GGUFReader(found), found))

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (``<|im_start|>`` for SmolLM2), or None."""
        return None if self.bos_token_id is None else self.meta.tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text (``<|im_end|>`` for SmolLM2), or None."""
        return None if self.eos_token_id is None else self.meta.tokens[self.eos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        With ``add_special_tokens``, BOS/EOS are added where the file asks for them
        (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``; SmolLM2 asks for neither).
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.meta.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.meta.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 (a multi-byte character cut in two) becomes U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the file's chat template for ``messages`` (``{"role": ..., "content": ...}``)."""
        if self._template is None:
            raise ValueError("this model file has no chat template (tokenizer.chat_template)")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template (no BOS/EOS added beyond what it writes)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)
