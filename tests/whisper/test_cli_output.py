"""``edserve transcribe`` writes every format with --output-dir (same long-form path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edserve.cli import main

DATA = Path(__file__).parent.parent / "data"


def test_output_dir_all_formats(tmp_path, capsys):
    src = tmp_path / "in" / "cards_005.wav"
    src.parent.mkdir()
    shutil.copy(DATA / "cards_005.wav", src)
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", str(src), "--output-format", "all", "--output-dir"])
    assert exit_info.value.code == 0
    names = sorted(p.name for p in src.parent.iterdir())
    assert names == ["cards_005.json", "cards_005.srt", "cards_005.txt", "cards_005.verbose.json",
                     "cards_005.vtt", "cards_005.wav"]
    row = json.loads((src.parent / "cards_005.json").read_text())
    assert "spades" in row["text"] and row["file"] == str(src)
    verbose = json.loads((src.parent / "cards_005.verbose.json").read_text())
    assert verbose["segments"] and verbose["segments"][-1]["end"] <= 3.51
    assert (src.parent / "cards_005.srt").read_text().startswith("1\n00:00:00")
    assert capsys.readouterr().out == ""  # nothing on stdout when writing files


def test_output_format_all_needs_dir(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", str(DATA / "cards_005.wav"), "--output-format", "all"])
    assert exit_info.value.code == 2
