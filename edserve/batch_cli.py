"""Batch transcription for ``edserve transcribe``: folders, manifests, ``--resume``, progress,
and data-parallel workers (``--data-parallel-size``).

Inputs: audio files; folders (every audio file below, recursively, sorted); manifests, by
extension: ``.txt``/``.lst``/``.list`` (one path per line; ``#`` comments) or ``.jsonl`` (one
object per line with a ``file`` field); relative paths in a manifest are relative to its
folder. Files are decoded and transcribed concurrently (at most ``workers *
--max-running-requests`` at once, so memory stays bounded), each written as soon as it is done
(to a temporary name, then renamed: an interrupted run leaves no partial output), with a tqdm
bar of files, audio hours and the real-time factor (wall time / audio time). ``--resume``
skips inputs whose outputs all exist. Without ``--output-dir`` results are printed in input
order as soon as every earlier input is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from edserve.batch_output import output_paths
from edserve.config import MEL_PADDINGS
from edserve.server.config import MAX_GROUP_ROWS

AUDIO_EXTENSIONS = {".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".wma",
                    ".webm", ".mp4", ".mkv", ".mov", ".aiff", ".aif"}
TEXT_MANIFESTS = {".txt", ".lst", ".list"}


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """``--data-parallel-size`` (help from :class:`ServerConfig`) and ``--resume``."""
    from edserve.server.config import ServerConfig

    doc = {f.name: f.metadata["help"] for f in fields(ServerConfig)}["data_parallel_size"]
    p.add_argument("--data-parallel-size", type=int, default=1, help=doc)
    p.add_argument("--resume", action="store_true",
                   help="Skip inputs whose output files all exist (needs --output-dir).")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """``--beam-size``, ``--best-of``, ``--patience``, ``--length-penalty`` (openai-whisper's
    CLI flags and defaults) and ``--mel-padding``; bad values are argparse errors (exit 2)."""
    p.add_argument("--beam-size", type=_group_size, default=5, metavar="N",
                   help="Beams for windows decoded at temperature 0 (beam search, as "
                   "openai-whisper); 1: greedy (fastest). 1..16.")
    p.add_argument("--best-of", type=_group_size, default=5, metavar="N",
                   help="Samples drawn for windows decoded at temperature > 0 (--temperature "
                   "or the fallback); the most likely one is kept. 1..16.")
    p.add_argument("--patience", type=_positive, default=None, metavar="F",
                   help="Beam search stops once round(beam_size * F) finished candidates are "
                   "found (openai-whisper's patience; unset: F = 1). Needs --beam-size > 1.")
    p.add_argument("--length-penalty", type=_length_penalty, default=None, metavar="F",
                   help="Rank finished candidates by sum log-probability / ((5 + length) / 6) "
                   "** F (Google NMT's length penalty), 0..10; unset: divide by the length.")
    p.add_argument("--mel-padding", choices=MEL_PADDINGS, default="silence",
                   help="Layout of a window shorter than 30 s (a clip under 30 s, the last "
                   "window of longer audio). silence: the log-mel of the audio followed by "
                   "silence (lower WER on our clips, see README); zeros: the audio's log-mel "
                   "frames zero-filled to 30 s, as openai-whisper's transcribe() and "
                   "faster-whisper (the same tokens as theirs). Language detection uses the "
                   "same layout.")


def _group_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_GROUP_ROWS:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_GROUP_ROWS}, "
                                         f"got {text!r}")
    return n


def _finite(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return x


def _positive(text: str) -> float:
    if not _finite(text) > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return float(text)


def _length_penalty(text: str) -> float:
    if not 0.0 <= _finite(text) <= 10.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 10, got {text!r}")
    return float(text)


def decoding_error(args: argparse.Namespace) -> str | None:
    """A combination of the decoding flags that cannot run (else None)."""
    if getattr(args, "patience", None) is not None and args.beam_size == 1:
        return "argument --patience: needs --beam-size > 1 (beam search)"
    return None


def group_rows(args: argparse.Namespace) -> int:
    """KV rows one file's request decodes at once (its beams or samples)."""
    return max(getattr(args, "beam_size", 1), getattr(args, "best_of", 1))


def decoding_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding flags as :class:`~edserve.whisper.options.TranscribeOptions` fields."""
    return {name: getattr(args, name, default) for name, default in
            (("beam_size", 1), ("best_of", 1), ("patience", None), ("length_penalty", None),
             ("mel_padding", "silence"))}


def wants_batch(args: argparse.Namespace) -> bool:
    """Use this module (not the one-shot path) for folders, manifests, --resume or DP."""
    return args.resume or args.data_parallel_size > 1 or any(
        os.path.isdir(f) or Path(f).suffix.lower() in TEXT_MANIFESTS | {".jsonl"}
        for f in args.files)


def read_manifest(path: Path) -> list[str]:
    """Paths listed in a ``.txt``/``.lst``/``.list`` or ``.jsonl`` manifest."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if path.suffix.lower() == ".jsonl":
            try:
                line = json.loads(line)["file"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'file' field"
                                 ) from None
        out.append(str(path.parent / line) if not os.path.isabs(line) else line)
    return out


def expand_inputs(items: list[str]) -> list[str]:
    """Files, folders and manifests -> audio file paths (in order, duplicates dropped)."""
    files: list[str] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            files += sorted(str(p) for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS)
        elif path.suffix.lower() in TEXT_MANIFESTS | {".jsonl"}:
            files += read_manifest(path)
        else:
            files.append(item)
    return list(dict.fromkeys(files))


def _client(args: argparse.Namespace) -> Any:
    from edserve.config import EngineConfig
    from edserve.config_args import config_from_args

    config = config_from_args(args, EngineConfig)
    # at least one file's beams or samples must fit (rows are per beam / sample)
    if config.max_running_requests is not None:
        config = config.replace(max_running_requests=max(config.max_running_requests,
                                                         group_rows(args)))
    if args.data_parallel_size > 1:
        from edserve.dp.client import DataParallelClient

        return DataParallelClient(config, args.data_parallel_size).start()
    from edserve.engine.async_engine import AsyncEngine
    from edserve.engine.local_client import InProcessClient
    from edserve.runtime import build_engine

    return InProcessClient(AsyncEngine(build_engine(config)).start())


def _options(args: argparse.Namespace, seed: int) -> Any:
    from edserve.whisper.options import TranscribeOptions, temperature_schedule

    timed = args.output_format not in ("text", "json")
    return TranscribeOptions(
        language=args.language, task=args.task,
        temperatures=temperature_schedule(args.temperature), seed=seed,
        initial_prompt=args.initial_prompt, timestamps=True if timed else None,
        condition_on_previous_text=args.condition_on_previous_text,
        word_timestamps=getattr(args, "word_timestamps", False), **decoding_kwargs(args))


def run_batch(args: argparse.Namespace) -> int:
    """``edserve transcribe`` over many inputs (see the module doc); the exit status."""
    if args.output_format == "all" and args.output_dir is None:
        return _fail("--output-format all needs --output-dir")
    if args.resume and args.output_dir is None:
        return _fail("--resume needs --output-dir")
    try:
        files = expand_inputs(args.files)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    todo = files
    if args.output_dir is not None:
        targets: dict[Path, str] = {}
        for f in files:
            for out in output_paths(f, args.output_format, args.output_dir).values():
                if targets.setdefault(out, f) != f:
                    return _fail(f"{f} and {targets[out]} would both write {out}")
        if args.resume:
            todo = [f for f in files if not all(
                p.exists() for p in output_paths(f, args.output_format, args.output_dir).values())]
            if len(todo) < len(files):
                print(f"edserve: --resume: {len(files) - len(todo)} of {len(files)} inputs "
                      "already done", file=sys.stderr)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: as Ctrl-C
    client = None
    try:
        client = _client(args)
        from edserve.batch_run import BatchRun

        return asyncio.run(BatchRun(client, args, _options(args, args.seed)).run(todo))
    except KeyboardInterrupt:
        print("edserve: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
        if client is not None:
            client.shutdown(0.0)


def _fail(message: str) -> int:
    print(f"edserve: {message}", file=sys.stderr)
    return 2
