"""Audio in: decode an allowed container to 16 kHz mono samples, then Whisper's log-mel.

Uploads: ``load_audio(data, untrusted=True, max_seconds=..., cancel=...)``; see
:mod:`edserve.audio.decode` for the safety rules and :mod:`edserve.audio.formats` for the
container allow-list.
"""

from edserve.audio.decode import UNTRUSTED_DECODE_MESSAGE, UNTRUSTED_EMPTY_MESSAGE, load_audio
from edserve.audio.errors import (
    AudioDecodeError,
    AudioError,
    AudioTooLongError,
    DecodeCancelled,
    EmptyAudioError,
    NonFiniteAudioError,
)
from edserve.audio.formats import ALLOWED_DEMUXERS
from edserve.audio.mel import (
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    mel_filters,
    pad_or_trim,
    whisper_features,
)

__all__ = [
    "ALLOWED_DEMUXERS",
    "AudioDecodeError",
    "AudioError",
    "AudioTooLongError",
    "DecodeCancelled",
    "EmptyAudioError",
    "NonFiniteAudioError",
    "UNTRUSTED_DECODE_MESSAGE",
    "UNTRUSTED_EMPTY_MESSAGE",
    "N_FRAMES",
    "N_SAMPLES",
    "SAMPLE_RATE",
    "load_audio",
    "log_mel_spectrogram",
    "mel_filters",
    "pad_or_trim",
    "whisper_features",
]
