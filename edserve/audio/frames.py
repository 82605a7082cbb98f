"""Whisper's audio framing constants: 16 kHz audio, 25 ms windows (``N_FFT`` 400) every 10 ms
(``HOP_LENGTH`` 160), 30 s windows (``N_SAMPLES`` samples -> ``N_FRAMES`` frames).
:mod:`edserve.audio.mel` re-exports them."""

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_LENGTH = 30
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames in a 30 s window
