"""Reading an upload's form: Starlette's multipart parser with the file kept in memory.

Starlette spools a file part to a temporary file past 1 MiB, and from then on hands every
received chunk (64 KiB) to a worker thread to write it: a 19 MB upload (10 minutes of 16 kHz
WAV) costs ~120 ms of the event loop's time in ~300 thread round trips. In memory (a
``BytesIO``), 16 such uploads at once spent half the API process's time growing their buffers
(each growth by 1/8 copies the whole buffer once the allocator stops remapping). The route
reads the whole file into memory right after (:func:`~edserve.server.params.parse_form`), so
:func:`read_form` keeps a file part as the list of its received chunks (:class:`ChunkedFile`),
joined in one copy when it is read; what one request can hold is still bounded by the body
limit (``--max-upload-mb``, 413 past it).
"""

from __future__ import annotations

from fastapi import Request
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from edserve.server.errors import APIError


class ChunkedFile:
    """The file object behind an in-memory ``UploadFile``: ``write`` keeps each chunk,
    the first ``read`` joins them (one copy). Supports what ``UploadFile`` calls: write,
    tell, seek (absolute), read, close."""

    _rolled = False  # UploadFile: in memory, so its methods call ours on the event loop

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._data: bytes | None = None
        self._pos = 0

    def write(self, data: bytes) -> int:
        if self._data is not None:
            raise ValueError("ChunkedFile is read-only once read")
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
        if self._data is None:
            self._data, self._chunks = b"".join(self._chunks), []
        end = len(self._data) if size < 0 else min(len(self._data), self._pos + size)
        out = self._data[self._pos:end]  # the whole of it: the same object, no copy
        self._pos = max(self._pos, end)
        return out

    def close(self) -> None:
        self._chunks, self._data = [], None


class _InMemoryParser(MultiPartParser):
    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        upload = self._current_part.file
        if upload is not None:  # a file part: keep its chunks, not a spooled file
            upload.file = ChunkedFile()


async def read_form(request: Request, *, max_files: int, max_fields: int,
                    max_part_size: int) -> FormData:
    """The request's form (``request.form()``'s limits); a multipart file part is held in
    memory as its chunks (:class:`ChunkedFile`). APIError 400 for a malformed multipart
    body."""
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
