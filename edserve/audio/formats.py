"""Open audio containers safely: an allow-list of demuxers and no way to reach other files.

FFmpeg's format auto-detection also knows "demuxers" that are really instructions to open
*other* inputs: the ``concat`` script (``ffconcat version 1.0`` / ``file x.wav``), HLS and DASH
playlists, ``image2`` sequences, ``tee``-like and ``*_pipe`` readers. Fed an upload, those read
files from the server's disk (or URLs). :func:`open_container` closes every such door:

1. The input is always a Python file object (a path is opened with ``open()`` here), so FFmpeg
   never resolves a name itself: no ``file:``/``http:`` protocol is involved for the main input.
2. ``format_whitelist`` (an AVFormatContext option) makes ``avformat_open_input`` refuse any
   probed demuxer that is not in :data:`ALLOWED_DEMUXERS` *before* its ``read_header`` runs,
   i.e. before a script or playlist is parsed.
3. ``protocol_whitelist`` is empty, and nested contexts inherit it (``ff_copy_whiteblacklists``):
   a demuxer that tries ``avio_open``/``avformat_open_input`` on another name fails.
4. ``io_open`` is a callback that refuses every secondary open (the path HLS/DASH use).
5. After opening, the demuxer's name is checked again, exactly, in Python.

The allowed demuxers only read the bytes they are given (``mov``'s external data references
stay off: ``enable_drefs`` defaults to 0).
"""

from __future__ import annotations

from typing import BinaryIO

import av

#: FFmpeg input-format names (``AVInputFormat.name``, exactly as FFmpeg spells them) of the
#: audio and audio/video containers accepted. None of them opens another file or URL.
ALLOWED_DEMUXERS: frozenset[str] = frozenset({
    "wav", "w64", "aiff", "au", "caf",                 # PCM containers
    "flac", "wv", "ape", "tta",                        # lossless
    "mp3", "aac", "ac3", "eac3", "dts", "amr", "amrnb", "amrwb",  # raw elementary streams
    "ogg",                                             # vorbis, opus, flac, speex in Ogg
    "matroska,webm",                                   # mka, mkv, webm
    "mov,mp4,m4a,3gp,3g2,mj2",                         # m4a, mp4, mov, 3gp (drefs off)
    "asf",                                             # wma, wmv
    "mpegts", "mpeg",                                  # transport / program streams
    "avi", "flv",
})

#: Demuxers whose declared duration comes from the header or an index (not a bitrate guess):
#: trusted for an early "too long" refusal before any packet is decoded.
EXACT_DURATION_DEMUXERS: frozenset[str] = frozenset({
    "wav", "w64", "aiff", "caf", "flac", "wv", "ape", "tta", "ogg",
    "matroska,webm", "mov,mp4,m4a,3gp,3g2,mj2",
})

_CONTAINER_OPTIONS = {
    "format_whitelist": ",".join(sorted(ALLOWED_DEMUXERS)),
    "protocol_whitelist": "",  # nothing: the only input is our own file object
}
_BUFFER_SIZE = 1 << 16


class UnsupportedFormatError(Exception):
    """The bytes are not one of :data:`ALLOWED_DEMUXERS` (internal; mapped by the caller)."""


class ForbiddenOpenError(PermissionError):
    """A demuxer tried to open a second file or URL (refused by :func:`_refuse_io_open`)."""


def _refuse_io_open(url: str, flags: int, options: dict) -> BinaryIO:
    """``io_open`` callback: every secondary open (playlist segment, script entry) is refused."""
    raise ForbiddenOpenError("opening other files or URLs is not allowed")


def open_container(file: BinaryIO) -> av.container.InputContainer:
    """Open ``file`` (a readable binary file object) as an input container, allow-list enforced.

    Raises :class:`UnsupportedFormatError` when the probed demuxer is not allowed, and
    ``av.FFmpegError`` / ``OSError`` / ``ValueError`` when FFmpeg cannot open the bytes.
    Nothing but ``file`` is ever read. The caller closes the container.
    """
    try:
        container = av.open(
            file, mode="r", container_options=_CONTAINER_OPTIONS, io_open=_refuse_io_open,
            metadata_errors="ignore", buffer_size=_BUFFER_SIZE,
        )
    except av.ArgumentError as e:  # EINVAL: "Format not on whitelist" (or bad options)
        raise UnsupportedFormatError("not an allowed audio container format") from e
    name = container.format.name
    if name not in ALLOWED_DEMUXERS:  # defence in depth; format_whitelist already refused
        container.close()
        raise UnsupportedFormatError(f"container format {name!r} is not allowed")
    return container


def declared_seconds(
    container: av.container.InputContainer, stream: av.audio.AudioStream
) -> float | None:
    """Duration the container declares for ``stream`` (seconds), when it is exact; else None.

    Only demuxers in :data:`EXACT_DURATION_DEMUXERS` count: others (mp3, aac, mpegts, ...) may
    estimate from the bitrate, which can overshoot a file that is within a limit.
    """
    if container.format.name not in EXACT_DURATION_DEMUXERS:
        return None
    if stream.duration is not None and stream.duration > 0 and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / av.time_base
    return None
