"""openai-whisper's sequential long-form algorithm, as a state machine per audio.

A :class:`LongformTask` walks one audio in 30 s windows. The caller (a driver) asks it for the
next engine request, runs it, and feeds the output back; many tasks can be driven at once so
windows of different audios share the engine's continuous batch. The log-mel of the whole audio
plus 30 s of zero samples is computed once (openai-whisper's ``transcribe``); each window is a
slice of it, and a window shorter than 30 s is completed with the silence's frames or with zeros
(``options.mel_padding``, :func:`~edserve.audio.mel.window_features`). Per window:

- the prompt is ``[<|startofprev|> previous text tokens] + <|startoftranscript|> ...`` (with
  timestamps), conditioning on what the previous windows said;
- the window is decoded at the first temperature; if its compression ratio is too high
  (repetition) or its average log-probability too low it is decoded again at the next
  temperature (fallback);
- a window judged silent (``no_speech_prob`` high *and* low log-probability) is skipped
  (both rules: :mod:`edserve.whisper.window_quality`);
- otherwise it is cut into segments at pairs of timestamp tokens and the next window starts at
  the last complete timestamp (or at the window's end when the text ended with a timestamp).

With ``word_timestamps`` each window's request asks for an
:class:`~edserve.whisper.cross_weights.AlignmentReadout` (a request field, not a callback, so it
works with the engine in a worker process): on the engine thread, before the row is freed, the
alignment heads' cross-attention weights for ``sot sequence + <|notimestamps|> + the segments'
text tokens + <|endoftext|>`` are read from the encoder K/V still in the pool (no second
encoder pass) and come back on the CPU in the output's ``readout``;
:meth:`LongformTask.feed` turns them into words
(:mod:`edserve.whisper.words`). Segment times then follow the words and, when the window was
decoded with timestamps and did not end on a single timestamp, the next window starts at the
last word's end (openai-whisper's rule). Without timestamps (a clip of one window) the window
is consumed whole.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edserve.audio.held_mel import HeldMel
from edserve.audio.mel import N_FRAMES, SAMPLE_RATE, window_features
from edserve.audio.prepare import PreparedAudio, longform_compact_mel
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import EncoderKV, FinishReason, GenerateRequest, SamplingParams
from edserve.tokenizer import WhisperTokenizer
from edserve.whisper.cross_weights import AlignmentReadout
from edserve.whisper.language import LanguageGuess, detection_chain, language_check
from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.result import Segment, Transcription, join_text
from edserve.whisper.window_quality import WindowScore
from edserve.whisper.window_segments import (  # noqa: F401 (INPUT_STRIDE: re-exported)
    INPUT_STRIDE,
    TIME_PRECISION,
    place_words,
    split_window,
)


class LongformTask:
    """Sequential transcription of one audio; drive with :meth:`next_request` / :meth:`feed`.

    ``audio``: ``[num_samples]`` float32 at 16 kHz, or its :class:`PreparedAudio` (the same
    log-mel, computed elsewhere: the server's audio workers). ``max_decoder_len``: the
    model's decoder positions (448 for Whisper). ``aligner``: an
    :class:`~edserve.whisper.cross_weights.Aligner` (its ``heads`` go into each window's
    alignment readout), required when ``options.word_timestamps``.
    The task is done when :meth:`next_request` returns None; :meth:`result` then holds the
    transcription.
    """

    def __init__(self, audio: np.ndarray | PreparedAudio, tokenizer: WhisperTokenizer, n_mels: int,
                 options: TranscribeOptions, max_decoder_len: int = 448,
                 source: str = "", aligner: Any = None, reuse_encoder: bool = False,
                 language_guess: LanguageGuess | None = None) -> None:
        if options.word_timestamps and aligner is None:
            raise ValueError("word_timestamps needs an aligner (see whisper.transcribe.make_task)")
        self.aligner = aligner
        # reuse_encoder: a window's first request keeps its encoder KV (a handle in its
        # output) so fallback retries skip the encoder; they still carry the window (sent only
        # if the handle's worker restarted: dp/client.py _route). Handles come back through
        # :meth:`take_released` for the driver to release.
        self.reuse_encoder = reuse_encoder
        # a single-row detecting window guesses this language (language.py; needs handles)
        self.guess = language_guess if reuse_encoder else None
        self._guessed: str | None = None  # the language the last request guessed
        self._held: EncoderKV | None = None
        self._released: list[EncoderKV] = []
        self._last_speech = 0.0
        self.tok = tokenizer
        self.opts = options
        self.source = source
        if isinstance(audio, PreparedAudio):
            if audio.n_mels != n_mels:
                raise ValueError(f"prepared audio has {audio.n_mels} mel bins, the model "
                                 f"takes {n_mels}")
            num_samples, mel = audio.num_samples, audio.mel
        else:
            num_samples, mel = len(audio), longform_compact_mel(audio, n_mels)
        self.duration = num_samples / SAMPLE_RATE
        # [n_mels, content_frames + N_FRAMES]: the whole audio, then 30 s of silence
        self.mel = mel
        self.content_frames = self.mel.shape[-1] - N_FRAMES
        self.n_ctx = max_decoder_len
        self.seek = 0
        self.segments: list[Segment] = []
        self._temp_index = 0
        self.timestamps = options.timestamps if options.timestamps is not None \
            else self.content_frames > N_FRAMES
        self._sot_seq = tokenizer.sot_sequence(options.language, options.task, self.timestamps)
        # No language on a multilingual model: the first window detects it in-row (language.py)
        self._detecting = tokenizer.is_multilingual and options.language is None
        self.language = options.language or ("en" if not tokenizer.is_multilingual else None)
        self.language_probability: float | None = None
        initial = tokenizer.encode(" " + options.initial_prompt.strip()) \
            if options.initial_prompt else []
        self._all_tokens: list[int] = list(initial)
        self._prompt_reset_since = 0
        suppress = [SuppressBlank.of(tokenizer)] if options.suppress_blank else []
        self._processors = suppress + [SuppressTokens.of(default_suppress_tokens(tokenizer))]
        if self.timestamps:
            self._processors.append(
                ApplyTimestampRules.of(tokenizer, options.max_initial_timestamp, TIME_PRECISION))

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    @property
    def temperature(self) -> float:
        return self.opts.temperatures[self._temp_index]

    def _segment_size(self) -> int:
        return min(N_FRAMES, self.content_frames - self.seek)

    def next_request(self) -> GenerateRequest | None:
        """The engine request for the current window and temperature; None when done (what
        the task holds elsewhere is handed back then: :meth:`release`)."""
        if self.done:
            self.release()
            return None
        # past the audio's end: the appended silence's frames, or zeros (options.mel_padding)
        features = window_features(self.mel, self.seek, self._segment_size(),
                                   self.opts.mel_padding)
        prompt = self._all_tokens[self._prompt_reset_since:]
        prefix = [self.tok.sot_prev] + prompt[-(self.n_ctx // 2 - 1):] if prompt else []
        t, o = self.temperature, self.opts
        sot_seq, filters, forced = self._sot_seq, list(self._processors), 0
        language, check = self.language, None
        if self._detecting and self.guess is not None \
                and (o.best_of if t > 0 else o.beam_size) == 1:  # guess, checked by the prefill
            language = self._guessed = self.guess.code
            sot_seq = self.tok.sot_sequence(language, o.task, self.timestamps)
            check = language_check(self.tok, len(prefix))
        elif self._detecting:  # [sot] then <|lang|> (detected) + the forced rest of sot_seq
            sot_seq, tail = self._sot_seq[:1], self._sot_seq[1:]
            filters, forced = detection_chain(self.tok, tail, filters), 1 + len(tail)
        group = dict(best_of=o.best_of) if t > 0 else dict(beam_size=o.beam_size,
                                                            patience=o.patience)
        sampling = SamplingParams(
            temperature=t, seed=o.seed + self.seek * 7 + self._temp_index if t else None,
            max_new_tokens=(o.max_new_tokens or self.n_ctx // 2) + forced,
            length_penalty=o.length_penalty, **group)
        # a handle is kept only for a retry that can happen (and is released after it)
        retry_left = o.may_fall_back and self._temp_index + 1 < len(o.temperatures)
        req = GenerateRequest(prompt_ids=prefix + sot_seq, encoder_input=features,
                              sampling=sampling, logits_processors=filters,
                              no_speech_pos=len(prefix), no_speech_token=self.tok.no_speech,
                              encoder_kv=self._held,
                              keep_encoder=self.reuse_encoder and self._held is None
                              and retry_left, prompt_check=check)
        if self.opts.word_timestamps:
            req.readout = self._readout(forced, language)
        return req

    def release(self) -> None:
        """Hand back a log-mel held by an engine worker (:class:`HeldMel`) now rather than
        when this task is collected; idempotent. The task takes no further windows after."""
        if isinstance(self.mel, HeldMel):
            self.mel.release()

    def _readout(self, forced: int, language: str | None) -> AlignmentReadout:
        """What the window asks the engine for: its alignment pass (returned in the output's
        ``readout``). ``forced``: tokens that precede the text (detection: <|lang|> ...)."""
        tok, task = self.tok, self.opts.task
        if forced:
            seqs = {tok.language_token(code): tuple(tok.sot_sequence(code, task, False))
                    for code in tok.all_language_codes}
        else:
            seqs = {None: tuple(tok.sot_sequence(language, task, timestamps=False))}
        return AlignmentReadout(tuple(map(tuple, self.aligner.heads)), tok.eot,
                                tok.timestamp_begin, forced, seqs)

    def feed(self, out: GenerateOutput) -> list[Segment]:
        """Take the output of the last request; returns the segments this window added
        ([] when the window is decoded again at a higher temperature, or skipped as silence).
        Raises RequestFailed when the request failed or was aborted."""
        if out.encoder_kv is not None:
            self._held = out.encoder_kv
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            self._let_go()
            raise RequestFailed(out.error or f"request {out.rid} was aborted", out.rid)
        if self._detecting and out.prompt_check is not None:
            token, logprob = out.prompt_check
            self._set_language(self.tok.language_code(token), logprob)
            self.guess.learn(self._guessed, self.language)
            if self.language != self._guessed:
                return []  # decoded again with the detected language (encoder kept: _held)
        segments = self._feed(out)
        if self._temp_index == 0:  # the window is over (accepted or skipped as silence)
            self._let_go()
        return segments

    def _let_go(self) -> None:
        if self._held is not None:
            self._released.append(self._held)
            self._held = None

    def take_released(self) -> list[EncoderKV]:
        """Encoder handles this task no longer needs (the driver releases them on the
        engine, after every :meth:`feed`)."""
        out, self._released = self._released, []
        return out

    def abandon(self) -> list[EncoderKV]:
        """Give up (error, cancel): every handle still held, to release."""
        self._let_go()
        return self.take_released()

    def _feed(self, out: GenerateOutput) -> list[Segment]:
        alignment = out.readout
        tokens, logprobs = list(out.token_ids), list(out.logprobs)
        if self._detecting:
            tokens, logprobs = self._take_language(tokens, logprobs)
        score = WindowScore.of(self.tok.decode(tokens), logprobs, out.stop_logprob,
                               out.no_speech_prob)
        o = self.opts
        if score.needs_fallback(o) and self._temp_index + 1 < len(o.temperatures):
            self._temp_index += 1
            return []
        temperature = self.temperature
        self._temp_index = 0
        size = self._segment_size()
        if score.is_silent(o):
            self.seek += size  # silent window
            return []
        stats = dict(temperature=temperature, avg_logprob=score.avg_logprob,
                     compression_ratio=score.compression_ratio,
                     no_speech_prob=score.no_speech_prob)
        segments, self.seek = split_window(self.tok, tokens, self.seek, size, self.duration,
                                           stats, logprobs)
        if self.opts.word_timestamps:
            self.seek, self._last_speech = place_words(
                self.tok, segments, alignment, size, tokens, self.language, self.opts.task,
                self.timestamps, self.seek, self._last_speech)
        kept = [s for s in segments if s.text.strip() and s.end > s.start]
        self._all_tokens.extend(t for s in kept for t in s.tokens)
        if not o.condition_on_previous_text or temperature > 0.5:
            self._prompt_reset_since = len(self._all_tokens)
        for s in kept:
            s.id = len(self.segments)
            self.segments.append(s)
        return kept

    def _take_language(self, tokens: list[int], logprobs: list[float]
                       ) -> tuple[list[int], list[float]]:
        """Read the detected language off a detecting window's output; strip the forced
        tokens. Later windows (and fallbacks of this one) decode with that language."""
        forced = len(self._sot_seq)  # <|lang|> + the tail of the sot sequence after <|sot|>
        if len(tokens) < forced:
            raise RequestFailed(f"{self.source or 'audio'}: language detection produced no "
                                "output (max_new_tokens too small?)")
        self._set_language(self.tok.language_code(tokens[0]), logprobs[0])
        return tokens[forced:], logprobs[forced:]

    def _set_language(self, code: str, logprob: float) -> None:
        """The detected language (and its log-probability): this and later windows use it."""
        self.language, self.language_probability = code, math.exp(logprob)
        self._detecting = False
        self._sot_seq = self.tok.sot_sequence(code, self.opts.task, self.timestamps)

    def result(self) -> Transcription:
        words = [w for s in self.segments for w in s.words or []] \
            if self.opts.word_timestamps else None
        return Transcription(self.source, join_text(self.segments), self.duration,
                             self.language or "en", list(self.segments),
                             self.language_probability, words)

