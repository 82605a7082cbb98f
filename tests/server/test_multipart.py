"""``read_form``: an upload's file part kept as its chunks, spilled to a temporary file past
its first MiB, read back whole in one piece; malformed bodies are a 400 (the routes' tests
cover the HTTP answers)."""

from __future__ import annotations

import asyncio
import gc
import warnings

import httpx
import pytest
from starlette.requests import Request

from edserve.server.errors import APIError
from edserve.server.multipart import ChunkedFile, read_form


@pytest.mark.parametrize("memory_bytes", [1 << 20, 4])  # in memory; spilled to a file
def test_chunked_file_reads_back_what_was_written(memory_bytes):
    f = ChunkedFile(memory_bytes)
    for part in (b"abc", b"", b"defg"):
        f.write(part)
    assert f.tell() == 7
    f.seek(0)
    assert f.read(2) == b"ab" and f.read() == b"cdefg" and f.read() == b""
    f.seek(0)
    whole = f.read(100)
    assert whole == b"abcdefg" and f.read(1) == b""
    with pytest.raises(ValueError):
        f.write(b"more")  # read-only once read
    with pytest.raises(ValueError):
        f.seek(1, 1)
    f.close()


def _request(body: bytes, content_type: str, chunk: int = 65536) -> Request:
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def receive():
        data = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": data, "more_body": bool(chunks)}

    return Request({"type": "http", "method": "POST", "path": "/",
                    "headers": [(b"content-type", content_type.encode())]}, receive)


def test_a_large_file_part_arrives_whole_and_fields_too(monkeypatch):
    import starlette.datastructures

    def no_thread_hop(*args, **kwargs):
        raise AssertionError("a chunk went through a worker thread")

    monkeypatch.setattr(starlette.datastructures, "run_in_threadpool", no_thread_hop)
    payload = bytes(range(256)) * 40000  # 10 MB over many 64 KiB chunks
    req = httpx.Request("POST", "http://x/", files={"file": ("a.wav", payload)},
                        data={"model": "whisper-1"})
    body, ctype = req.read(), req.headers["content-type"]

    async def go():
        form = await read_form(_request(body, ctype), max_files=4, max_fields=64,
                               max_part_size=65536)
        upload = form["file"]
        assert isinstance(upload.file, ChunkedFile) and upload.size == len(payload)
        assert upload.file._disk is not None  # past MEMORY_BYTES: in a temporary file
        data = await upload.read(len(payload) + 1)
        await form.close()
        return form["model"], data

    model, data = asyncio.run(go())
    assert model == "whisper-1" and data == payload


def test_reading_and_closing_a_form_leaves_no_unclosed_file():
    """The parser's own spooled file for a part is closed when ChunkedFile replaces it (it was
    left to the garbage collector: one ResourceWarning per upload)."""
    req = httpx.Request("POST", "http://x/", files={"file": ("a.wav", b"RIFF" * 100)},
                        data={"model": "whisper-1"})
    body, ctype = req.read(), req.headers["content-type"]

    async def go():
        form = await read_form(_request(body, ctype), max_files=4, max_fields=64,
                               max_part_size=65536)
        assert await form["file"].read() == b"RIFF" * 100
        await form.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(go())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], \
        [str(w.message) for w in caught]


def test_malformed_multipart_is_a_400():
    async def go():
        await read_form(_request(b"garbage", "multipart/form-data"), max_files=4,
                        max_fields=64, max_part_size=65536)

    with pytest.raises(APIError) as info:
        asyncio.run(go())
    assert info.value.status == 400 and "multipart" in info.value.message
