"""Command line: ``edserve transcribe FILE...``, ``edserve serve``, ``edserve chat`` and
``edserve bench``.

Engine flags come from :class:`edserve.config.EngineConfig`; their help text is the field docs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from edserve.batch_cli import (
    add_batch_args,
    add_decoding_args,
    decoding_error,
    decoding_kwargs,
    group_rows,
    run_batch,
    wants_batch,
)
from edserve.bench.cli import add_bench
from edserve.chat_cli import add_chat
from edserve.config import CPU_RUNNING_DEFAULT, EngineConfig
from edserve.config_args import add_config_args, config_from_args
from edserve.integrations.ray_cli import add_serve_ray

OUTPUT_FORMATS = ("text", "json", "srt", "vtt", "verbose_json", "all")


def _add_transcribe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="Transcribe audio files of any length (Whisper).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="+", help="Audio files (wav, flac, mp3, ogg, m4a, ...), "
                   "folders, or manifests (.txt: one path a line; .jsonl: 'file' fields).")
    p.add_argument("--output-format", default="text", choices=OUTPUT_FORMATS,
                   help="text: one line per file; json: one JSON object per file per line "
                   "(file, text, duration, language, language_probability, segments[, words]); "
                   "srt/vtt: subtitles; all: every format (needs --output-dir).")
    p.add_argument("--output-dir", nargs="?", const="", default=None, metavar="DIR",
                   help="Write <name>.<ext> files into DIR (no DIR: next to each input) "
                   "instead of printing.")
    p.add_argument("--language", default=None,
                   help="Spoken language code (en, de, ...). Default: detected from the first "
                   "30 s by multilingual models (--model base); English-only models (tiny.en) "
                   "use en.")
    p.add_argument("--task", default="transcribe", choices=("transcribe", "translate"))
    p.add_argument("--temperature", type=float, default=0.0,
                   help="First temperature; windows fall back to +0.2 steps up to 1.0.")
    p.add_argument("--initial-prompt", default=None, help="Text to condition the first window.")
    p.add_argument("--condition-on-previous-text", action="store_true",
                   help="Prompt each 30 s window with the previous window's text.")
    p.add_argument("--word-timestamps", action="store_true",
                   help="Time every word (cross-attention alignment + DTW, as openai-whisper): "
                   "json and verbose_json carry 'words' (start, end; json also probability); "
                   "segment times follow the words; srt/vtt keep one cue per segment.")
    add_decoding_args(p)
    add_config_args(p, EngineConfig)
    add_batch_args(p)

    def check(args: argparse.Namespace) -> None:  # flags valid alone but not together
        if message := decoding_error(args):
            p.error(message)

    p.set_defaults(func=_run_transcribe, check=check)


def _write_outputs(result, fmt: str, output_dir: str | None) -> None:
    from pathlib import Path

    from edserve.whisper.formats import EXTENSIONS, FORMATTERS

    formats = [f for f in FORMATTERS if fmt == "all" or f == fmt]
    if output_dir is None:
        sys.stdout.write(FORMATTERS[fmt](result))
        return
    src = Path(result.source)
    folder = Path(output_dir) if output_dir else src.parent
    folder.mkdir(parents=True, exist_ok=True)
    for f in formats:
        path = folder / f"{src.stem}.{EXTENSIONS[f]}"
        path.write_text(FORMATTERS[f](result), encoding="utf-8")
        print(f"edserve: wrote {path}", file=sys.stderr)


def _run_transcribe(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edserve.audio.decode import load_audio
    from edserve.audio.errors import AudioError
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions, temperature_schedule
    from edserve.whisper.transcribe import transcribe

    if wants_batch(args):  # folders, manifests, --resume, --data-parallel-size
        return run_batch(args)
    if args.output_format == "all" and args.output_dir is None:
        print("edserve: --output-format all needs --output-dir", file=sys.stderr)
        return 2
    config = config_from_args(args, EngineConfig)
    # One request per file at a time: no more KV rows than files need (a smaller pool starts
    # faster); beam search and best_of decode a group of rows per file, and one group must fit.
    group = group_rows(args)
    rows = max(group, len(args.files) * group)
    limit = config.max_running_requests
    if limit is not None or rows <= CPU_RUNNING_DEFAULT:  # else auto sizes the rows
        config = config.replace(max_running_requests=rows if limit is None
                                else max(group, min(limit, rows)))
    try:
        engine = build_engine(config)
    except ValueError as exc:  # settings the device/model cannot run (--quantization, ...)
        print(f"edserve: {exc}", file=sys.stderr)
        return 2
    audios, names, failed = [], [], 0
    for path in args.files:
        try:
            audios.append(load_audio(path))
            names.append(path)
        except (AudioError, OSError) as exc:
            print(f"edserve: {exc}", file=sys.stderr)
            failed += 1
    timed = args.output_format not in ("text", "json")
    with tqdm(total=len(names), desc="transcribing", unit="file", file=sys.stderr,
              disable=len(names) < 2) as bar:
        try:
            options = TranscribeOptions(
                language=args.language, task=args.task,
                temperatures=temperature_schedule(args.temperature), seed=args.seed,
                initial_prompt=args.initial_prompt, timestamps=True if timed else None,
                condition_on_previous_text=args.condition_on_previous_text,
                word_timestamps=args.word_timestamps, **decoding_kwargs(args))
            results = transcribe(engine, audios, options=options,
                                 on_finish=lambda _: bar.update())
        except (AudioError, ValueError, RuntimeError) as exc:
            print(f"edserve: {exc}", file=sys.stderr)
            return 2
    for name, result in zip(names, results, strict=True):
        result.source = name
        _write_outputs(result, args.output_format, args.output_dir)
    return 1 if failed else 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from edserve.server.config import ServerConfig, server_flags_error

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/audio/transcriptions).")
    add_config_args(p, ServerConfig)
    add_config_args(p, EngineConfig)

    def check(args: argparse.Namespace) -> None:  # ServerConfig's checks (--beam-size 0, ...)
        if message := server_flags_error(args):
            p.error(message)

    p.set_defaults(func=_run_serve, check=check)


def _run_serve(args: argparse.Namespace) -> int:
    from edserve.server.config import ServerConfig
    from edserve.server.launch import build, run_built

    server_config = config_from_args(args, ServerConfig)
    try:
        aengine, app = build(config_from_args(args, EngineConfig), server_config)
    except ValueError as exc:  # settings the device/model cannot run, said as `transcribe` does
        print(f"edserve: {exc}", file=sys.stderr)
        return 2
    run_built(aengine, app, server_config,
              log_level=args.log_level if args.log_level.upper() != "WARNING" else "info")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="Python logging level.")
    sub = parser.add_subparsers(dest="command")
    _add_transcribe(sub)
    _add_serve(sub)
    add_serve_ray(sub)
    add_chat(sub)
    add_bench(sub)
    return parser


def console_main() -> None:
    """The ``edserve`` console script and ``python -m edserve``: :func:`main`, then the
    process ends without the interpreter's teardown (:mod:`edserve.process_exit`)."""
    from edserve.process_exit import run

    run(main)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        sys.exit(0)
    if check := getattr(args, "check", None):
        check(args)
    sys.exit(args.func(args))
