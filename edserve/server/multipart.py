"""Reading an upload's form: Starlette's multipart parser without a thread hop per chunk.

Starlette spools a file part to a temporary file past 1 MiB, and from then on hands every
received chunk (64 KiB) to a worker thread to write it: a 19 MB upload (10 minutes of 16 kHz
WAV) costs ~120 ms of the event loop's time in ~300 thread round trips. Kept in a ``BytesIO``
instead, 16 such uploads at once spent half the API process's time growing their buffers
(each growth by 1/8 copies the whole buffer once the allocator stops remapping).
:func:`read_form` gives a file part a :class:`ChunkedFile`: its first MiB as the received
chunks, the rest written to a temporary file from the event loop (no thread hop), read back in
one piece. A request waiting for the pending-audio budget therefore still holds its upload in
the page cache / on disk, not in memory (:class:`~edserve.server.guards.PendingBudget`).
"""

from __future__ import annotations

import tempfile
from typing import BinaryIO

from fastapi import Request
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from edserve.server.errors import APIError

#: Bytes of a file part kept in memory before the rest goes to a temporary file (Starlette's).
MEMORY_BYTES = 1 << 20


class ChunkedFile:
    """The file object behind an upload part's ``UploadFile``: the first
    :data:`MEMORY_BYTES` as received chunks, the rest written straight (on the event loop: a
    page-cache write of one chunk is ~10 us, a thread hop ~0.4 ms) to an anonymous temporary
    file, so an upload waiting for the pending-audio budget stays out of memory. Supports what
    ``UploadFile`` calls: write, tell, seek (absolute), read, close."""

    _rolled = False  # UploadFile: call our methods on the event loop, no thread hops

    def __init__(self, memory_bytes: int | None = None) -> None:
        self._memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._chunks: list[bytes] = []
        self._disk: BinaryIO | None = None
        self._size = 0
        self._data: bytes | None = None
        self._pos = 0

    def write(self, data: bytes) -> int:
        if self._data is not None:
            raise ValueError("ChunkedFile is read-only once read")
        if self._disk is None and self._size + len(data) > self._memory_bytes:
            self._disk = tempfile.TemporaryFile()
            self._disk.writelines(self._chunks)
            self._chunks = []
        if self._disk is not None:
            self._disk.write(data)
        else:
            self._chunks.append(data)
        self._size += len(data)
        return len(data)

    def tell(self) -> int:
        return self._size if self._data is None else self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < 0:
            raise ValueError("ChunkedFile seeks to absolute positions only")
        self._pos = offset
        return offset

    def read(self, size: int = -1) -> bytes:
        if self._data is None:  # one copy of the whole part (one read of the file)
            if self._disk is not None:
                self._disk.seek(0)
                self._data = self._disk.read()
                self._disk.close()
                self._disk = None
            else:
                self._data = b"".join(self._chunks)
            self._chunks = []
        end = len(self._data) if size < 0 else min(len(self._data), self._pos + size)
        out = self._data[self._pos:end]  # the whole of it: the same object, no copy
        self._pos = max(self._pos, end)
        return out

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        self._chunks, self._data = [], None


class _InMemoryParser(MultiPartParser):
    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        upload = self._current_part.file
        if upload is not None:  # a file part: a ChunkedFile, not a spooled file
            upload.file.close()  # the parser's spooled file, unused (else a ResourceWarning)
            upload.file = ChunkedFile()
            upload._max_mem_size = 0  # UploadFile read the spooled file's; ours never rolls


async def read_form(request: Request, *, max_files: int, max_fields: int,
                    max_part_size: int) -> FormData:
    """The request's form (``request.form()``'s limits); a multipart file part is a
    :class:`ChunkedFile`. APIError 400 for a malformed multipart body."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data":
        return await request.form(max_files=max_files, max_fields=max_fields,
                                  max_part_size=max_part_size)
    parser = _InMemoryParser(request.headers, request.stream(), max_files=max_files,
                             max_fields=max_fields, max_part_size=max_part_size)
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"malformed multipart body: {exc.message}") from None
