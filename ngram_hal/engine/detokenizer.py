"""Incremental detokenization: text that grows token by token without re-decoding the whole output."""

from __future__ import annotations

from typing import Protocol


class TokenDecoder(Protocol):
    """What the engine needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Decodes tokens as they come, holding text back while it ends in an incomplete character.

    Byte-level BPE tokens do not always decode on their own (a multi-byte character can span
    tokens, and a token's leading space depends on its neighbour), so each push decodes a short
    window: the tokens from ``prefix`` on, and reports what that adds beyond the window's
    already-reported part ``prefix:read``.
    """

    def __init__(self, tokenizer: TokenDecoder):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        """Append ``token``; return the text it makes final (possibly empty)."""
        return self.extend((token,))

    def extend(self, tokens) -> str:
        """Append ``tokens`` (ints) at once, decoding the window once rather than once per token;
        return the text they make final (possibly empty)."""
        if not tokens:
            return ""
        self.ids.extend(tokens)
        decode = self.tokenizer.decode
        known = decode(self.ids[self._prefix:self._read])
        full = decode(self.ids[self._prefix:])
        if len(full) <= len(known) or full.endswith("\ufffd"):
            return ""
        delta = full[len(known):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Report whatever is held back (at the end of a request); returns the text added."""
        full = self.tokenizer.decode(self.ids[self._prefix:])
        delta = full[len(self.tokenizer.decode(self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cut the text to ``length`` characters (used when a stop string is found)."""
        self.text = self.text[:length]
