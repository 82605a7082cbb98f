"""The soak (``benchmarks/soak.py``) on a GPU host, where the embedded tiny.en package is not
installed: saves a random-weight Whisper HF folder (the tiny.en tokenizer, float32 so that a
request's text does not depend on its batch) and soaks an ``edserve serve`` started on it.

  python3 benchmarks/soak_gpu.py --requests 10000 --concurrency 256 --json soak_gpu.json
  python3 benchmarks/soak_gpu.py --dry-run   # CPU, toy shapes, 40 requests

Every flag not listed here goes to ``soak.py`` (``--bad``, ``--disconnect``, ``--seed``, ...).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402
import whisper_gpu as wg  # noqa: E402
from serve_gpu import save_folder  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="tiny.en", choices=sorted(wg.ARCHS))
    ap.add_argument("--rows", type=int, default=256, help="--max-running-requests")
    ap.add_argument("--dry-run", action="store_true")
    args, rest = ap.parse_known_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.arch, args.rows = "toy", 8
        rest = ["--requests", "40", "--concurrency", "8", "--rss-tolerance", "0.5", *rest]
    work = Path(tempfile.mkdtemp(prefix="soak_gpu_"))
    try:
        save_folder(args.arch, work / "model", device, torch.float32)
        if device == "cuda":
            torch.cuda.empty_cache()
        # random weights never say EOS and would trip the temperature fallback (sampled text
        # differs per run): windows capped at 17 tokens, thresholds off, as in serve_gpu.py
        flags = (f"--model {work / 'model'} --device {device} --dtype float32 "
                 f"--max-running-requests {args.rows} --context-length 34 "
                 "--compression-ratio-threshold inf --logprob-threshold=-inf "
                 "--no-speech-threshold inf" + (" --threads 1" if args.dry_run else ""))
        return soak.main(["--server-flags", flags, *rest])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
