"""What callers hand the engine, checked before anything is queued: prompts, sampling
parameters and request ids. Every check raises ``ValueError`` naming the argument (and, for a
list, the index) and changes nothing."""

from __future__ import annotations

from collections.abc import Container, Sequence

from .detokenizer import TokenDecoder
from .request import Request, SamplingParams


def check_request(prompt: str | Sequence[int], params: SamplingParams | None, rid: str | None, *,
                  vocab_size: int, tokenizer: TokenDecoder | None, live: Container[str], label: str = "") -> Request:
    """A validated :class:`Request` for ``prompt`` (text, which needs ``tokenizer``, or token ids
    in ``[0, vocab_size)``), ``params`` (None: the defaults) and ``rid`` (None: one is made; else
    not among the ``live`` ids). ``label`` prefixes every message (``"prompts[3]: "``)."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise ValueError(f"{label}params: expected SamplingParams or None, got {type(params).__name__}")
    if rid is not None and not isinstance(rid, str):
        raise ValueError(f"{label}rid: expected a string or None, got {type(rid).__name__}")
    if rid is not None and rid in live:
        raise ValueError(f"{label}rid: request '{rid}' is still in the engine")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{label}prompt: text prompts need a tokenizer; pass token ids")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise ValueError(f"{label}prompt: expected text or a sequence of token ids, got {type(prompt).__name__}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{label}prompt: token ids must be ints in [0, {vocab_size})")
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"{label}params.stop_token_ids: {outside[0]} is outside the vocabulary [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise ValueError(f"{label}params.stop: stop strings need a tokenizer")
    return Request(ids, params) if rid is None else Request(ids, params, rid=rid)


def params_per_prompt(prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None
                      ) -> list[SamplingParams | None]:
    """One entry of ``params`` per prompt: ``params`` itself for every prompt when it is one
    :class:`SamplingParams` or None, else the list, which must be as long as ``prompts``."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
    if params is None or isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if not isinstance(params, Sequence):
        raise ValueError(f"params: expected SamplingParams, a list of them or None, got {type(params).__name__}")
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
    return list(params)
