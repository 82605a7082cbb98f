"""``edserve bench``'s inputs and schedule: manifests expand like ``edserve transcribe``'s,
durations come from edserve's decoder, undecodable files stay in (duration 0), the Poisson
schedule is seeded and has the asked rate."""

from __future__ import annotations

import numpy as np
import pytest
from whisper_fixtures import DATA

from edserve.bench.load import arrival_offsets, load_items, request_plan


def test_items_from_files_manifest_and_corrupt(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00not audio at all" * 10)
    manifest = tmp_path / "list.txt"
    manifest.write_text(f"{DATA / 'jfk.wav'}\n# comment\nbad.wav\n")
    items = load_items([str(manifest), str(DATA / "cards_005.wav")])
    assert [i.name for i in items] == ["jfk.wav", "bad.wav", "cards_005.wav"]
    assert items[0].seconds == pytest.approx(11.0, abs=0.01)
    assert items[1].seconds == 0.0 and items[1].data == bad.read_bytes()
    assert [i.name for i in request_plan(items, 5)] == \
        ["jfk.wav", "bad.wav", "cards_005.wav", "jfk.wav", "bad.wav"]
    with pytest.raises(ValueError, match="cannot read"):
        load_items([str(tmp_path / "missing.wav")])


def test_poisson_offsets_are_seeded_with_the_asked_rate():
    a = arrival_offsets(4000, 50.0, seed=1)
    assert a == arrival_offsets(4000, 50.0, seed=1) and a != arrival_offsets(4000, 50.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.06)
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.1)  # exponential: std = mean
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)
