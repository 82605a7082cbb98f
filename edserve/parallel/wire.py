"""How rank 0 hands a call to the other ranks: a pickled header over each follower's stdin
pipe, then the call's tensors through one ``torch.distributed`` broadcast per dtype group.

The header (kind, host-side values, tensor shapes/dtypes) travels over a pipe so an idle
follower blocks on a pipe read, not on a collective that would time out, and exits when rank 0
closes the pipe (or dies). Integer tensors (index tensors of a step) are packed into one int64
buffer and broadcast once; floating tensors are broadcast one by one in their dtype.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist

_LEN = struct.Struct("<Q")


@dataclass
class Message:
    """One mirrored call: ``kind`` names it, ``meta`` holds host values, ``specs`` the shapes
    and dtypes of the tensors that follow on the process group (in order)."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    specs: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)


def write_message(pipe: IO[bytes], msg: Message) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_LEN.pack(len(data)))
    pipe.write(data)
    pipe.flush()


def read_message(pipe: IO[bytes]) -> Message | None:
    """The next message, or None when rank 0 closed the pipe."""
    head = pipe.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    n = _LEN.unpack(head)[0]
    data = pipe.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and dtype != torch.bool


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def send_tensors(tensors: list[torch.Tensor], device: torch.device, group=None) -> None:
    """Rank 0: broadcast ``tensors`` (integer ones packed into one int64 buffer)."""
    ints = [t.reshape(-1).to(device, torch.int64) for t in tensors if _is_int(t.dtype)]
    if ints:
        dist.broadcast(torch.cat(ints), 0, group=group)
    for t in tensors:
        if not _is_int(t.dtype):
            dist.broadcast(t.to(device).contiguous(), 0, group=group)


def recv_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 group=None) -> list[torch.Tensor]:
    """Other ranks: receive what :func:`send_tensors` sent, as tensors of ``specs``."""
    sizes = [int(torch.Size(s).numel()) for s, d in specs if _is_int(d)]
    out: list[torch.Tensor | None] = [None] * len(specs)
    if sizes:
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=device)
        dist.broadcast(packed, 0, group=group)
        parts = iter(packed.split(sizes))
        for i, (shape, dtype) in enumerate(specs):
            if _is_int(dtype):
                out[i] = next(parts).view(shape).to(dtype)
    for i, (shape, dtype) in enumerate(specs):
        if not _is_int(dtype):
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, 0, group=group)
            out[i] = t
    return out  # type: ignore[return-value]
