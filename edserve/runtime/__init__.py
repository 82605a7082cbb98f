"""The composition root: the one place that builds an engine from a config
(:func:`build_engine`). See :mod:`edserve.runtime.build` for the order of the steps."""

from edserve.runtime.build import build_engine
from edserve.runtime.settings import RuntimeSettings, resolve_settings

__all__ = ["RuntimeSettings", "build_engine", "resolve_settings"]
