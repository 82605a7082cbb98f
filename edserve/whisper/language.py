"""In-row language detection: the filters that turn one decoder row into detect-then-decode.

A multilingual model given no language decodes its first window from ``[... <|startoftranscript|>]``
(the ``<|startofprev|>`` prefix, if any, stays in front). The row's filter chain is::

    DetectLanguage          step 0: only language tokens may be chosen, and greedily
    ForceTokens(tail)       steps 1..k: the rest of the sot sequence, <|task|> [<|notimestamps|>]
    Shifted(chain, 1 + k)   the window's usual filters, seeing only tokens from step 1 + k on

Step 0's reported log-probability is ``logit - logsumexp(logits over language tokens)``, i.e.
openai-whisper's ``detect_language`` probability (softmax over the language tokens of the
unfiltered logits at ``<|startoftranscript|>``). The encoder runs once: the detected language
and the transcript come from one row, reusing the encoder K/V already in the pool.

Detection is greedy at every temperature (openai-whisper detects with ``argmax`` before it
decodes at any temperature): :class:`DetectLanguage` marks its rows greedy for that step
(``FilterContext.greedy``), so a window sampled at temperature > 0 still gets the most likely
language, with the same probability.

Detecting in the row costs a decoder pass per token of the sot sequence after the prefill
(``<|lang|> <|task|> [<|notimestamps|>]``). A single-row window guesses instead
(:class:`LanguageGuess`: the language detected last, shared by a server's tasks): its prompt is
the guessed language's whole sot sequence, and the prefill checks the guess
(:func:`language_check`, :mod:`edserve.engine.prompt_check`) with the same probabilities. A
right guess decodes on from that prefill; a wrong one ends there, and the window is decoded
again with the detected language, reusing the encoder K/V the engine kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.host_copy import to_device
from edserve.engine.logits_filter import FilterContext, LogitsFilter, filter_cache, vocab_mask
from edserve.engine.prompt_check import PromptCheck
from edserve.tokenizer import WhisperTokenizer
from edserve.whisper.logits import interned

NEG_INF = float("-inf")

# openai-whisper's LANGUAGES (code -> English name), as OpenAI's API reports ``language``.
LANGUAGE_NAMES = dict(zip(
    ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta "
     "no th ur hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk "
     "sq sw gl mr pa si km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb "
     "my bo tl mg as tt haw ln ha ba jw su yue").split(),
    ("english chinese german spanish russian korean french japanese portuguese turkish polish "
     "catalan dutch arabic swedish italian indonesian hindi finnish vietnamese hebrew "
     "ukrainian greek malay czech romanian danish hungarian tamil norwegian thai urdu "
     "croatian bulgarian lithuanian latin maori malayalam welsh slovak telugu persian "
     "latvian bengali serbian azerbaijani slovenian kannada estonian macedonian breton "
     "basque icelandic armenian nepali mongolian bosnian kazakh albanian swahili galician "
     "marathi punjabi sinhala khmer shona yoruba somali afrikaans occitan georgian "
     "belarusian tajik sindhi gujarati amharic yiddish lao uzbek faroese haitian_creole "
     "pashto turkmen nynorsk maltese sanskrit luxembourgish myanmar tibetan tagalog "
     "malagasy assamese tatar hawaiian lingala hausa bashkir javanese sundanese "
     "cantonese").split(), strict=True))


def language_name(code: str) -> str:
    """``"en"`` -> ``"english"`` (OpenAI's ``language`` field); unknown codes stay as they are."""
    return LANGUAGE_NAMES.get(code, code).replace("_", " ")


@dataclass(frozen=True)
class DetectLanguage(LogitsFilter):
    """At sampled position ``at``: forbid every non-language token, choose greedily."""

    ids: tuple[int, ...]  # the language token ids
    at: int = 0
    _masks: dict = filter_cache()

    @classmethod
    def of(cls, tokenizer: WhisperTokenizer) -> DetectLanguage:
        # shared per id set: its device mask is built and uploaded once per model, not once
        # per request (a server detects the language of every request without one)
        return interned(cls, tuple(tokenizer.language_token(c)
                                   for c in tokenizer.all_language_codes))

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        here = ctx.lengths == self.at  # [n]
        keep = vocab_mask(self.ids, logits.shape[-1], logits.device, self._masks)  # [V]
        logits.masked_fill_(here[:, None] & ~keep, NEG_INF)
        if ctx.greedy is not None:
            ctx.greedy |= here


@dataclass(frozen=True)
class ForceTokens(LogitsFilter):
    """At sampled positions ``start .. start + len(tokens) - 1``: only ``tokens[j]`` is allowed
    (its log-probability is then 0)."""

    tokens: tuple[int, ...]
    start: int = 1
    _dev: dict = filter_cache()

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        if not self.tokens:
            return
        forced = self._dev.get(str(logits.device))
        if forced is None:
            forced = self._dev[str(logits.device)] = to_device(self.tokens, torch.int64,
                                                               logits.device)
        j = ctx.lengths - self.start  # [n]
        active = (j >= 0) & (j < len(self.tokens))
        want = forced[j.clamp(0, len(self.tokens) - 1)]  # [n]
        col = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        logits.masked_fill_(active[:, None] & (col != want[:, None]), NEG_INF)


@dataclass(frozen=True)
class Shifted(LogitsFilter):
    """Run ``filters`` as if the row's sampling began at position ``begin`` (HF's
    ``begin_index``): they see ``history[:, begin:]`` and act only on rows that reached it."""

    filters: tuple[LogitsFilter, ...]
    begin: int

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        if not self.filters:
            return
        lengths = (ctx.lengths - self.begin).clamp(min=0)
        history = ctx.history[:, self.begin:]
        if history.shape[1] == 0:  # history narrower than the forced prefix: nothing applies
            return
        inner = FilterContext(history, lengths, ctx.rids)
        edited = logits.clone()
        for f in self.filters:
            f.apply(edited, inner)
        logits.copy_(torch.where((ctx.lengths >= self.begin)[:, None], edited, logits))


def detection_chain(tokenizer: WhisperTokenizer, tail: list[int],
                    filters: list[LogitsFilter]) -> list[LogitsFilter]:
    """The filter chain of a row that detects the language at step 0, then is forced through
    ``tail`` (the sot sequence after the language token), then decodes under ``filters``."""
    return [DetectLanguage.of(tokenizer), interned(ForceTokens, tuple(tail)),  # start 1
            Shifted(tuple(filters), 1 + len(tail))]


class LanguageGuess:
    """The language a detecting window guesses: the last one detected (``initial`` before
    any). One is shared by the tasks of a server or of a run; a plain attribute, so tasks on
    other threads read some recently detected language, which is all a guess needs.
    ``right`` / ``wrong`` count the checked guesses (a wrong one costs the window a second
    prefill: the server exports them as ``edserve_language_guesses_total``)."""

    def __init__(self, initial: str = "en") -> None:
        self.code = initial
        self.right = 0
        self.wrong = 0

    def learn(self, guessed: str, detected: str) -> None:
        """A window guessed ``guessed`` and its prefill detected ``detected``: the next
        windows guess ``detected``."""
        self.code = detected
        if guessed == detected:
            self.right += 1
        else:
            self.wrong += 1


def language_check(tokenizer: WhisperTokenizer, sot_at: int) -> PromptCheck:
    """The prompt check of a guessed language: the language tokens scored at the prompt's
    ``<|startoftranscript|>`` (position ``sot_at``), the guess right after it."""
    return PromptCheck(sot_at, DetectLanguage.of(tokenizer).ids)
