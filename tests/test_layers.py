"""The package's import structure: no import cycles between files, and no import from a lower
layer up to a higher one (the layer order is the README's "Layout" section). Every import
counts: module level, inside functions, and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "edserve"

# Top to bottom; a module may import its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("edserve", "edserve.__main__", "edserve.cli", "edserve.api", "edserve.batch_cli",
     "edserve.chat_cli", "edserve.batch_run", "edserve.batch_output", "edserve.bench",
     "edserve.integrations"),
    ("edserve.server", "edserve.dp"),  # API process and engine worker processes
    ("edserve.runtime",),  # the composition root: builds engines
    ("edserve.parallel",),  # tensor-parallel transform and rank loop
    ("edserve.whisper", "edserve.chat"),  # drivers over an engine client
    ("edserve.engine",),
    ("edserve.models",),
    ("edserve.multimodal",),  # image and prompt preprocessing the models use
    ("edserve.layers",),
    ("edserve.mem_cache",),
    ("edserve.kernels",),
    ("edserve.audio", "edserve.tokenizer", "edserve.token_bytes", "edserve.config",
     "edserve.config_args",
     "edserve.config_checks", "edserve.os_names"),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The edserve modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            if len(subs) < len(node.names):
                found.add(base)
            found.update(subs)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS (and the README)"
    return rank


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_runs_up_a_layer():
    up = [f"{a} -> {b}" for a, deps in sorted(GRAPH.items()) for b in sorted(deps)
          if _layer(b) < _layer(a)]
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(up)


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("cycle", [("edserve.chat.chat_api", "edserve.chat.mllama_chat")])
def test_the_walker_sees_imports(cycle):
    """The walker resolves real imports (guards against a checker that sees nothing)."""
    a, b = cycle
    assert b in GRAPH[a]
    assert "edserve.engine.request" in GRAPH["edserve.chat.chat_api"]
