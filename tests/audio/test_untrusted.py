"""Uploads cannot make FFmpeg read other files: concat scripts, HLS playlists, images refused.

A FIFO is the tripwire: FFmpeg opening it for reading blocks until a writer appears, and the
watcher thread below is that writer, so any open of the FIFO is seen (no race, no hang).
"""

from __future__ import annotations

import errno
import io
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import av
import numpy as np
import pytest

from edserve.audio.decode import UNTRUSTED_DECODE_MESSAGE, load_audio
from edserve.audio.errors import AudioDecodeError
from edserve.audio.formats import ALLOWED_DEMUXERS

DATA = Path(__file__).resolve().parents[1] / "data"
JFK = DATA / "jfk.wav"
REPO = DATA.parents[1]


class FifoTripwire:
    """A FIFO ``secret.wav`` that records whether anyone opened it (and then feeds it jfk)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "secret.wav"
        os.mkfifo(self.path)
        self.opened = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:  # succeeds only while a reader has the FIFO open
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO
                time.sleep(0.001)
                continue
            self.opened.set()
            os.set_blocking(fd, True)
            try:
                os.write(fd, JFK.read_bytes())
            except BrokenPipeError:
                pass
            os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def tripwire(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names in the payloads resolve to the FIFO
    wire = FifoTripwire(tmp_path)
    yield wire
    wire.close()


def _concat(target: str) -> bytes:
    return f"ffconcat version 1.0\nfile {target}\n".encode()


def _hls(target: str) -> bytes:
    return (f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:20\n#EXTINF:11.0,\n{target}\n"
            "#EXT-X-ENDLIST\n").encode()


PAYLOADS = {
    "concat-relative": lambda secret: _concat("secret.wav"),
    "concat-absolute": lambda secret: _concat(str(secret)),
    "hls-relative": lambda secret: _hls("secret.wav"),
    "hls-absolute": lambda secret: _hls(str(secret)),
    "hls-file-url": lambda secret: _hls(f"file:{secret}"),
}


class NamedBytes(io.BytesIO):
    """An upload whose client-chosen name hints at a playlist (FFmpeg's probe uses names)."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.name = name


def _assert_generic_refusal(excinfo) -> None:
    message = str(excinfo.value)
    assert message == UNTRUSTED_DECODE_MESSAGE
    assert "/" not in message and "secret" not in message and "jfk" not in message
    assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__


def test_the_tripwire_sees_plain_ffmpeg_follow_a_concat_script(tripwire):
    """Control: without the allow-list, FFmpeg reads the file the script names."""
    with av.open(io.BytesIO(_concat("secret.wav"))) as container:
        samples = sum(f.samples for f in container.decode(audio=0))
    assert tripwire.opened.is_set() and samples == 176000


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("wrap", ["bytes", "named-m3u8", "named-ffconcat"])
def test_scripts_and_playlists_are_refused_without_reading(tripwire, payload, wrap):
    data = PAYLOADS[payload](tripwire.path)
    source = {"bytes": data, "named-m3u8": NamedBytes(data, "upload.m3u8"),
              "named-ffconcat": NamedBytes(data, "list.ffconcat")}[wrap]
    with pytest.raises(AudioDecodeError) as excinfo:
        load_audio(source, untrusted=True)
    _assert_generic_refusal(excinfo)
    time.sleep(0.02)  # give the watcher a few polls
    assert not tripwire.opened.is_set()


@pytest.mark.parametrize("payload", ["concat-relative", "hls-absolute"])
def test_trusted_paths_are_not_followed_either(tripwire, tmp_path, payload):
    """The CLI gets the same allow-list; its messages may name the file it was given."""
    script = tmp_path / ("list.ffconcat" if payload.startswith("concat") else "list.m3u8")
    script.write_bytes(PAYLOADS[payload](tripwire.path))
    with pytest.raises(AudioDecodeError, match=script.name):
        load_audio(script)
    time.sleep(0.02)
    assert not tripwire.opened.is_set()


@pytest.mark.parametrize(
    "data",
    [
        _concat("tests/data/jfk.wav"),
        _concat(str(JFK)),
        _hls("tests/data/jfk.wav"),
        _hls(str(JFK)),
    ],
    ids=["concat-relative", "concat-absolute", "hls-relative", "hls-absolute"],
)
def test_the_probe_payloads_against_the_bundled_clip(monkeypatch, data):
    """The security probe's exact uploads (run from the repo root): refused, no samples."""
    monkeypatch.chdir(REPO)
    with pytest.raises(AudioDecodeError) as excinfo:
        load_audio(data, untrusted=True)
    assert str(excinfo.value) == UNTRUSTED_DECODE_MESSAGE


def _png(width: int = 4, height: int = 4) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    rows = b"".join(b"\x00" + bytes(3 * width) for _ in range(height))  # filter 0, RGB black
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def test_png_is_a_real_image_for_ffmpeg_and_refused():
    png = _png()
    with av.open(io.BytesIO(png)) as container:  # FFmpeg itself would happily open it
        assert container.format.name not in ALLOWED_DEMUXERS
    with pytest.raises(AudioDecodeError) as excinfo:
        load_audio(png, untrusted=True)
    assert str(excinfo.value) == UNTRUSTED_DECODE_MESSAGE


@pytest.mark.parametrize(
    "data",
    [
        np.random.default_rng(0).bytes(4096),
        JFK.read_bytes()[:30],
        b"this is a text file, not audio\n" * 20,
        b"\x00" * 100,
        b"/etc/passwd\n",
    ],
    ids=["random", "truncated-wav", "text", "zeros", "a-path"],
)
def test_every_undecodable_upload_gets_the_same_message(data):
    with pytest.raises(AudioDecodeError) as excinfo:
        load_audio(data, untrusted=True)
    assert str(excinfo.value) == UNTRUSTED_DECODE_MESSAGE


def test_untrusted_paths_do_not_reveal_what_exists(tmp_path):
    messages = set()
    for path in (tmp_path / "missing.wav", tmp_path, Path("/etc/passwd")):
        with pytest.raises(AudioDecodeError) as excinfo:
            load_audio(path, untrusted=True)
        messages.add(str(excinfo.value))
    assert messages == {UNTRUSTED_DECODE_MESSAGE}


def test_untrusted_bytes_of_a_real_clip_still_decode():
    np.testing.assert_array_equal(load_audio(JFK.read_bytes(), untrusted=True), load_audio(JFK))
