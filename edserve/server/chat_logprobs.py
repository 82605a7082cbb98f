"""``logprobs: true`` for ``/v1/chat/completions``: each generated token's log-probability,
in OpenAI's shape (``choices[i].logprobs.content``: ``token``, ``logprob``, ``bytes``,
``top_logprobs``).

The log-probability is the engine's (:attr:`GenerateOutput.logprobs`): the log-softmax of the
model's logits before temperature and top-p (vLLM's default ``raw_logprobs``), after the
request's ``logit_bias`` and penalties (:mod:`edserve.chat.sampling_filters`). With
``top_logprobs: k`` each entry lists the ``k`` most likely tokens at that position, best first,
in the same shape (:attr:`GenerateOutput.top_logprobs`: the sampler's top-k of the same
log-softmax; the chosen token need not be among them when sampling; tokens a grammar rules out
(``-inf``) are not alternatives and are left out, so a list may be shorter), else ``[]``.
``token`` is the token decoded alone (a byte-level piece of a multi-byte character shows as
U+FFFD, as in vLLM) and ``bytes`` the token's own bytes, as OpenAI documents them (that piece,
not U+FFFD's encoding: the entries' bytes join to the text's UTF-8; vLLM encodes ``token``
instead), as the transcription endpoints' entries (:mod:`.transcript_logprobs`). Entries
cover the tokens the response counts as completion tokens: up to the one that completed a stop
string, none after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def entries(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float],
            top: Sequence[Sequence[tuple[int, float]]] = ()) -> list[dict]:
    """One ``logprobs.content`` entry per token (``len(logprobs)`` must match, and so must
    ``len(top)`` unless it is empty: ValueError). ``top``: each token's alternatives."""
    if len(token_ids) != len(logprobs) or (top and len(top) != len(token_ids)):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probabilities and "
                         f"{len(top)} lists of alternatives")
    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        alternatives = [token_entry(tokenizer, a, alp) for a, alp in top[i]
                        if alp > -math.inf] if top else []
        out.append({**token_entry(tokenizer, t, lp), "top_logprobs": alternatives})
    return out


def token_entry(tokenizer: Any, token: int, logprob: float) -> dict:
    """OpenAI's entry for one token: ``token`` (decoded alone), ``logprob``, ``bytes`` (its own,
    ``tokenizer.token_bytes``); the transcription endpoints' entries too."""
    return {"token": tokenizer.decode([token]), "logprob": float(logprob),
            "bytes": list(tokenizer.token_bytes(token))}


def choice_logprobs(content: list[dict] | None) -> dict | None:
    """A choice's ``logprobs`` object (None when the request did not ask for them)."""
    return None if content is None else {"content": content, "refusal": None}
