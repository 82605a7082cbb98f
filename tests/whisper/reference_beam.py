"""An independent beam-search oracle: openai-whisper's ``BeamSearchDecoder`` (``update`` +
``finalize``) and ``MaximumLikelihoodRanker``, re-implemented over HF transformers'
``WhisperForConditionalGeneration`` with no self-attention KV cache (the decoder is recomputed in
full at every step, like ``hf_greedy`` in ``tests/whisper_fixtures.py``); only the cross-attention
keys and values of one audio, which do not depend on the tokens, are projected once by HF's own
cache path and shared by every beam and step (:class:`CrossKV`).

The rules kept exactly (openai-whisper ``whisper/decoding.py``):

- per step, each live beam's logits are filtered with that beam's own generated tokens (prompt
  excluded; the per-request filters of ``reference_filters.py``), then ``log_softmax``; the top
  ``beam_size + 1`` tokens of each beam are candidates scored ``beam sum + token logprob``;
- candidates are keyed by their full token sequence (identical sequences collapse) and ranked by
  score, best first; one ending in end-of-text is *finished*, the others become the next beams
  until ``beam_size`` are kept (lower-ranked candidates are not looked at);
- newly finished sequences join the finished list, best first, while it holds fewer than
  ``max_candidates = round(beam_size * patience)``; the search stops when it holds
  ``max_candidates``, or after ``max_new_tokens`` steps;
- finalize: with fewer than ``beam_size`` finished, the live beams (best first, + end-of-text)
  are added until there are ``beam_size``; the result is the first argmax of
  ``sum_logprob / penalty`` with penalty = length (generated tokens, end-of-text excluded) when
  ``length_penalty`` is None, else ``((5 + length) / 6) ** length_penalty``.

Scores are accumulated in float32, as openai-whisper's ``sum_logprobs`` tensor does. The search
starts from ONE beam (the prompt): openai-whisper starts from ``beam_size`` identical copies,
whose candidates collapse into the same dict entries, so the result is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

EOT = 50256
# (generated, logits [V]) -> None, edits in place (see reference_filters.py)
Processor = Callable[[list[int], torch.Tensor], None]


@dataclass
class Hypothesis:
    """One sequence of the search: generated tokens (prompt and end-of-text excluded)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # per generated token
    score: np.float32  # float32 running sum, end-of-text logprob included once finished
    stop_logprob: float | None = None  # end-of-text logprob (None: ended by length)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class BeamResult:
    """The chosen sequence, plus the whole search for diagnosing a mismatch."""

    token_ids: list[int]
    logprobs: list[float]
    stop_logprob: float | None
    sum_logprob: float  # the ranked score (end-of-text logprob included when it stopped)
    finished: list[Hypothesis]  # the finalize candidates, in openai-whisper's dict order
    steps: list[list[Hypothesis]] = field(default_factory=list)  # live beams after each step


def hf_model_from_checkpoint(folder: Path):
    """HF ``WhisperForConditionalGeneration`` (float32) holding an edserve checkpoint's weights
    (as the ``hf_tokens`` fixture of ``tests/engine/test_whisper_e2e.py`` builds it)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from edserve.models.weights import load_checkpoint

    ckpt = load_checkpoint(folder)
    model = WhisperForConditionalGeneration(WhisperConfig(**ckpt.config)).eval()
    model.load_state_dict({k: v.float() for k, v in ckpt.state_dict.items()}, strict=False)
    model.tie_weights()
    return model


@torch.no_grad()
def encode(model, mel: torch.Tensor) -> torch.Tensor:
    """[1, enc_len, d] encoder output of one ``[n_mels, frames]`` mel."""
    return model.model.encoder(mel[None].float()).last_hidden_state


class CrossKV:
    """The cross-attention keys and values of one encoder output, as HF's decoder caches them
    (one decoder call with ``use_cache``): they do not depend on the tokens, so every beam and
    step reads them instead of projecting the encoder output again."""

    @torch.no_grad()
    def __init__(self, model, enc: torch.Tensor):
        cache = model.model.decoder(input_ids=torch.tensor([[EOT]]), encoder_hidden_states=enc,
                                    use_cache=True).cache.cross_attention_cache
        self.enc = enc
        self.kv = [(layer.keys, layer.values) for layer in cache.layers]  # [1, H, T, hd] each
        self._rows: dict[int, object] = {}

    def cache(self, n: int):
        """A fresh ``EncoderDecoderCache`` for ``n`` rows: an empty self-attention cache (the
        decoder recomputes every position) and these cross keys/values repeated per row (HF
        only reads them, so one copy per row count is reused)."""
        from transformers import DynamicCache, EncoderDecoderCache

        if n not in self._rows:
            self._rows[n] = DynamicCache([(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
                                          for k, v in self.kv])
        cache = EncoderDecoderCache(DynamicCache(), self._rows[n])
        assert all(cache.is_updated.values())  # HF reads the cross keys, does not project enc
        return cache


@torch.no_grad()
def next_logprobs(model, enc: torch.Tensor, prompt: Sequence[int],
                  generated: Sequence[Sequence[int]],
                  processors: Sequence[Processor] = (),
                  cross: CrossKV | None = None) -> torch.Tensor:
    """[n, V] ``log_softmax`` of each row's filtered next-token logits; all rows share one
    length, so they run as one batch (full decoder recompute from the encoder output, with no
    self-attention cache; ``cross``: a :class:`CrossKV` of ``enc`` to reuse)."""
    n = len(generated)
    cross = CrossKV(model, enc) if cross is None else cross
    assert cross.enc is enc
    ids = torch.tensor([list(prompt) + list(g) for g in generated])
    hidden = model.model.decoder(input_ids=ids, use_cache=True, cache=cross.cache(n),
                                 encoder_hidden_states=enc.expand(n, -1, -1))
    # the full model's logits, only at the last position (the vocab projection of every
    # position would dominate the cost)
    logits = model.proj_out(hidden.last_hidden_state[:, -1]).float()
    for row, g in zip(logits, generated, strict=True):
        for proc in processors:
            proc(list(g), row)
    return torch.log_softmax(logits, dim=-1)


def _penalized(h: Hypothesis, length_penalty: float | None) -> float:
    penalty = h.length if length_penalty is None else ((5 + h.length) / 6) ** length_penalty
    return float(h.score) / penalty


def reference_beam(model, mel: torch.Tensor, prompt: Sequence[int], *, beam_size: int,
                   max_new_tokens: int, patience: float | None = None,
                   length_penalty: float | None = None,
                   processors: Sequence[Processor] = (), eot: int = EOT,
                   enc: torch.Tensor | None = None) -> BeamResult:
    """openai-whisper beam search of one audio (see the module doc). ``enc``: a precomputed
    :func:`encode` output (else the mel is encoded here)."""
    max_candidates = round(beam_size * (patience or 1.0))
    assert max_candidates > 0
    if enc is None:
        enc = encode(model, mel)
    cross = CrossKV(model, enc)
    beams = [Hypothesis((), (), np.float32(0.0))]
    finished: dict[tuple[int, ...], Hypothesis] = {}
    steps: list[list[Hypothesis]] = []
    for _ in range(max_new_tokens):
        logprobs = next_logprobs(model, enc, prompt, [b.tokens for b in beams], processors,
                                 cross)
        candidates: dict[tuple[int, ...], Hypothesis] = {}
        for beam, row in zip(beams, logprobs, strict=True):
            top_lp, top_tok = row.topk(beam_size + 1)
            for lp, tok in zip(top_lp.tolist(), top_tok.tolist(), strict=True):
                score = np.float32(beam.score + np.float32(lp))
                if tok == eot:
                    cand = Hypothesis(beam.tokens, beam.logprobs, score, stop_logprob=lp)
                else:
                    cand = Hypothesis(beam.tokens + (tok,), beam.logprobs + (lp,), score)
                candidates[beam.tokens + (tok,)] = cand  # the key holds the end-of-text too
        newly_finished: list[tuple[tuple[int, ...], Hypothesis]] = []
        beams = []
        # sorted() is stable: equal scores keep insertion order, as in openai-whisper
        for key in sorted(candidates, key=lambda k: candidates[k].score, reverse=True):
            if key[-1] == eot:
                newly_finished.append((key, candidates[key]))
            else:
                beams.append(candidates[key])
                if len(beams) == beam_size:
                    break
        for key, hyp in newly_finished:  # already best first
            if len(finished) >= max_candidates:
                break
            finished[key] = hyp
        steps.append(list(beams))
        if len(finished) >= max_candidates:
            break
    if len(finished) < beam_size:  # not enough finished: the live beams join, best first
        for beam in sorted(beams, key=lambda b: b.score, reverse=True):
            finished[beam.tokens + (eot,)] = beam
            if len(finished) >= beam_size:
                break
    pool = list(finished.values())
    best = pool[int(np.argmax([_penalized(h, length_penalty) for h in pool]))]
    return BeamResult(list(best.tokens), list(best.logprobs), best.stop_logprob,
                      float(best.score), pool, steps)


def score_tokens(model, enc: torch.Tensor, prompt: Sequence[int], tokens: Sequence[int],
                 processors: Sequence[Processor] = (), eot: int | None = EOT
                 ) -> tuple[list[float], float | None]:
    """Forced decoding: the oracle's per-token logprobs of ``tokens`` (and of end-of-text after
    them when ``eot`` is given), to tell a near-tie from a real divergence."""
    seq = list(tokens) + ([eot] if eot is not None else [])
    lps, cross = [], CrossKV(model, enc)
    for i, tok in enumerate(seq):
        lps.append(float(next_logprobs(model, enc, prompt, [seq[:i]], processors, cross)[0, tok]))
    if eot is None:
        return lps, None
    return lps[:-1], lps[-1]


def explain_mismatch(model, enc: torch.Tensor, prompt: Sequence[int], ours: Sequence[int],
                     ref: BeamResult, processors: Sequence[Processor] = (),
                     decode: Callable[[list[int]], str] | None = None) -> str:
    """A failure message: the first differing position and both sequences' oracle scores."""
    common = min(len(ours), len(ref.token_ids))
    i = next((k for k in range(common) if ours[k] != ref.token_ids[k]), common)
    our_lps, our_eot = score_tokens(model, enc, prompt, ours, processors)
    lines = [f"first difference at generated position {i}: engine {list(ours[i:i + 3])} vs "
             f"oracle {ref.token_ids[i:i + 3]}",
             f"oracle scores: engine's sequence sum={sum(our_lps) + (our_eot or 0.0):.5f} "
             f"(len {len(ours)}), oracle's sum={ref.sum_logprob:.5f} (len {len(ref.token_ids)})",
             "oracle finalize candidates: " + ", ".join(
                 f"len {h.length} score {float(h.score):.5f}" for h in ref.finished)]
    if decode is not None:
        lines += [f"engine: {decode(list(ours))!r}", f"oracle: {decode(ref.token_ids)!r}"]
    return "\n".join(lines)
