"""What ``edserve bench`` sends and when: audio items and arrival times.

Inputs are expanded like ``edserve transcribe``'s (files, folders, ``.txt``/``.jsonl``
manifests: :func:`edserve.batch_cli.expand_inputs`); each file is read once and its duration
measured with edserve's own decoder. A file the decoder refuses (corrupt, empty) is still sent
(duration 0): what the server answers is part of the benchmark.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioError
from edserve.batch_cli import expand_inputs


@dataclass(frozen=True)
class AudioItem:
    """One file to upload: its name, its bytes, and its audio seconds (0 if undecodable)."""

    name: str
    data: bytes
    seconds: float


def load_items(inputs: list[str]) -> list[AudioItem]:
    """Files, folders and manifests -> items (input order). Raises ``ValueError`` when
    nothing is left or a path cannot be read."""
    items = []
    for path in expand_inputs(inputs):
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            seconds = len(load_audio(data)) / 16000
        except AudioError:
            seconds = 0.0
        items.append(AudioItem(Path(path).name, data, seconds))
    if not items:
        raise ValueError("no audio files found in the inputs")
    return items


def request_plan(items: list[AudioItem], num_requests: int) -> list[AudioItem]:
    """``num_requests`` items, cycling through the inputs in order."""
    return [items[i % len(items)] for i in range(num_requests)]


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate`` requests/s:
    exponential gaps, seeded (the same seed gives the same schedule); the first is at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num_requests):
        out.append(t)
        if i + 1 < num_requests:
            t += rng.expovariate(rate)
    return out
