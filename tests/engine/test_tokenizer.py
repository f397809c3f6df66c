"""The tokenizer rebuilt from the GGUF metadata: round trips, special tokens, digits, chat
template, and equality with transformers' tokenizer read from the same file."""

from __future__ import annotations

import importlib.util
import random

import pytest

from ngram_hal.engine.gguf_loader import TokenizerMetadata, find_model_file
from ngram_hal.engine.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 3.14159 * 12 = 37.69908; see https://example.org/a?b=c&d=1.",
    "  two leading spaces,\ttabs,\n\nblank lines and trailing   ",
    "naïve café, Größe, 東京タワー, Ελληνικά, emoji 😀👍🏽",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they're done; we'll see what you've got.",
    "<|im_start|>user\nHello!<|im_end|>\n",
    "",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_stay_whole(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[0] == tok.bos_token_id == 1
    assert ids[-1] == tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi"


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids[2:3]) == "3"


def test_no_bos_added(tok):
    """The file sets add_bos_token false: encoding adds nothing."""
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_chat_template(tok):
    text = tok.apply_chat_template(MESSAGES)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert tok.apply_chat_template(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    ids = tok.encode_chat(MESSAGES)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text


def test_rejects_other_tokenizer_models(tok):
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer(TokenizerMetadata(**{**tok.meta.model_dump(), "model": "llama"}))


def test_matches_transformers(tok):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install transformers) to cross-check the tokenizer")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = find_model_file()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
    assert tok.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                      add_generation_prompt=True)


def test_partial_character_decodes_to_replacement(tok):
    """A multi-byte character cut between tokens decodes to U+FFFD until it is complete."""
    ids = tok.encode("😀")
    assert len(ids) > 1
    assert tok.decode(ids[:1]) == "\ufffd" and tok.decode(ids) == "😀"


def test_tokens_detokenized_together_give_the_text_of_one_at_a_time(tok):
    """A verify step's run of tokens is decoded at once (no stop strings to find): the text is the
    one token-by-token pushes give, and the whole decode, multi-byte characters split across
    tokens included (random ids make many)."""
    from ngram_hal.engine.detokenizer import IncrementalDetokenizer

    rng = random.Random(0)
    texts = ["naïve café — «quoted» 日本語 🙂 done", "def f(x):\n    return x  # ✓\n"]
    outputs = [tok.encode(t) for t in texts] + [[rng.randrange(49152) for _ in range(120)] for _ in range(40)]
    for ids in outputs:
        one, runs = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        for t in ids:
            one.push(t)
        i = 0
        while i < len(ids):
            k = rng.randint(1, 9)
            runs.extend(ids[i:i + k])
            assert runs.text == one.text[:len(runs.text)], "text is final once reported"
            i += k
        one.flush()
        runs.flush()
        assert runs.text == one.text == tok.decode(ids)
