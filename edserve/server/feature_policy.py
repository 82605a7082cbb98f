"""Where an upload's log-mel is computed: on an audio worker (host), on the engine's device
beside its steps, or inside the engine's prefill step.

Three settings decide (:class:`~edserve.server.config.ServerConfig`):

- ``--step-features``: every upload is only decoded (a 16 kHz 16-bit WAV in the API process,
  anything else on an audio worker); a clip that fits one window travels to the engine as its
  samples, and the prefill step that admits it computes its log-mel together with the other
  clips' (:mod:`edserve.audio.pcm_window`); longer uploads get theirs on the device;

- ``--device-features-above-s``: uploads longer than that always get their log-mel on the
  device (a 10-minute file: milliseconds there against ~1 s of a worker's CPU);
- ``--device-features-idle``: while at most that many transcription requests are in flight
  (this one included), every upload does. A lightly loaded server then answers sooner: an 11 s
  clip's log-mel takes ~0.7 ms on the H200 against ~6 ms of a host core, and a 16 kHz 16-bit
  WAV is read in the API process, skipping the audio worker's round trip (one client: 65 vs
  70 ms p50). Under load short clips go back to the workers: there the device and the engine
  process's GIL belong to the engine's steps (every log-mel on the device measured 101 vs 106
  requests/s at 32 clients and 94.5 vs 119.7 at 64; again with the log-mels held by the
  engine worker, 91.8 vs 99.9 at 32 and 100.4 vs 98.5 at 64: benchmarks/RESULTS.md, waves 14
  and 20).

The policy lives in the API process's event loop (one thread): its counter needs no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FeaturePolicy:
    """``above_s``: the long-upload threshold (None: the device never computes log-mels, and
    ``idle_max`` is ignored); ``idle_max``: in-flight requests up to which every upload's
    log-mel goes to the device (0: never for that reason); ``in_step``: short clips' log-mels
    are computed in the prefill step (needs ``above_s``: longer uploads go to the device)."""

    def __init__(self, above_s: float | None, idle_max: int, in_step: bool = False) -> None:
        if idle_max < 0:
            raise ValueError(f"idle_max must be >= 0, got {idle_max}")
        if in_step and above_s is None:
            raise ValueError("log-mels in the prefill step need the device's log-mels for "
                             "longer uploads (a threshold, not None)")
        self.above_s = above_s
        self.idle_max = idle_max if above_s is not None else 0
        self.in_step = in_step
        self.in_flight = 0  # transcription requests between their start and their response

    def defer_above_s(self) -> float | None:
        """Seconds above which the upload being prepared now gets its log-mel on the device
        (0.0: any length; None: never)."""
        if self.above_s is None:
            return None
        return 0.0 if self.in_step or self.in_flight <= self.idle_max else self.above_s

    @contextmanager
    def track(self) -> Iterator[None]:
        """Counts one request as in flight for the duration of the block."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
