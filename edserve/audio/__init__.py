"""Audio in: decode any container to 16 kHz mono samples, then Whisper's log-mel features."""

from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioDecodeError, AudioError, EmptyAudioError
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
    "AudioDecodeError",
    "AudioError",
    "EmptyAudioError",
    "N_FRAMES",
    "N_SAMPLES",
    "SAMPLE_RATE",
    "load_audio",
    "log_mel_spectrogram",
    "mel_filters",
    "pad_or_trim",
    "whisper_features",
]
