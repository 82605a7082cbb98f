"""Shared-memory upload slots (:mod:`edserve.server.upload_slots`): bytes in equal bytes out,
a slot is reused only after it is freed, uploads that do not fit are refused (the caller then
uses the pipe), and the file goes with ``close``."""

from __future__ import annotations

import os
import threading

import pytest

from edserve.server.upload_slots import SlotReader, UploadSlots


@pytest.fixture
def slots(tmp_path):
    s = UploadSlots(count=3, size=64, folder=str(tmp_path))
    yield s
    s.close()


def test_put_then_read_gives_the_bytes(slots):
    reader = SlotReader()
    refs = [slots.put(bytes([i]) * (10 + i)) for i in range(3)]
    assert len({r.slot for r in refs}) == 3 and slots.num_free == 0
    for i, r in enumerate(refs):
        assert reader.read(r) == bytes([i]) * (10 + i)
    full = slots.put(b"x" * 64)  # every slot taken
    assert full is None
    slots.free(refs[1])
    again = slots.put(b"y" * 64)  # exactly a slot's size fits
    assert again.slot == refs[1].slot and reader.read(again) == b"y" * 64
    assert reader.read(refs[0]) == bytes([0]) * 10  # the others untouched


def test_too_large_is_refused_and_takes_no_slot(slots):
    assert slots.put(b"z" * 65) is None and slots.num_free == 3


def test_free_from_another_thread(slots):
    refs = [slots.put(b"a") for _ in range(3)]
    threads = [threading.Thread(target=slots.free, args=(r,)) for r in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slots.num_free == 3


def test_close_removes_the_file(tmp_path):
    s = UploadSlots(count=2, size=16, folder=str(tmp_path))
    assert os.path.getsize(s.path) == 32
    s.close()
    assert not os.path.exists(s.path)
    s.close()  # twice: nothing to do
