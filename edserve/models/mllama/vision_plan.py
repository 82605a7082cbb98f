"""Token order and attention of the Mllama vision encoder over a batch of images.

HF's rule (``../shared/reference/mllama-facts.md`` section 1, step 6): within one image's
``L = T * Ppad`` tokens a query may not see a key only when BOTH are padding (a padding tile or
a pad-to-8 token). Real queries see every key; padding queries see the real keys only.

A plan fixes where each token sits while the encoder runs ("plan order") and how attention is
computed there; every other encoder op acts per token, so it runs in any order:
  * ``masked`` (the reference): HF order, one SDPA with a bool ``[N, 1, L, L]`` mask. The mask
    rules out the flash/cuDNN kernels and is materialized at N * L * L.
  * ``grouped`` (default): each image's real tokens first (HF order among them), then its
    padding tokens; images sorted by real-token count ``r`` (stable). For every run of images
    with the same ``r``, two mask-free SDPA calls: queries ``[0, r)`` over all ``L`` keys, and
    queries ``[r, L)`` over keys ``[0, r)``. Exact: attention does not depend on key order.

Plans are built on the host from the aspect-ratio masks (no device sync when they are on the
CPU), once per batch, and their index tensors moved to the device once. The grouped plan's
mask-free calls run on one of :data:`VISION_KERNELS`: SDPA (whatever backend it picks, then a
copy into the plan's layout), the Triton kernel of :mod:`edserve.kernels.dense_attention`
(head dim 80 without padding it to 128, written in place) or its TMA-fed sibling
:mod:`edserve.kernels.tma_attention` (Hopper+).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edserve.kernels.dense_attention import dense_attention
from edserve.kernels.tma_attention import tma_attention

AttendInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]


def sdpa_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """q ``[n, H, Lq, hd]``, k/v ``[n, H, Lk, hd]`` -> ``out [n, Lq, H, hd]`` (a view)."""
    out.copy_(F.scaled_dot_product_attention(q, k, v).transpose(1, 2))


def triton_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """As :func:`sdpa_into`, by the Triton kernel, written straight into ``out``."""
    dense_attention(q, k, v, out=out)


def tma_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """As :func:`triton_into`, by the kernel fed by TMA descriptors (compute capability 9.0+;
    head dim 80 as 64 + 16), :mod:`edserve.kernels.tma_attention`."""
    tma_attention(q, k, v, out=out)


def fa3_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """As :func:`triton_into`, by FlashAttention-3's Hopper kernel (head dim 80 in its 96
    kernel; needs ``EDSERVE_FA3_LIB``), :mod:`edserve.kernels.fa3_attention`."""
    from edserve.kernels.fa3_attention import fa3_attention

    fa3_attention(q, k, v, out=out)


# name -> mask-free attention written into a [n, Lq, H, hd] view (MllamaVisionModel's
# attention_kernel; "auto" there picks by device)
VISION_KERNELS: dict[str, AttendInto] = {"sdpa": sdpa_into, "triton": triton_into,
                                         "tma": tma_into, "fa3": fa3_into}


def real_tokens(ar_mask: torch.Tensor, num_patches: int, padded_len: int) -> torch.Tensor:
    """``[N, T * Ppad]`` bool: True for a real token (a valid tile's first ``num_patches``).
    Raises ValueError for an image with no valid tile (its attention would be undefined)."""
    N, T = ar_mask.shape
    tok = torch.arange(padded_len, device=ar_mask.device) < num_patches  # [Ppad]
    real = ((ar_mask != 0)[:, :, None] & tok[None, None, :]).reshape(N, T * padded_len)
    if not bool(real.any(1).all()):
        raise ValueError("aspect_ratio_mask: every image needs at least one valid tile "
                         f"(got {ar_mask.tolist()})")
    return real


@dataclass(frozen=True)
class VisionPlan:
    """Where the batch's tokens sit (plan order) and how attention runs there.

    ``src [N * L]`` int64 (device): plan flat position -> HF flat position (``n * L + j``, n the
    image's index in the batch as given). ``dst [N * L]`` int64 (host): its inverse."""

    src: torch.Tensor
    dst: torch.Tensor
    padded_len: int  # Ppad

    def to_plan(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, L, D] in HF order -> [N, L, D] in plan order
        N, L, D = x.shape
        return x.reshape(N * L, D).index_select(0, self.src).view(N, L, D)

    def tile_index(self) -> torch.Tensor:
        """``[N * L]``: the flat HF (image, tile) index ``n * T + t`` of each plan position."""
        return torch.div(self.src, self.padded_len, rounding_mode="floor")

    def plan_positions(self, tiles: list[int], num_patches: int) -> torch.Tensor:
        """``[len(tiles) * P]`` (device): plan flat positions of the first ``P`` tokens of each
        flat HF (image, tile) index in ``tiles``, in that order."""
        tiles_t = torch.tensor(tiles, dtype=torch.int64)
        hf = (tiles_t[:, None] * self.padded_len + torch.arange(num_patches)).reshape(-1)
        return self.dst.index_select(0, hf).to(self.src.device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v ``[N, H, L, hd]`` (plan order) -> ``[N, L, H, hd]``."""
        raise NotImplementedError


@dataclass(frozen=True)
class MaskedPlan(VisionPlan):
    allowed: torch.Tensor  # [N, 1, L, L] bool (True = may attend)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed).transpose(1, 2)


@dataclass(frozen=True)
class GroupedPlan(VisionPlan):
    groups: tuple[tuple[int, int, int], ...]  # (first image, end image, real tokens r)
    kernel: AttendInto = sdpa_into

    def attend(self, q, k, v):
        N, H, L, hd = q.shape
        out = q.new_empty(N, L, H, hd)
        for a, b, r in self.groups:
            o = out[a:b]  # [n, L, H, hd]
            self.kernel(q[a:b, :, :r], k[a:b], v[a:b], o[:, :r])
            if r < L:  # padding queries see the real keys only
                self.kernel(q[a:b, :, r:], k[a:b, :, :r], v[a:b, :, :r], o[:, r:])
        return out


def _identity(N: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(N * L)
    return idx, idx


def masked_plan(ar_mask: torch.Tensor, num_patches: int, padded_len: int,
                device: torch.device, kernel: str = "sdpa") -> MaskedPlan:
    """HF's masked SDPA (the reference; ``kernel`` is not used: a mask needs SDPA)."""
    real = real_tokens(ar_mask, num_patches, padded_len).to(device)  # [N, L]
    pad = ~real
    src, dst = _identity(*real.shape)
    return MaskedPlan(src=src.to(device), dst=dst, padded_len=padded_len,
                      allowed=~(pad[:, :, None] & pad[:, None, :])[:, None])


def grouped_plan(ar_mask: torch.Tensor, num_patches: int, padded_len: int,
                 device: torch.device, kernel: str = "sdpa") -> GroupedPlan:
    real = real_tokens(ar_mask.cpu(), num_patches, padded_len)  # [N, L]
    N, L = real.shape
    counts = real.sum(1)  # [N]
    images = torch.sort(counts, stable=True).indices  # plan image -> HF image
    within = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # real first
    src = (images[:, None] * L + within.index_select(0, images)).reshape(-1)
    dst = torch.empty_like(src)
    dst[src] = torch.arange(N * L)
    runs = torch.unique_consecutive(counts.index_select(0, images), return_counts=True)
    groups, a = [], 0
    for r, n in zip(*(t.tolist() for t in runs), strict=True):
        groups.append((a, a + n, r))
        a += n
    return GroupedPlan(src=src.to(device), dst=dst, padded_len=padded_len, groups=tuple(groups),
                       kernel=VISION_KERNELS[kernel])


# name -> builder(ar_mask [N, T], num_patches, padded_len, device, kernel name)
VISION_PLANS: dict[str, Callable[..., VisionPlan]] = {
    "grouped": grouped_plan,
    "masked": masked_plan,
}
