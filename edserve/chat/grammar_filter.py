"""Grammar-constrained decoding as a logits filter: at every step only the tokens that keep the
output inside a grammar (a JSON schema, for ``response_format``) may be chosen.

The matcher is llguidance's (``LLMatcher``, a maintained Rust library; vLLM and SGLang use it
too): it walks the grammar token by token and gives, per step, a bitmask of the allowed next
tokens. That state lives on the host and follows the tokens the row has actually sampled, so
this filter is the one kind that reads the device at each step: it copies its row's new tokens
to the host (one sync per step while such a row runs; rows without a grammar stay sync-free and
a batch with none keeps its sampling graphs), feeds them to the matcher, and masks every
disallowed token's logit to ``-inf``. When the grammar is complete only the stop tokens are
allowed, so the request ends there.

Life cycle:

* built in the API process with the grammar text and the chat's stop tokens (picklable: that
  is all it carries to an engine process);
* :meth:`GrammarFilter.bind`, called by the engine when the request is validated or added,
  compiles the grammar against the engine's tokenizer (``ValueError`` for a grammar it cannot
  use: a 400 before anything is queued) and starts a fresh matcher;
* :meth:`GrammarFilter.apply`, once per step, one row (a grammar serves a single row: requests
  with beams or ``best_of`` are refused at ``bind``).

The llguidance view of a tokenizer takes ~1 s to build for a 128k vocabulary, so it is built
once per (tokenizer, stop tokens) and kept (:func:`grammar_vocab`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from edserve.engine.logits_filter import FilterContext, LogitsFilter

log = logging.getLogger(__name__)

# New tokens read per step in one copy (a row gains one token a step; more after a retraction
# or an overlapped step, read with a second copy).
_READ = 8


def llguidance():
    """The ``llguidance`` module (ValueError naming the install when missing)."""
    try:
        import llguidance as llg
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError("structured output needs the llguidance package "
                         "(pip install llguidance)") from None
    return llg


@functools.lru_cache(maxsize=8)
def grammar_vocab(tokenizer: Any, stop_ids: tuple[int, ...]) -> Any:
    """llguidance's ``LLTokenizer`` for a ``tokenizers.Tokenizer``: every token's bytes, with
    ``stop_ids`` as the tokens that end the output. Cached (the tokenizer object is the key)."""
    to_str = getattr(tokenizer, "to_str", None)
    if to_str is None:
        raise ValueError(f"structured output needs a tokenizers.Tokenizer, not "
                         f"{type(tokenizer).__name__}")
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    try:
        return llguidance().LLTokenizer(to_str(), n_vocab=n_vocab, eos_token=list(stop_ids))
    except ValueError as exc:
        raise ValueError(f"structured output cannot use this model's tokenizer: {exc}") from None


class GrammarFilter(LogitsFilter):
    """Only tokens that continue ``grammar`` (llguidance's grammar text, e.g. from
    ``LLMatcher.grammar_from_json_schema``); once it is complete, only ``stop_ids``.

    One instance per request (identity equality: it is stateful), so each forms its own
    filter group of one row."""

    def __init__(self, grammar: str, stop_ids: tuple[int, ...]) -> None:
        if not stop_ids:
            raise ValueError("a grammar needs at least one stop token to end the output")
        self.grammar = grammar
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self._matcher: Any = None  # llguidance.LLMatcher, from bind
        self._consumed = 0  # tokens of the row fed to the matcher
        self._words: torch.Tensor | None = None  # [W] int32 host bitmask (pinned on CUDA)
        self._n_words = 0  # W: ceil(tokenizer vocabulary / 32), from bind
        self.failed = ""  # the matcher's error, if the row ever left the grammar

    def __getstate__(self) -> dict:  # the settings travel, the matcher does not
        return {"grammar": self.grammar, "stop_ids": self.stop_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["grammar"], state["stop_ids"])

    def __repr__(self) -> str:
        return f"GrammarFilter({self.grammar[:60]!r}..., stop_ids={self.stop_ids})"

    def bind(self, tokenizer: Any, rows: int) -> None:
        if rows != 1:
            raise ValueError("structured output serves one sequence per request; it cannot be "
                             f"combined with beam search or best_of (got {rows} rows)")
        llg = llguidance()
        vocab = grammar_vocab(tokenizer, self.stop_ids)
        matcher = llg.LLMatcher(vocab, self.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the output format cannot be compiled: {matcher.get_error()}")
        self._matcher, self._consumed, self.failed = matcher, 0, ""
        self._words = None
        self._n_words = (vocab.vocab_size + 31) // 32

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        """logits [1, V]; reads the row's new tokens to the host (a sync)."""
        if self._matcher is None:
            raise RuntimeError("GrammarFilter.apply before bind (the engine binds it when "
                               "the request is added)")
        self._follow(ctx)
        words = self._mask_words(logits.device)
        allowed = _unpack(words.to(logits.device, non_blocking=True), logits.shape[1])
        logits.masked_fill_(~allowed[None, :], float("-inf"))

    # ---- host side ----------------------------------------------------------------------
    def _follow(self, ctx: FilterContext) -> None:
        """Feed the matcher the tokens sampled since the last step (roll back if the row's
        history got shorter)."""
        start = self._consumed
        head = torch.cat((ctx.lengths[:1], ctx.history[0, start:start + _READ])).tolist()
        length, new = head[0], head[1:]
        if length < start:
            self._matcher.rollback(start - length)
            self._consumed = length
            return self._follow(ctx)
        if length - start > len(new):
            new = ctx.history[0, start:length].tolist()
        new = new[:length - start]
        if new and not self.failed:
            if not self._matcher.consume_tokens(new):
                self.failed = self._matcher.get_error() or "token outside the grammar"
                log.warning("grammar-constrained row %s left its grammar: %s; ending it",
                            ctx.rids[0] if ctx.rids else "?", self.failed)
        self._consumed = length

    def _mask_words(self, device: torch.device) -> torch.Tensor:
        """[W] int32: bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed."""
        if self._words is None:  # one buffer per request; the step's sync frees it for reuse
            self._words = torch.zeros(self._n_words, dtype=torch.int32,
                                      pin_memory=device.type == "cuda")
        words = self._words
        if self.failed or self._matcher.is_stopped():
            words.zero_()
            for t in self.stop_ids:
                words[t // 32] |= _bit(t % 32)
            return words
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if not bool(words.any()):  # the vocabulary cannot spell what the grammar needs next
            self.failed = "no token of the vocabulary continues the grammar"
            log.warning("grammar-constrained row: %s; ending it", self.failed)
            return self._mask_words(device)
        return words


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a Python int in int32's range."""
    return -(1 << 31) if i == 31 else 1 << i


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """words [W] int32 -> [vocab] bool (tokens past the mask's end: not allowed)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = ((words[:, None] >> shifts) & 1).reshape(-1).bool()  # [W * 32]
    if bits.numel() >= vocab:
        return bits[:vocab]
    return torch.cat((bits, bits.new_zeros(vocab - bits.numel())))
