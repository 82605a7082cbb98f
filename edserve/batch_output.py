"""Where batch transcription writes, and how it reports progress: shared by the batch CLI
(:mod:`edserve.batch_cli`, which plans outputs) and the run (:mod:`edserve.batch_run`, which
writes them)."""

from __future__ import annotations

import os
import time
from pathlib import Path

LOST_RETRIES = 2  # a file whose worker died is transcribed again (on another worker)


def output_paths(src: str, fmt: str, output_dir: str) -> dict[str, Path]:
    """Format -> where ``src``'s output goes (the same names as the one-shot path)."""
    from edserve.whisper.formats import EXTENSIONS

    folder = Path(output_dir) if output_dir else Path(src).parent
    return {f: folder / f"{Path(src).stem}.{ext}" for f, ext in EXTENSIONS.items()
            if fmt == "all" or f == fmt}


def write_atomic(path: Path, text: str) -> None:
    """``path`` gets ``text`` whole or not at all: written to a hidden temporary file, then
    renamed over it. An interruption (Ctrl-C, or SIGTERM, which the batch CLI turns into one)
    between the two removes the temporary file before it propagates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rtf_postfix(audio_s: float, started: float) -> dict[str, str]:
    elapsed = time.monotonic() - started
    return {"audio_h": f"{audio_s / 3600:.3f}",
            "rtf": f"{elapsed / audio_s:.3f}" if audio_s else "-"}
