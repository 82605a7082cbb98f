"""An upload made ready for transcription in one call: decoded, resampled and turned into
Whisper's whole-audio log-mel (the work a server hands to its audio worker processes).

:func:`prepare_upload` is a plain, picklable top-level function over bytes: the server's
:class:`~edserve.server.audio_pool.AudioPool` runs it in worker processes (no GIL shared with
the API's event loop) and in threads when the pool is off; both give the same numbers, and
the same numbers as a :class:`~edserve.whisper.longform.LongformTask` given the samples
(one :func:`~edserve.audio.mel.log_mel_spectrogram` of the audio + 30 s of zeros).
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from edserve.audio.chunked_mel import chunked_log_mel
from edserve.audio.compact_mel import CompactMel
from edserve.audio.decode import DECLARED_DURATION_SLACK, load_audio
from edserve.audio.errors import DecodeCancelled, NonFiniteAudioError
from edserve.audio.held_mel import HeldMel
from edserve.audio.mel import N_SAMPLES, SAMPLE_RATE
from edserve.audio.pcm_window import PcmMel, fits_step
from edserve.audio.wav_pcm import pcm16_to_float, read_pcm_wav


@dataclass(frozen=True)
class PreparedAudio:
    """One audio's long-form features.

    ``mel``: ``[n_mels, num_samples // HOP_LENGTH + N_FRAMES]`` float32, the log-mel of the
    samples followed by ``N_SAMPLES`` zeros (:func:`longform_mel`): a tensor, or after
    crossing a process boundary a :class:`CompactMel` (sliced the same way), or a
    :class:`~edserve.audio.held_mel.HeldMel` kept by the engine worker that computed it, or
    a :class:`~edserve.audio.pcm_window.PcmMel` (a short clip whose log-mel the engine's
    prefill step computes: :func:`step_features`);
    ``num_samples``: 16 kHz
    samples decoded; ``decode_s`` / ``features_s``: seconds the two steps took where they ran.
    """

    mel: torch.Tensor | CompactMel | HeldMel | PcmMel
    num_samples: int
    decode_s: float = 0.0
    features_s: float = 0.0

    @property
    def n_mels(self) -> int:
        return self.mel.shape[0]

    def __reduce__(self):
        """Across processes (an audio worker's answer) as numpy, not torch storage, and
        without the constant tail of the appended silence (:class:`CompactMel`: ~73 % of an
        11 s clip's frames, sent as one value). It arrives as a :class:`CompactMel`; a
        :class:`HeldMel` crosses as its id, a :class:`PcmMel` as its samples."""
        if isinstance(self.mel, (HeldMel, PcmMel)):
            return (PreparedAudio, (self.mel, self.num_samples, self.decode_s, self.features_s))
        mel = self.mel if isinstance(self.mel, CompactMel) else CompactMel.of(self.mel.numpy())
        return (_rebuild, (mel.head, mel.fill, mel.frames, self.num_samples, self.decode_s,
                           self.features_s))


@dataclass(frozen=True, eq=False)
class DecodedAudio:
    """An upload decoded, its features not computed yet: what an audio worker hands back for
    audio longer than the server's ``--device-features-above-s`` (the engine's device computes
    the log-mel, :mod:`edserve.audio.device_mel`). ``samples``: ``[num_samples]`` 16 kHz,
    float32 and finite (checked), or int16 as a 16-bit WAV stores them (half the bytes to
    send to the engine process; :meth:`float_samples` is ``x / 32768``, exact)."""

    samples: np.ndarray
    decode_s: float = 0.0

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def float_samples(self) -> np.ndarray:
        """``[num_samples]`` float32 in [-1, 1]."""
        return pcm16_to_float(self.samples) if self.samples.dtype == np.int16 else self.samples


def _rebuild(head: np.ndarray, fill: np.generic | float, frames: int, num_samples: int,
             decode_s: float, features_s: float) -> PreparedAudio:
    return PreparedAudio(CompactMel(head, fill, frames), num_samples, decode_s, features_s)


def longform_compact_mel(audio: np.ndarray | torch.Tensor, n_mels: int) -> CompactMel:
    """The long-form log-mel of ``[num_samples]`` 16 kHz samples: one STFT (and one max - 8
    floor) over the audio followed by 30 s of zero samples (openai-whisper's ``transcribe``),
    computed in chunks (:mod:`edserve.audio.chunked_mel`), without its constant tail."""
    if not torch.is_tensor(audio):
        audio = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    head, fill, frames = chunked_log_mel(audio, n_mels, padding=N_SAMPLES)
    return CompactMel(head.numpy(), np.float32(fill.item()), frames)


def longform_mel(audio: np.ndarray | torch.Tensor, n_mels: int) -> torch.Tensor:
    """:func:`longform_compact_mel` as one ``[n_mels, frames]`` tensor."""
    return longform_compact_mel(audio, n_mels).full()


def step_features(audio: DecodedAudio, n_mels: int) -> PreparedAudio | None:
    """``audio`` ready for a window whose log-mel the engine computes in its prefill step
    (:mod:`edserve.audio.pcm_window`: the samples travel, not a log-mel), or None when the
    clip is empty or longer than one step takes (:func:`~edserve.audio.pcm_window.fits_step`)."""
    if not fits_step(audio.num_samples):
        return None
    return PreparedAudio(PcmMel(audio.samples, n_mels), audio.num_samples, audio.decode_s, 0.0)


def _check_finite(audio: np.ndarray) -> None:
    if not np.isfinite(audio).all():
        raise NonFiniteAudioError()


def prepare_samples(audio: np.ndarray, n_mels: int) -> PreparedAudio:
    """:class:`PreparedAudio` of already-decoded samples (``NonFiniteAudioError`` for NaN/inf)."""
    _check_finite(audio)
    started = time.perf_counter()
    mel = longform_compact_mel(audio, n_mels)
    return PreparedAudio(mel, len(audio), 0.0, time.perf_counter() - started)


def may_hold(data: bytes, seconds: float) -> bool:
    """Whether ``data`` is big enough to hold ``seconds`` of 16 kHz 16-bit samples."""
    return len(data) >= seconds * SAMPLE_RATE * 2


def decode_long_wav(data: bytes, max_seconds: float | None,
                    defer_above_s: float) -> DecodedAudio | None:
    """The samples of an upload that is a 16 kHz mono 16-bit WAV longer than
    ``defer_above_s`` (:mod:`edserve.audio.wav_pcm`: the standard library's parser, no FFmpeg;
    the same samples as :func:`prepare_upload`'s); None for anything else (the audio workers
    decide). For the server's API process: a 10-minute file would otherwise go to an audio
    worker and back through its pipe (19 MB there, 38 MB of samples back) only to be
    converted from int16. The samples stay int16 (19 MB, not 38, to the engine process; the
    device converts them). Raises AudioTooLongError past ``max_seconds``. :func:`may_hold`
    tells, from the length alone, whether calling it can pay."""
    started = time.perf_counter()
    audio = read_pcm_wav(io.BytesIO(data), SAMPLE_RATE, max_seconds, DECLARED_DURATION_SLACK,
                         pcm16=True)
    if audio is None or len(audio) <= defer_above_s * SAMPLE_RATE:
        return None
    return DecodedAudio(audio, time.perf_counter() - started)


def prepare_upload(data: bytes, n_mels: int, max_seconds: float | None,
                   cancel: threading.Event | None = None,
                   defer_above_s: float | None = None) -> PreparedAudio | DecodedAudio:
    """Decode an untrusted upload (see :func:`~edserve.audio.decode.load_audio`:
    ``untrusted=True``, stopped past ``max_seconds``, ``cancel`` checked between frames),
    then its long-form log-mel; audio longer than ``defer_above_s`` seconds comes back as
    :class:`DecodedAudio` (checked finite) for the engine's device to finish. Raises what
    ``load_audio`` raises (AudioError subclasses, DecodeCancelled); all of them pickle, so a
    worker process's refusal reaches the caller as the same exception."""
    started = time.perf_counter()
    audio = load_audio(data, max_seconds=max_seconds, cancel=cancel, untrusted=True)
    decoded = time.perf_counter()
    if cancel is not None and cancel.is_set():
        raise DecodeCancelled("client gone")
    if defer_above_s is not None and len(audio) > defer_above_s * SAMPLE_RATE:
        _check_finite(audio)
        return DecodedAudio(audio, decoded - started)
    prepared = prepare_samples(audio, n_mels)
    return PreparedAudio(prepared.mel, prepared.num_samples, decoded - started,
                         prepared.features_s)
