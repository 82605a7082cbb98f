"""Fused projections, filled from HF-named checkpoint tensors at load time.

Checkpoints keep HF names (``self_attn.q_proj.weight`` ...). A model that runs several
projections of one input as one GEMM declares a :class:`FusedLinear` whose output rows are those
HF linears, stacked in order (e.g. ``qkv_proj`` = rows of ``q_proj``, ``k_proj``, ``v_proj``).
:func:`load_hf_tensors` copies each HF tensor straight into its rows of the fused parameter, so
the concatenation happens at load time, in place, with no second copy of the weights. Parts
without a bias in the checkpoint (Whisper's ``k_proj``) get zero bias rows.

The fused parameter's own name is accepted too (a model's own ``state_dict()`` loads back), as
long as every row is loaded exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """``nn.Linear(in_features, sum(rows))`` whose rows are the HF linears ``parts``.

    ``parts``: ``(path, rows)`` in output order; ``path`` is the HF module path relative to the
    module that owns this one (``"q_proj"``, ``"layers.3.encoder_attn.k_proj"``).
    ``no_bias``: parts whose checkpoint has no bias (their bias rows are zero).
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool = True,
                 no_bias: Iterable[str] = ()) -> None:
        super().__init__(in_features, sum(r for _, r in parts), bias=bias)
        self.parts = tuple(parts)
        self.no_bias = frozenset(no_bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., out_features]`` -> one view ``[..., rows]`` per part."""
        return y.split([r for _, r in self.parts], dim=-1)


# name -> (parameter name, first row, end row)
Slots = dict[str, tuple[str, int, int]]


def hf_slots(model: nn.Module) -> tuple[Slots, list[tuple[str, int, int]]]:
    """Every loadable tensor name of ``model`` -> where it goes; plus the zero-bias rows."""
    params = dict(model.named_parameters())
    slots: Slots = {n: (n, 0, p.shape[0] if p.dim() else 1) for n, p in params.items()}
    zero_rows: list[tuple[str, int, int]] = []
    for mname, m in model.named_modules():
        if not isinstance(m, FusedLinear):
            continue
        parent = mname.rpartition(".")[0]
        start = 0
        for path, rows in m.parts:
            hf = f"{parent}.{path}" if parent else path
            slots[f"{hf}.weight"] = (f"{mname}.weight", start, start + rows)
            if m.bias is not None:
                if path in m.no_bias:
                    zero_rows.append((f"{mname}.bias", start, start + rows))
                else:
                    slots[f"{hf}.bias"] = (f"{mname}.bias", start, start + rows)
            start += rows
    return slots, zero_rows


def load_hf_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor],
                    rename: Callable[[str], str] = lambda n: n,
                    ignore: Iterable[str] = ()) -> None:
    """Copy checkpoint tensors (cast to each parameter's dtype) into ``model``.

    ``rename`` maps a checkpoint name to the model's naming (before fusion); names in ``ignore``
    (after ``rename``) are skipped. Raises ``ValueError`` on a shape mismatch, on unexpected
    tensors, on rows loaded twice and on missing tensors (named as the checkpoint names them).
    """
    params = dict(model.named_parameters())
    slots, zero_rows = hf_slots(model)
    ignore = set(ignore)
    # loads per row of each parameter: [rows] int
    count = {n: torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.int32)
             for n, p in params.items()}
    unexpected: list[str] = []
    with torch.no_grad():
        for pname, a, b in zero_rows:
            params[pname][a:b].zero_()
            count[pname][a:b] = -1  # optional: a checkpoint tensor may still fill them
        for ck_name, t in tensors.items():
            name = rename(ck_name)
            if name in ignore:
                continue
            if name not in slots:
                unexpected.append(ck_name)
                continue
            pname, a, b = slots[name]
            p = params[pname]
            dst = p[a:b] if p.dim() else p
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"{ck_name}: shape {tuple(t.shape)} != expected "
                                 f"{tuple(dst.shape)}")
            if bool((count[pname][a:b] > 0).any()):
                raise ValueError(f"{ck_name}: rows of {pname} loaded twice")
            dst.copy_(t)
            count[pname][a:b] = 1
    fused = {p for n, (p, _, _) in slots.items() if n != p}  # report a fused one by its parts
    missing = sorted(n for n, (pname, a, b) in slots.items()
                     if bool((count[pname][a:b] == 0).any()) and (n != pname or n not in fused))
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:8]} ({len(missing)}), "
                         f"unexpected {unexpected[:8]} ({len(unexpected)})")

