"""``edserve chat``: one chat completion with a Llama-3.2-Vision model from the command line.

  edserve chat --model PATH --image cat.png "What is in the image?"
  edserve chat --model PATH --json-schema schema.json --output json "Describe it as JSON"

Prints the answer's text (``--output json``: one JSON object with ``text``, ``finish_reason``,
``usage`` and, with tools, ``tool_calls``). Engine flags are
:class:`~edserve.config.EngineConfig`'s (give ``--context-length`` on the CPU; ``--seed`` seeds
sampling). Bad input (not an Mllama model, an unreadable image, a schema llguidance cannot
use) exits with status 2 and a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edserve.config import EngineConfig
from edserve.config_args import add_config_args, config_from_args


def add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="One chat completion with a Llama-3.2-Vision model "
                       "(images, JSON output, function calls).")
    p.add_argument("prompt", help="The user message's text.")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="An image placed before the text (repeat for several, at most 4).")
    p.add_argument("--system", default=None, help="A system message (text-only prompts).")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    p.add_argument("--stop", action="append", default=None, help="A stop string (repeatable).")
    p.add_argument("--json-object", action="store_true", help="Answer one JSON object.")
    p.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="Answer JSON valid against this schema (a file or inline JSON).")
    p.add_argument("--tools", default=None, metavar="FILE|JSON",
                   help="OpenAI 'tools' list (a file or inline JSON); calls are printed with "
                   "--output json.")
    p.add_argument("--tool-choice", default=None,
                   help="none, auto, required, or a function name.")
    p.add_argument("--no-parallel-tool-calls", dest="parallel_tool_calls", action="store_false",
                   help="At most one call per answer (OpenAI's parallel_tool_calls=false); "
                   "by default --tool-choice required may write several.")
    p.add_argument("--compact-json", action="store_true",
                   help="No whitespace inside grammar-constrained JSON.")
    p.add_argument("--output", default="text", choices=("text", "json"))
    add_config_args(p, EngineConfig)
    p.set_defaults(func=run_chat)


def _json_arg(value: str, flag: str):
    path = Path(value)
    text = path.read_text() if path.is_file() else value
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: neither a JSON file nor inline JSON ({exc})") from None


def _options(args: argparse.Namespace) -> dict:
    fmt = None
    if args.json_schema is not None:
        fmt = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": _json_arg(args.json_schema, "--json-schema")}}
    elif args.json_object:
        fmt = {"type": "json_object"}
    choice = args.tool_choice
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop,
                response_format=fmt, tool_choice=choice,
                parallel_tool_calls=args.parallel_tool_calls,
                tools=_json_arg(args.tools, "--tools") if args.tools else None,
                json_whitespace=not args.compact_json)


def _messages(args: argparse.Namespace) -> list[dict]:
    content = [{"type": "image", "image": path} for path in args.image]
    content.append({"type": "text", "text": args.prompt})
    system = [{"role": "system", "content": args.system}] if args.system else []
    return system + [{"role": "user", "content": content}]


def run_chat(args: argparse.Namespace) -> int:
    from edserve.chat.chat_api import chat
    from edserve.runtime import build_engine

    try:
        options = _options(args)
        engine = build_engine(config_from_args(args, EngineConfig))
        result = chat(engine, _messages(args), **options)
    except (ValueError, OSError) as exc:
        print(f"edserve chat: {exc}", file=sys.stderr)
        return 2
    if args.output == "text":
        print(result.text)
        return 0
    out = {"text": result.text, "finish_reason": result.finish_reason, "usage": result.usage}
    if result.tool_calls:
        out["tool_calls"] = [c.openai() for c in result.tool_calls]
    print(json.dumps(out, ensure_ascii=False))
    return 0
