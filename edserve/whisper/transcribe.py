"""Transcription drivers: audio of any length -> timed segments, through the engine.

:func:`transcribe` (synchronous, for the CLI and scripts) submits the first window of every
input at once and, whenever a window finishes, submits that audio's next window, so windows of
different inputs share the engine's continuous batch. :func:`transcribe_async` does the same for
one audio on an :class:`~edserve.engine.async_engine.AsyncEngine`; concurrent calls (one per
HTTP request) batch together in the engine loop.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from edserve.audio.decode import load_audio
from edserve.audio.errors import EmptyAudioError, NonFiniteAudioError
from edserve.audio.prepare import PreparedAudio
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.request import GenerateRequest
from edserve.whisper.language import LanguageGuess
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions, temperature_schedule
from edserve.whisper.result import Segment, Transcription

__all__ = ["Segment", "Transcription", "make_task", "transcribe", "transcribe_async",
           "run_tasks"]


def _name(item: Any, index: int) -> str:
    if isinstance(item, str | os.PathLike):
        return os.fspath(item)
    return f"<input {index}>"


def make_task(engine: Any, audio: np.ndarray | PreparedAudio, options: TranscribeOptions,
              source: str = "", language_guess: LanguageGuess | None = None) -> LongformTask:
    """A :class:`LongformTask` for ``audio`` (16 kHz float32, or its
    :class:`~edserve.audio.prepare.PreparedAudio`) on ``engine``'s model.

    ``language_guess``: what a window that detects the language guesses (share one across a
    server's or a run's tasks; None: a new one, English at first).

    With ``options.word_timestamps`` the task gets an
    :class:`~edserve.whisper.cross_weights.Aligner` on the engine's model and alignment heads.
    Raises EmptyAudioError for zero samples and ValueError for a language/task the model
    cannot do."""
    if (audio.num_samples if isinstance(audio, PreparedAudio) else len(audio)) == 0:
        raise EmptyAudioError(f"{source or 'audio'}: audio is empty")
    aligner = None
    if options.word_timestamps:
        from edserve.whisper.cross_weights import Aligner, model_alignment_heads

        aligner = Aligner(engine.model, model_alignment_heads(engine))
    reuse = getattr(engine, "supports_encoder_handles", True)  # an Engine: yes
    return LongformTask(audio, engine.tokenizer, engine.model.config.num_mel_bins, options,
                        engine.max_decoder_len, source, aligner, reuse_encoder=reuse,
                        language_guess=language_guess or LanguageGuess())


def run_tasks(engine: Any, tasks: list[LongformTask],
              on_finish: Callable[[LongformTask], None] | None = None) -> None:
    """Drive ``tasks`` to completion on ``engine`` (synchronously, windows batched together)."""
    driver = _WindowDriver(engine, on_finish)
    for task in tasks:
        driver.submit(task)
    while engine.has_work():
        engine.step()
    if driver.failures:
        raise RequestFailed("; ".join(driver.failures))


class _WindowDriver:
    """Submits each task's next window when its previous one finishes.

    A class, not a recursive closure: a closure that names itself is a reference cycle, and it
    kept the engine (and its KV pool) alive after ``transcribe`` returned until the cycle
    collector ran. The callback given to the engine lives only while its window is in flight.
    """

    def __init__(self, engine: Any, on_finish: Callable[[LongformTask], None] | None):
        self.engine = engine
        self.on_finish = on_finish
        self.failures: list[str] = []

    def submit(self, task: LongformTask) -> None:
        req = task.next_request()
        if req is None:
            if self.on_finish is not None:
                self.on_finish(task)
            return
        self.engine.add_request(req, lambda delta: self._done(task, delta))

    def _done(self, task: LongformTask, delta: TokenDelta) -> None:
        if not delta.finished:
            return
        try:
            task.feed(delta.output)
        except RequestFailed as exc:
            self.failures.append(f"{task.source}: {exc}")
            _release(self.engine, task.abandon())
            return
        _release(self.engine, task.take_released())
        self.submit(task)


def transcribe(engine: Any, inputs: list[Any], language: str | None = None,
               task: str = "transcribe", temperature: float = 0.0, seed: int | None = None,
               on_finish: Callable[[Any], None] | None = None,
               options: TranscribeOptions | None = None,
               word_timestamps: bool = False, beam_size: int = 1, best_of: int = 1,
               patience: float | None = None, length_penalty: float | None = None,
               mel_padding: str = "silence") -> list[Transcription]:
    """Transcribe files, bytes or 16 kHz float arrays of any length, in input order.

    ``temperature`` starts the fallback schedule (``temperature, +0.2, ... 1.0``);
    ``word_timestamps`` times every word (``Transcription.words``, ``Segment.words``);
    ``beam_size`` beams at temperature 0 and ``best_of`` samples above it (1: greedy / one
    sample, openai-whisper's ``transcribe()`` defaults; its CLI uses 5 and 5).
    ``mel_padding="zeros"`` lays out windows shorter than 30 s as openai-whisper's
    ``transcribe()`` does (its tokens exactly); ``"silence"``: see :class:`TranscribeOptions`.
    ``options`` overrides all keyword settings. Raises AudioError for unusable audio.
    """
    if options is None:
        options = TranscribeOptions(language=language, task=task,
                                    temperatures=temperature_schedule(temperature),
                                    seed=engine.config.seed if seed is None else seed,
                                    word_timestamps=word_timestamps, beam_size=beam_size,
                                    best_of=best_of, patience=patience,
                                    length_penalty=length_penalty,
                                    mel_padding=mel_padding)
    audios = [a if isinstance(a, np.ndarray) else load_audio(a) for a in inputs]
    if any(not np.isfinite(a).all() for a in audios):  # files: refused by load_audio
        raise NonFiniteAudioError()
    guess = LanguageGuess()
    tasks = [make_task(engine, audio, options, _name(inputs[i], i), guess)
             for i, audio in enumerate(audios)]
    run_tasks(engine, tasks, on_finish)
    return [t.result() for t in tasks]


async def transcribe_async(aengine: Any, task: LongformTask,
                           on_output: Callable[[GenerateRequest, GenerateOutput], None]
                           | None = None) -> AsyncIterator[Segment]:
    """Run ``task`` on an AsyncEngine, yielding segments as their windows are accepted;
    ``on_output`` sees every window's engine request and output (token usage, stage
    timings).

    Cancelling the consumer aborts the window in flight (its KV is freed) and releases the
    encoder region the task kept for a fallback retry."""
    try:
        while (req := task.next_request()) is not None:
            out: GenerateOutput = await aengine.generate(req)
            if on_output is not None:
                on_output(req, out)
            segments = task.feed(out)
            _release(aengine, task.take_released())
            for segment in segments:
                yield segment
    finally:
        _release(aengine, task.abandon())


def _release(engine: Any, handles: list) -> None:
    for handle in handles:
        engine.release_encoder(handle)
