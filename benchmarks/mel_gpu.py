"""Long-form log-mel: one STFT on the host (before wave 13), chunks on the host (an audio
worker now), and chunks on the GPU (``device_features``: what the engine worker's features
thread runs for uploads over ``--device-features-above-s``), copies in and out included.

  python benchmarks/mel_gpu.py                      # 11 s and 10 min, 128 mels
  python benchmarks/mel_gpu.py --dry-run            # CPU only, short: the script runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from edserve.audio.chunked_mel import chunked_log_mel
from edserve.audio.device_mel import device_features
from edserve.audio.mel import N_SAMPLES, log_mel_spectrogram
from edserve.audio.prepare import DecodedAudio


def best_ms(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times), 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[11.0, 600.0])
    ap.add_argument("--mels", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if args.dry_run:
        args.seconds, args.repeats = [2.0, 20.0], 1
    torch.set_num_threads(1)  # as an audio worker
    stream = torch.cuda.Stream() if cuda else None
    print("seconds  host one STFT ms  host chunks ms  device ms (best / median)  max |dev-host|")
    for seconds in args.seconds:
        rng = np.random.default_rng(0)
        audio = (rng.standard_normal(int(seconds * 16000)) * 0.1).astype(np.float32)
        tensor = torch.from_numpy(audio)
        one = best_ms(lambda t=tensor: log_mel_spectrogram(t, args.mels, padding=N_SAMPLES),
                      args.repeats)[0]
        chunks = best_ms(lambda t=tensor: chunked_log_mel(t, args.mels), args.repeats)[0]
        dev, diff = (float("nan"), float("nan")), float("nan")
        if cuda:
            decoded = DecodedAudio(audio)
            dev = best_ms(lambda d=decoded: device_features(d, args.mels, "cuda", stream),
                          args.repeats)
            got = device_features(decoded, args.mels, "cuda", stream).mel.full()
            want = log_mel_spectrogram(tensor, args.mels, padding=N_SAMPLES)
            diff = (got - want).abs().max().item()
        print(f"{seconds:7.0f}  {one:16.1f}  {chunks:14.1f}  {dev[0]:10.2f} / {dev[1]:7.2f}"
              f"  {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
