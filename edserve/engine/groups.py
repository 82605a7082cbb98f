"""Row-group registry and KV reservation: which :class:`~edserve.engine.row_group.RowGroup`
strategy a request's sampling settings select, and how many KV slots admission promises it."""

from __future__ import annotations

import torch

from edserve.engine.beam_rows import DeviceBeamGroup
from edserve.engine.beam_search import BeamGroup
from edserve.engine.best_of import BestOfGroup
from edserve.engine.draw import make_generator
from edserve.engine.req import Req
from edserve.engine.row_group import RowGroup


def make_group(req: Req, eos_token_id: int, device: torch.device,
               beam_on_device: bool = False) -> RowGroup | None:
    """The request's row group (beam search at temperature 0 with ``beam_size > 1``: on the
    device's fixed rows with ``beam_on_device``; best_of at temperature > 0 with
    ``best_of > 1``), or None for one-row decoding."""
    sp = req.request.sampling
    stop = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos
                                           else frozenset({eos_token_id}))
    if sp.beam_size > 1:
        kind = DeviceBeamGroup if beam_on_device else BeamGroup
        return kind(req, sp.beam_size, stop, sp.length_penalty, sp.patience)
    if sp.best_of > 1:
        group = BestOfGroup(req, sp.best_of, stop, sp.length_penalty)
        group.generators = [req.generator] + [
            make_generator(None if sp.seed is None else row_seed(sp.seed, k), device)
            for k in range(1, sp.best_of)]
        return group
    return None


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, k: int) -> int:
    """The seed of row ``k`` of a request seeded ``seed``: row 0 takes the request's seed
    (a one-row request samples as before), row ``k > 0`` a splitmix64 mix of both (a
    deterministic function of ``(seed, k)`` only, and no simple offset, so rows of nearby
    seeds do not share streams: ``seed + k`` would give request 1's row 1 request 2's row 0)."""
    if k == 0:
        return seed
    return _splitmix64(_splitmix64(seed & _MASK64) ^ k) >> 1  # 63 bits: manual_seed's range


def reserved_slots(enc_region: int, decoder_len: int, page_size: int, rows: int,
                   reuse: bool) -> int:
    """KV slots a request may ever hold (whole pages), promised at admission.

    One row holds ``R = ceil((enc_region + decoder_len) / ps)`` pages. A group of ``rows``
    rows shares the encoder region's whole pages; each row owns the rest of its row (its
    copy of a partial encoder page included), and the group's hold keeps the region's pages:
    ``ceil(enc_region / ps) + rows * (R - floor(enc_region / ps))``. A request that reuses a
    held encoder region (``reuse``) owns only ``R - floor(enc_region / ps)`` per row.
    """
    ps = page_size
    full = -(-(enc_region + decoder_len) // ps)
    shared = enc_region // ps
    if reuse:
        pages = rows * (full - shared)
    elif rows == 1:
        pages = full
    else:
        pages = -(-enc_region // ps) + rows * (full - shared)
    return pages * ps
