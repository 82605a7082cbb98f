"""CTranslate2's ``model.bin`` container (binary version 6), parsed exactly.

Layout (little-endian; a string is ``u16 length`` counting a trailing NUL, the bytes, NUL)::

    u32 binary_version (6) | string spec_name | u32 spec_revision | u32 num_variables
    num_variables x [ string name | u8 rank | rank x u32 dim | u8 dtype | u32 nbytes | data ]
    u32 num_aliases | num_aliases x [ string alias | string target ]

The whole file is read into memory once; each tensor is copied out of it with one
``numpy.frombuffer`` call (so it is aligned and owns its memory). Anything that does not
parse to exactly the end of the file raises :class:`WeightsError` naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edserve.models.weights.errors import WeightsError

BINARY_VERSION = 6

# CTranslate2 dtype code -> (little-endian numpy dtype of the stored bytes, torch dtype).
_DTYPES: dict[int, tuple[str, torch.dtype]] = {
    0: ("<f4", torch.float32),
    1: ("<i1", torch.int8),
    2: ("<i2", torch.int16),
    3: ("<i4", torch.int32),
    4: ("<f2", torch.float16),
    5: ("<u2", torch.bfloat16),  # numpy has no bfloat16: read the bits, view as bfloat16
}


@dataclass(frozen=True)
class Ct2Model:
    """The raw contents of a ``model.bin``; ``aliases`` maps an alias name to its target."""

    spec_name: str
    spec_revision: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str]


class _Cursor:
    """Bounds-checked little-endian reads over the file's bytes."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data = data
        self.pos = 0
        self.path = path

    def error(self, what: str, at: int | None = None) -> WeightsError:
        at = self.pos if at is None else at
        return WeightsError(f"{self.path}: {what} (at byte {at} of {len(self.data)})")

    def take(self, n: int, what: str) -> int:
        """Advance by ``n`` bytes; returns the start offset."""
        if self.pos + n > len(self.data):
            raise self.error(f"truncated file: {what} needs {n} bytes")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.data, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("H", f"length of {what}")
        start = self.take(n, what)
        raw = self.data[start : start + n]
        if n == 0 or raw[-1] != 0:
            raise self.error(f"{what} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8") from None

    def tensor(self, name: str) -> torch.Tensor:
        header = self.pos
        rank = self.unpack("B", f"rank of {name!r}")
        shape = tuple(self.unpack("I", f"shape of {name!r}") for _ in range(rank))
        code = self.unpack("B", f"dtype of {name!r}")
        if code not in _DTYPES:
            raise self.error(f"variable {name!r} has unknown dtype code {code}", header)
        np_dtype, torch_dtype = _DTYPES[code]
        nbytes = self.unpack("I", f"size of {name!r}")
        count = int(np.prod(shape, dtype=np.int64))
        if nbytes != count * np.dtype(np_dtype).itemsize:
            raise self.error(
                f"variable {name!r} {list(shape)} {torch_dtype} cannot hold {nbytes} bytes", header
            )
        start = self.take(nbytes, f"data of {name!r}")
        array = np.frombuffer(self.data, dtype=np_dtype, count=count, offset=start)
        array = array.astype(np.dtype(np_dtype).newbyteorder("="))  # owned, aligned, native
        return torch.from_numpy(array).view(torch_dtype).reshape(shape)


def read_ct2_model_bin(path: str | Path) -> Ct2Model:
    """Parse a CTranslate2 ``model.bin``; :class:`WeightsError` on any deviation."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from e
    cur = _Cursor(data, path)
    version = cur.unpack("I", "binary version")
    if version != BINARY_VERSION:
        raise cur.error(f"unsupported binary version {version} (expected {BINARY_VERSION})", 0)
    spec_name = cur.string("spec name")
    spec_revision = cur.unpack("I", "spec revision")
    variables: dict[str, torch.Tensor] = {}
    for i in range(cur.unpack("I", "variable count")):
        name = cur.string(f"name of variable {i}")
        if name in variables:
            raise cur.error(f"duplicate variable {name!r}")
        variables[name] = cur.tensor(name)
    aliases: dict[str, str] = {}
    for i in range(cur.unpack("I", "alias count")):
        alias, target = cur.string(f"alias {i}"), cur.string(f"target of alias {i}")
        if target not in variables:
            raise cur.error(f"alias {alias!r} points at unknown variable {target!r}")
        aliases[alias] = target
    if cur.pos != len(data):
        raise cur.error(f"{len(data) - cur.pos} trailing bytes after the last alias")
    return Ct2Model(spec_name, spec_revision, variables, aliases)
