"""A prompt token the caller guessed, checked by the prefill: :class:`PromptCheck`.

Whisper's language detection picks the most likely language token at ``<|startoftranscript|>``
and then decodes after ``<|lang|> <|task|> ...``. Done in the row (``whisper/language.py``),
that is one decoder pass per token of the sot sequence after the prefill. A caller that can
guess the language (most deployments see one language most of the time) puts the guessed
``<|lang|>`` in the prompt and asks the prefill to check it:

- the prefill scores ``choices`` at prompt position ``at`` (the log-softmax of the logits
  there over ``choices`` only: openai-whisper's ``detect_language`` probabilities) and takes
  their argmax, greedily, at every temperature;
- the output carries it as ``GenerateOutput.prompt_check = (token, log-probability)``;
- when the argmax is the prompt's own token at ``at + 1`` the request goes on as usual (its
  first token came from the same prefill); when it is not, the request ends after its prefill
  (``FinishReason.STOP``, no tokens) and keeps its encoder region under a handle
  (``GenerateOutput.encoder_kv``, as ``keep_encoder`` does), so the caller's retry with the
  right token skips the encoder. The caller releases that handle.

Single-row requests only (beam search and best_of start their rows from the prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch

from edserve.engine.host_copy import to_device


@dataclass(frozen=True)
class PromptCheck:
    """Check the prompt's token at ``at + 1``: it must be the argmax of ``choices`` under the
    logits at prompt position ``at``."""

    at: int  # prompt position whose logits score the choices
    choices: tuple[int, ...]  # token ids (Whisper: the language tokens)

    def validate(self, prompt_ids: list[int], group_size: int) -> None:
        """ValueError naming what is wrong (run by ``GenerateRequest.check``)."""
        ok = isinstance(self.at, Integral) and not isinstance(self.at, bool)
        if not ok or not 0 <= self.at < len(prompt_ids) - 1:
            raise ValueError(f"prompt_check.at must be a prompt position in 0.."
                             f"{len(prompt_ids) - 2} (the guess follows it), got {self.at!r}")
        if not isinstance(self.choices, tuple) or not self.choices or not all(
                isinstance(t, Integral) and not isinstance(t, bool) and t >= 0
                for t in self.choices):
            raise ValueError("prompt_check.choices must be a non-empty tuple of token ids")
        if self.guess(prompt_ids) not in self.choices:
            raise ValueError(f"prompt token {self.guess(prompt_ids)} at position {self.at + 1} "
                             "(the guess) is not one of prompt_check.choices")
        if group_size > 1:
            raise ValueError("prompt_check is for single-row requests (beam_size and best_of 1)")

    def guess(self, prompt_ids: list[int]) -> int:
        """The guessed token: the prompt's token after ``at``."""
        return prompt_ids[self.at + 1]


class CheckScorer:
    """Scores prompt checks on the device: ``[P, V]`` logits -> (argmax token, log-prob)
    among each check's choices. The choice lists are uploaded once per distinct list."""

    def __init__(self) -> None:
        self._choices: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

    def score(self, logits: torch.Tensor, checks: list[PromptCheck]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` ``[P, V]``, one row per check -> tokens ``[P]`` int64, log-probs ``[P]``
        float32. Checks with the same choices are scored in one batched op."""
        dev = logits.device
        tokens = torch.empty(len(checks), dtype=torch.int64, device=dev)
        logprobs = torch.empty(len(checks), dtype=torch.float32, device=dev)
        by_choices: dict[tuple[int, ...], list[int]] = {}
        for p, c in enumerate(checks):
            by_choices.setdefault(c.choices, []).append(p)
        for choices, rows in by_choices.items():
            ids = self._ids(choices, dev)  # [C]
            where = to_device(rows, torch.int64, dev)  # [k]
            sub = logits.index_select(0, where).index_select(1, ids).float()  # [k, C]
            best, arg = sub.max(dim=-1)  # [k]
            tokens.index_copy_(0, where, ids[arg])
            logprobs.index_copy_(0, where, best - torch.logsumexp(sub, dim=-1))
        return tokens, logprobs

    def _ids(self, choices: tuple[int, ...], dev: torch.device) -> torch.Tensor:
        key = (choices, str(dev))
        ids = self._choices.get(key)
        if ids is None:
            ids = self._choices[key] = to_device(list(choices), torch.int64, dev)
        return ids
