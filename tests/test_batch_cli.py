"""``edserve transcribe`` in batch: folders and manifests, ``--data-parallel-size 2`` and
``--resume`` after an interruption giving the same outputs as one pass."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dp.reference import CLIPS, DATA, single_engine_texts

from edserve.batch_cli import expand_inputs


def _clips(folder: Path, n: int) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(n):
        paths.append(folder / f"clip_{i:02d}.wav")
        shutil.copy(DATA / f"{CLIPS[i % len(CLIPS)]}.wav", paths[-1])
    return paths


def test_expand_inputs_folders_and_manifests(tmp_path):
    paths = _clips(tmp_path / "a", 3)
    (tmp_path / "a" / "notes.md").write_text("not audio")
    (tmp_path / "list.txt").write_text("# a comment\na/clip_02.wav\n\n" + f"{paths[0]}\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"file": "a/clip_01.wav"}) + "\n")
    got = expand_inputs([str(tmp_path / "list.txt"), str(tmp_path / "list.jsonl"),
                         str(tmp_path / "a")])
    assert got == [str(paths[2]), str(paths[0]), str(paths[1])]


def _run(manifest: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "edserve", "transcribe", str(manifest), "--output-format",
            "json", "--output-dir", str(out), "--data-parallel-size", "2", *extra]


def test_manifest_dp2_resume_after_interruption_equals_one_pass(tmp_path):
    paths = _clips(tmp_path / "audio", 12)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"file": f"audio/{p.name}"}) + "\n" for p in paths))
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_run(manifest, one), check=True, timeout=300)
    proc = subprocess.Popen(_run(manifest, two), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list(two.glob("*.json"))) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    done = sorted(two.glob("*.json"))
    assert proc.returncode != 0 and 3 <= len(done) < 12, (proc.returncode, len(done))
    assert not list(two.glob(".*.tmp"))  # written atomically: no partial outputs
    resumed = subprocess.run(_run(manifest, two, "--resume"), check=True, timeout=300,
                             stderr=subprocess.PIPE, text=True)
    assert f"{len(done)} of 12 inputs already done" in resumed.stderr
    expected = single_engine_texts()
    for i, p in enumerate(paths):
        a, b = (one / f"{p.stem}.json").read_text(), (two / f"{p.stem}.json").read_text()
        assert a == b
        assert json.loads(a)["text"] == expected[CLIPS[i % len(CLIPS)]]


def test_write_atomic_leaves_no_temporary_file_when_interrupted(tmp_path, monkeypatch):
    from edserve import batch_output

    target = tmp_path / "out" / "clip.json"
    batch_output.write_atomic(target, "first")

    def interrupted(src, dst):  # SIGTERM (as Ctrl-C) lands between the write and the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_output.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        batch_output.write_atomic(target, "second")
    assert target.read_text() == "first"  # the old output is whole
    assert not list(target.parent.glob(".*.tmp"))
