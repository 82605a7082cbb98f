"""A long upload's log-mel on the engine's device (:func:`device_features`).

A 10-minute file's long-form log-mel costs ~0.15-1 s of one CPU core; 16 such uploads at once
keep every audio worker busy before their first window can start. On a GPU the same work
(:func:`~edserve.audio.chunked_mel.chunked_log_mel`) is a few milliseconds. The engine client
runs it where the engine's weights live (:meth:`~edserve.engine.protocol.EngineClient.features`),
on a side stream when that is CUDA, and hands back only the columns before the appended
silence's constant tail (:class:`~edserve.audio.compact_mel.CompactMel`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from edserve.audio.chunked_mel import chunked_log_mel
from edserve.audio.compact_mel import CompactMel
from edserve.audio.prepare import DecodedAudio, PreparedAudio
from edserve.audio.wav_pcm import PCM16_SCALE


def device_features(audio: DecodedAudio, n_mels: int, device: torch.device | str,
                    stream: torch.cuda.Stream | None = None,
                    chunk_frames: int | None = None,
                    keep: Callable[[torch.Tensor, float, int], Any] | None = None
                    ) -> PreparedAudio:
    """``audio``'s long-form log-mel computed on ``device`` (on ``stream`` when given: off the
    engine's stream), as the :class:`PreparedAudio` an audio worker would have made
    (``features_s``: the seconds spent here, copies included). ``keep(head, fill, frames)``,
    when given, is offered the log-mel first, still on ``device`` and written (``head``
    ``[n_mels, t]`` float32, then ``fill`` up to ``frames`` columns): what it returns (e.g. a
    :class:`~edserve.audio.held_mel.HeldMel`) is the answer's ``mel``; None, or no ``keep``:
    the values, copied to the host as a :class:`CompactMel`."""
    started = time.perf_counter()
    device = torch.device(device)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        samples = torch.from_numpy(audio.samples).to(device)  # [num_samples]
        if samples.dtype == torch.int16:  # x / 32768 as the host does it (exact)
            samples = samples.float().mul_(float(PCM16_SCALE))
        head, fill, frames = chunked_log_mel(samples, n_mels, chunk_frames=chunk_frames)
        fill = float(fill.item())  # waits for this stream only: ``head`` is written
        mel = keep(head, fill, frames) if keep is not None else None
        if mel is None:
            mel = CompactMel(head.cpu().numpy(), np.float32(fill), frames)
    return PreparedAudio(mel, audio.num_samples, audio.decode_s,
                         time.perf_counter() - started)
