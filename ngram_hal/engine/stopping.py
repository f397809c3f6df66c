"""Stop conditions, applied to every committed token, in two phases.

A verify step commits a run of tokens at once. :func:`commit_tokens` (token level: cheap, run
as soon as a step's results reach the host) appends them one by one and ends the request at the
first stop token or at ``max_new_tokens``, dropping the rest of the run. :func:`check_stop_strings`
(text level: detokenization, run while the device works on the next step) decodes the new tokens
one by one and ends the request at the first token whose text completes a stop string, which may
span several tokens and several steps; the text is cut before the stop string and the tokens
after that one are dropped.
"""

from __future__ import annotations

from .request import Request


def commit_tokens(req: Request, tokens: list[int], logprobs: list[float] | None) -> int:
    """Append ``tokens`` to ``req`` up to the first stop; returns how many were kept."""
    stop_ids = req.stop_ids
    for j, token in enumerate(tokens):
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs[j])
        if token in stop_ids:
            req.finish("stop")
            return j + 1
        if len(req.output_ids) >= req.max_new_tokens:
            req.finish("length")
            return j + 1
    return len(tokens)


def check_stop_strings(req: Request) -> None:
    """Detokenize the tokens not yet checked, ending the request at the first stop string."""
    detok = req.detok
    if detok is None:
        return
    stops = req.params.stop
    ids = req.output_ids
    if not stops:
        # No string to find: the new tokens are decoded together (a stop token, the last one
        # if any, is not text).
        new = ids[req.checked_tokens:]
        detok.extend(new[:-1] if new and new[-1] in req.stop_ids else new)
    else:
        longest = max(len(s) for s in stops)
        for i in range(req.checked_tokens, len(ids)):
            token = ids[i]
            if token in req.stop_ids:
                continue
            before = len(detok.text)
            detok.push(token)
            if len(detok.text) == before:
                continue
            start = max(0, before - longest + 1)
            hits = [p for p in (detok.text.find(s, start) for s in stops) if p >= 0]
            if hits:
                detok.truncate(min(hits))
                del ids[i + 1:]
                del req.logprobs[i + 1:]
                req.checked_tokens = len(ids)
                req.finish("stop")
                return
    req.checked_tokens = len(ids)
    if req.finished:
        detok.flush()
