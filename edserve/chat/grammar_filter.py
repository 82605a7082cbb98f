"""Grammar-constrained decoding as a logits filter: at every step only the tokens that keep the
output inside a grammar (a JSON schema, for ``response_format``) may be chosen.

The matcher is llguidance's (``LLMatcher``, a maintained Rust library; vLLM and SGLang use it
too): it walks the grammar token by token and gives, per step, a bitmask of the allowed next
tokens. That state lives on the host and follows the tokens the row has actually sampled, so
this filter is the one kind that reads the device at each step: the rows with a grammar copy
their new tokens to the host together (one sync per step while such rows run: that batch
samples eagerly and the host waits for its step, so overlap gains nothing there; a batch with
no grammar row keeps its sampling graphs and stays sync-free), feed them to their
matchers, get their masks computed in parallel (llguidance's thread pool, one ``[n, W]``
bitmask), and every disallowed token's logit becomes ``-inf`` in one upload and one masked
fill. When a grammar is complete only the stop tokens are allowed, so the request ends there.

Life cycle:

* built in the API process with the grammar text and the chat's stop tokens (picklable: that
  is all it carries to an engine process);
* :meth:`GrammarFilter.bind`, called by the engine when the request is validated or added,
  compiles the grammar against the engine's tokenizer (``ValueError`` for a grammar it cannot
  use: a 400 before anything is queued) and starts a fresh matcher;
* :meth:`GrammarFilter.apply_rows`, once per step for all the batch's grammar rows (the
  sampler groups them: ``per_row``); a grammar serves a single row, so requests with beams or
  ``best_of`` are refused at ``bind``.

The llguidance view of a tokenizer takes ~1 s to build for a 128k vocabulary, so it is built
once per (tokenizer, stop tokens) and kept (:func:`grammar_vocab`). A compiled grammar (~1 ms
for a small JSON schema, more for large ones; a copy ~0.01 ms) is kept too, the last
``_COMPILED_MAX`` by their text (:func:`fresh_matcher`): the server validates a request and the
engine binds it again, and production traffic repeats a few schemas.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from edserve.engine.host_copy import to_device
from edserve.engine.logits_filter import FilterContext, LogitsFilter

log = logging.getLogger(__name__)

# New tokens read per step in one copy (a row gains one token a step; more would be read with a
# second copy).
_READ = 8


def llguidance():
    """The ``llguidance`` module (ValueError naming the install when missing)."""
    try:
        import llguidance as llg
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError("structured output needs the llguidance package "
                         "(pip install llguidance)") from None
    return llg


_VOCAB_LOCK = threading.Lock()  # one build at a time: a second caller waits for the first's


def grammar_vocab(tokenizer: Any, stop_ids: tuple[int, ...]) -> Any:
    """llguidance's ``LLTokenizer`` for a ``tokenizers.Tokenizer``: every token's bytes, with
    ``stop_ids`` as the tokens that end the output. Cached (the tokenizer object is the key);
    concurrent first calls build it once."""
    with _VOCAB_LOCK:
        return _grammar_vocab(tokenizer, stop_ids)


@functools.lru_cache(maxsize=8)
def _grammar_vocab(tokenizer: Any, stop_ids: tuple[int, ...]) -> Any:
    to_str = getattr(tokenizer, "to_str", None)
    if to_str is None:
        raise ValueError(f"structured output needs a tokenizers.Tokenizer, not "
                         f"{type(tokenizer).__name__}")
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    try:
        return llguidance().LLTokenizer(to_str(), n_vocab=n_vocab, eos_token=list(stop_ids))
    except ValueError as exc:
        raise ValueError(f"structured output cannot use this model's tokenizer: {exc}") from None


_COMPILED_MAX = 128
_COMPILED: OrderedDict[tuple[int, str], tuple[Any, Any]] = OrderedDict()  # -> (vocab, matcher)
_COMPILED_LOCK = threading.Lock()


def fresh_matcher(vocab: Any, grammar: str) -> Any:
    """A new ``LLMatcher`` for ``grammar`` at its start, over ``vocab`` (an ``LLTokenizer``):
    a copy of a cached compiled one (least recently used of the last ``_COMPILED_MAX`` dropped
    first). ValueError naming llguidance's message for a grammar it cannot compile (not
    cached: the next request reports it again)."""
    key = (id(vocab), grammar)
    with _COMPILED_LOCK:
        hit = _COMPILED.get(key)
        if hit is not None and hit[0] is vocab:  # the id is the vocabulary's, not a reused one
            _COMPILED.move_to_end(key)
            return hit[1].deep_copy()
    matcher = llguidance().LLMatcher(vocab, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the output format cannot be compiled: {matcher.get_error()}")
    with _COMPILED_LOCK:
        _COMPILED[key] = (vocab, matcher.deep_copy())  # the cached one is never stepped
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return matcher


def warm_vocab(engine: Any) -> threading.Thread | None:
    """For a chat engine: build its grammar vocabulary (:func:`grammar_vocab`) on a daemon
    thread now, so the first structured-output request does not pay ~1 s (at a 128k
    vocabulary) on an engine worker's stepping thread, which validates and binds requests
    between steps. None when the engine is not a chat model; a tokenizer llguidance cannot
    read is left for the first such request to report."""
    if not getattr(engine, "is_mllama", False):
        return None
    from edserve.chat.mllama_chat import ChatTokenizer

    def build() -> None:
        try:
            tok = ChatTokenizer.for_model(engine.model, engine.tokenizer)
            grammar_vocab(tok.tokenizer, tok.stop_token_ids)
        except (ValueError, ImportError) as exc:
            log.debug("grammar vocabulary not prepared: %s", exc)

    thread = threading.Thread(target=build, name="edserve-grammar-vocab", daemon=True)
    thread.start()
    return thread


class GrammarFilter(LogitsFilter):
    """Only tokens that continue ``grammar`` (llguidance's grammar text, e.g. from
    ``LLMatcher.grammar_from_json_schema``); once it is complete, only ``stop_ids``.

    One instance per request (identity equality: it holds the row's matcher); the batch's
    grammar rows are filtered together by :meth:`apply_rows`."""

    per_row = True

    def __init__(self, grammar: str, stop_ids: tuple[int, ...]) -> None:
        if not stop_ids:
            raise ValueError("a grammar needs at least one stop token to end the output")
        self.grammar = grammar
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self._matcher: Any = None  # llguidance.LLMatcher, from bind
        self._consumed = 0  # tokens of the row fed to the matcher
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
        vocab = grammar_vocab(tokenizer, self.stop_ids)
        matcher = fresh_matcher(vocab, self.grammar)
        self._matcher, self._consumed, self.failed = matcher, 0, ""
        self._n_words = (vocab.vocab_size + 31) // 32

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        """One row: ``logits`` [1, V]."""
        type(self).apply_rows([self], logits, ctx)

    @classmethod
    def apply_rows(cls, filters: Sequence[GrammarFilter], logits: torch.Tensor,
                   ctx: FilterContext) -> None:
        """logits [n, V], ``filters[i]`` row ``i``'s; reads the rows' new tokens to the host
        (one sync), then masks in one upload."""
        if any(f._matcher is None for f in filters):
            raise RuntimeError("GrammarFilter.apply before bind (the engine binds it when "
                               "the request is added)")
        widths = {f._n_words for f in filters}
        if len(widths) != 1:
            raise RuntimeError(f"grammar rows bound to different vocabularies: {widths}")
        for f, (length, new) in zip(filters, _new_tokens(filters, ctx), strict=True):
            f._follow(length, new, ctx.rids)
        words = _masks(filters, widths.pop(), logits.device)  # [n, W] host
        banned = _banned(words.to(logits.device, non_blocking=True), logits.shape[1])
        logits.masked_fill_(banned, float("-inf"))

    # ---- host side ----------------------------------------------------------------------
    def _follow(self, length: int, new: list[int], rids: Sequence[str]) -> None:
        """Feed the matcher the row's tokens since the last step. A history that got shorter
        rolls the matcher back (defensive: only beam groups edit histories today, and a
        grammar refuses them)."""
        if length < self._consumed:
            self._matcher.rollback(self._consumed - length)
        elif new and not self.failed and not self._matcher.consume_tokens(new):
            error = self._matcher.get_error() or "token outside the grammar"
            self.failed = error.splitlines()[0][:200]  # the rest is a parser state dump
            log.warning("a grammar-constrained row of %s left its grammar: %s; ending it",
                        ",".join(rids)[:80], self.failed)
        self._consumed = length

    def _live(self) -> bool:
        return not self.failed and not self._matcher.is_stopped()

    def _only_stops(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self.stop_ids:
            row[t // 32] |= _bit(t % 32)


def _new_tokens(filters: Sequence[GrammarFilter], ctx: FilterContext
                ) -> list[tuple[int, list[int]]]:
    """(history length, tokens from the matcher's position to it) per row: one copy of every
    row's length and next ``_READ`` tokens (a second, rare, for a row further behind)."""
    history, device = ctx.history, ctx.history.device  # [n, C]
    starts = to_device([f._consumed for f in filters], torch.int64, device)  # [n]
    cols = (starts[:, None] + torch.arange(_READ, device=device)).clamp(max=history.shape[1] - 1)
    head = torch.cat((ctx.lengths[:, None], history.gather(1, cols)), 1).tolist()  # sync
    out = []
    for i, (f, row) in enumerate(zip(filters, head, strict=True)):
        length, start = row[0], f._consumed
        new = row[1:1 + max(0, length - start)]
        if length - start > _READ:
            new = history[i, start:length].tolist()
        out.append((length, new))
    return out


def _masks(filters: Sequence[GrammarFilter], words: int, device: torch.device) -> torch.Tensor:
    """[n, W] int32 host bitmasks (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed);
    live matchers fill theirs in parallel, the others allow only their stop tokens."""
    out = torch.empty(len(filters), words, dtype=torch.int32,
                      pin_memory=device.type == "cuda")  # pinned: cached by torch, not re-pinned
    live = [(f._matcher, i) for i, f in enumerate(filters) if f._live()]
    if live:
        _executor().unsafe_compute_mask_ptr(live, out.data_ptr(), words * 4, len(filters))
    for i, f in enumerate(filters):
        if f._live() and not bool(out[i].any()):  # nothing in the vocabulary continues it
            f.failed = "no token of the vocabulary continues the grammar"
            log.warning("a grammar-constrained row: %s; ending it", f.failed)
        if not f._live():
            f._only_stops(out[i])
    return out


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool for computing many rows' masks at once (one per process)."""
    return llguidance().LLExecutor()


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a Python int in int32's range."""
    return -(1 << 31) if i == 31 else 1 << i


def _banned(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """words [n, W] int32 (set bit: allowed) -> [n, vocab] bool, True where not allowed
    (tokens past the masks' end included). On the CPU numpy unpacks the bits (~4x faster than
    tensor ops at a 128k vocabulary); on a GPU tensor ops do, after a ~16 KB-per-row upload."""
    unpack = _unpack_numpy if words.device.type == "cpu" else _unpack_torch
    banned = unpack(~words)  # [n, W * 32]
    n, bits = banned.shape
    if bits >= vocab:
        return banned[:, :vocab]
    return torch.cat((banned, banned.new_ones(n, vocab - bits)), 1)


def _unpack_numpy(words: torch.Tensor) -> torch.Tensor:
    """[n, W] int32 on the CPU -> [n, W * 32] bool, bit ``j`` of word ``k`` at ``32k + j``."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def _unpack_torch(words: torch.Tensor) -> torch.Tensor:
    """As :func:`_unpack_numpy`, on any device."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1).bool()
