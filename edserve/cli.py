"""Command line: ``edserve transcribe FILE...`` and ``edserve serve``.

Engine flags come from :class:`edserve.config.EngineConfig`; their help text is the field docs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from edserve.config import EngineConfig, add_config_args, config_from_args


def _add_transcribe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="Transcribe audio files (Whisper).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="+", help="Audio files (wav, flac, mp3, ogg, m4a, ...).")
    p.add_argument("--output-format", default="text", choices=("text", "json", "srt", "vtt"),
                   help="text: one line per file; json: one JSON object per file per line.")
    p.add_argument("--language", default=None, help="Spoken language code (default: en).")
    p.add_argument("--task", default="transcribe", choices=("transcribe", "translate"))
    p.add_argument("--temperature", type=float, default=0.0)
    add_config_args(p, EngineConfig)
    p.set_defaults(func=_run_transcribe)


def _run_transcribe(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edserve.audio.decode import load_audio
    from edserve.audio.errors import AudioError
    from edserve.engine.engine import Engine
    from edserve.whisper.formats import FORMATTERS
    from edserve.whisper.transcribe import transcribe

    engine = Engine(config_from_args(args, EngineConfig))
    audios, names, failed = [], [], 0
    for path in args.files:
        try:
            audios.append(load_audio(path))
            names.append(path)
        except (AudioError, OSError) as exc:
            print(f"edserve: {exc}", file=sys.stderr)
            failed += 1
    fmt = FORMATTERS[args.output_format]
    with tqdm(total=len(names), desc="transcribing", unit="file", file=sys.stderr,
              disable=len(names) < 2) as bar:
        try:
            results = transcribe(engine, audios, language=args.language, task=args.task,
                                 temperature=args.temperature, on_finish=lambda _: bar.update())
        except (AudioError, ValueError) as exc:
            print(f"edserve: {exc}", file=sys.stderr)
            return 2
    for name, result in zip(names, results, strict=True):
        result.source = name
        sys.stdout.write(fmt(result))
    return 1 if failed else 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from edserve.server.config import ServerConfig

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/audio/transcriptions).")
    add_config_args(p, ServerConfig)
    add_config_args(p, EngineConfig)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from edserve.server.config import ServerConfig
    from edserve.server.launch import serve

    serve(config_from_args(args, EngineConfig), config_from_args(args, ServerConfig),
          log_level=args.log_level if args.log_level.upper() != "WARNING" else "info")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="Python logging level.")
    sub = parser.add_subparsers(dest="command")
    _add_transcribe(sub)
    _add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        sys.exit(0)
    sys.exit(args.func(args))
