"""Command-line flags from the frozen config dataclasses: one ``--flag`` per field, its
documentation (``metadata["help"]``) as the help text, and the config built back from the
parsed flags."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from edserve.config import EngineConfig


def _or_auto(convert: type, kind: str):
    """An argparse type for fields that take ``auto`` (None) or ``convert(text)``."""
    def parse(text: str):
        if text == "auto":
            return None
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or {kind}, got {text!r}") from None
    return parse


_int_or_auto = _or_auto(int, "an integer")
_float_or_auto = _or_auto(float, "a number")


def add_config_args(parser: argparse.ArgumentParser, cls: type = EngineConfig,
                    skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per dataclass field, with the field's doc as help."""
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "")}
        if f.metadata.get("auto"):
            floats = f.type in ("float | None", float | None)
            kw["type"] = _float_or_auto if floats else _int_or_auto
            kw["metavar"] = "{auto,X}" if floats else "{auto,N}"
            kw["help"] += " (default: auto)"
        elif f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.type in ("bool", bool, "bool | None"):
            kw["action"] = argparse.BooleanOptionalAction
        elif "type" in kw:
            pass
        elif f.type in ("int", int, "int | None"):
            kw["type"] = int
        elif f.type in ("float", float):
            kw["type"] = float
        if kw["default"] is not None:
            kw["help"] += f" (default: {kw['default']})"
        parser.add_argument(flag, **kw)


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig) -> Any:
    """Build the frozen config from parsed ``--flags`` (absent fields keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**values)
