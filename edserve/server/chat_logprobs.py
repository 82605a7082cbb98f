"""``logprobs: true`` for ``/v1/chat/completions``: each generated token's log-probability,
in OpenAI's shape (``choices[i].logprobs.content``: ``token``, ``logprob``, ``bytes``,
``top_logprobs``).

The log-probability is the engine's (:attr:`GenerateOutput.logprobs`): the log-softmax of the
model's logits before temperature and top-p (vLLM's default ``raw_logprobs``), after the
request's ``logit_bias`` and penalties (:mod:`edserve.chat.sampling_filters`); alternatives
(``top_logprobs`` > 0) are not computed, so ``top_logprobs`` is always ``[]``. ``token`` is the
token decoded alone (a byte-level piece of a multi-byte character shows as U+FFFD, as in vLLM)
and ``bytes`` its UTF-8 encoding. Entries cover the tokens the response counts as completion
tokens: up to the one that completed a stop string, none after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def entries(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[dict]:
    """One ``logprobs.content`` entry per token (``len(logprobs)`` must match: ValueError)."""
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probabilities")
    out = []
    for t, lp in zip(token_ids, logprobs, strict=True):
        text = tokenizer.decode([t])
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": []})
    return out


def choice_logprobs(content: list[dict] | None) -> dict | None:
    """A choice's ``logprobs`` object (None when the request did not ask for them)."""
    return None if content is None else {"content": content, "refusal": None}
