"""Cross-attention weights of the alignment heads, from the encoder K/V already in the KV pool.

openai-whisper's ``find_alignment`` runs the decoder once more over ``[sot sequence...,
<|notimestamps|>, text tokens..., <|endoftext|>]`` and reads the cross-attention weights of the
model's alignment heads. Here that pass is dense and read-only: the encoder is not run again
(each decoder layer ``i`` reads its cross K/V from KV-pool layer ``i`` at the request's encoder
slots, as :class:`~edserve.engine.request.FinishedKV` gives them), self-attention is recomputed
causally over the sequence (nothing is written to the pool), and layers after the last
alignment head's layer are skipped unless token probabilities are asked for.

:class:`Aligner` binds a model and its heads; :class:`AlignmentReadout` is what a long-form
window's request asks the engine for (``GenerateRequest.readout``): the engine runs
:meth:`Aligner.capture` on its thread when the window finishes, and the weights come back in
the output, on the CPU, as ``[heads, T, encoder_len]`` float32 for the task's ``feed`` to turn
into words (the same with the engine in this process or in a worker process).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from edserve.whisper.alignment import alignment_heads
from edserve.whisper.words import segment_text_tokens


@torch.inference_mode()
def cross_attention_weights(model: Any, kv_pool: Any, encoder_slots: torch.Tensor,
                            tokens: list[int], heads: list[tuple[int, int]],
                            with_logits: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmaxed cross-attention weights of ``heads`` for the decoder sequence ``tokens``.

    ``model``: :class:`~edserve.models.whisper.WhisperForConditionalGeneration` (its modules
    are used, not its ``forward``); ``kv_pool``: the engine's KVPool holding the request's
    cross K/V at ``encoder_slots`` ``[S]``; ``tokens``: the full sequence from
    ``<|startoftranscript|>`` (positions ``0 .. T-1``); ``heads``: (layer, head) pairs.

    Returns ``weights`` ``[len(heads), T, S]`` float32 on the model's device (row ``t`` is the
    query at position ``t``, softmaxed over the ``S`` encoder positions) and, with
    ``with_logits``, the next-token ``logits`` ``[T, vocab]`` float32 at every position (all
    layers then run); else None. Nothing is written to the pool.
    """
    if not heads:
        raise ValueError("cross_attention_weights: no alignment heads")
    dec = model.model.decoder
    num_layers = len(dec.layers)
    for layer, h in heads:
        if not (0 <= layer < num_layers and 0 <= h < dec.num_heads):
            raise ValueError(f"alignment head ({layer}, {h}) outside the model's "
                             f"{num_layers} layers x {dec.num_heads} heads")
    device = dec.embed_tokens.weight.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    T = len(tokens)
    last = num_layers - 1 if with_logits else max(layer for layer, _ in heads)
    slots = encoder_slots.to(device=kv_pool.device, dtype=torch.long)
    x = dec.embed_tokens(ids) + dec.embed_positions(torch.arange(T, device=device))
    per_layer: dict[int, torch.Tensor] = {}
    needed = {layer for layer, _ in heads}
    for i, layer in enumerate(dec.layers[:last + 1]):
        H, hd = layer.num_heads, layer.head_dim
        scale = hd ** -0.5
        a = layer.self_attn
        qkv = a.qkv_proj(layer.self_attn_layer_norm(x))  # [T, 3d]
        q, k, v = qkv.view(T, 3, H, hd).permute(1, 2, 0, 3)  # each [H, T, hd]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        x = x + a.out_proj(o.transpose(0, 1).reshape(T, H * hd))

        c = layer.encoder_attn
        q = c.q_proj(layer.encoder_attn_layer_norm(x)).view(T, H, hd)
        k_buf, v_buf = kv_pool.get_kv(i)
        # [S, H, hd] in the compute dtype (an fp8 KV cache is dequantized on read)
        k_enc, v_enc = (b[slots].to(device=device, dtype=x.dtype) for b in (k_buf, v_buf))
        logits = torch.einsum("thd,shd->hts", q.float(), k_enc.float()) * scale
        w = torch.softmax(logits, dim=-1)  # [H, T, S] float32
        if i in needed:
            per_layer[i] = w
        o = torch.einsum("hts,shd->thd", w.to(v_enc.dtype), v_enc)
        x = x + c.out_proj(o.reshape(T, H * hd).to(x.dtype))
        if i == last and not with_logits:
            break
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    weights = torch.stack([per_layer[layer][h] for layer, h in heads])
    logits = model.compute_logits(dec.layer_norm(x)).float() if with_logits else None
    return weights, logits


@dataclass
class Alignment:
    """What :meth:`Aligner.capture` keeps for one finished window (CPU tensors)."""

    weights: torch.Tensor  # [heads, T, S] float32
    text_probs: list[float]  # probability of each text token (openai-whisper's word prob.)
    sot_seq: list[int] = field(default_factory=list)  # the sequence aligned: sot_seq +
    text_tokens: list[int] = field(default_factory=list)  # text_tokens + [eot]


class Aligner:
    """A model's alignment pass: ``model`` (Whisper) and its alignment ``heads``."""

    def __init__(self, model: Any, heads: list[tuple[int, int]]) -> None:
        self.model = model
        self.heads = list(heads)

    def capture(self, kv: Any, sot_seq: list[int], text_tokens: list[int], eot: int
                ) -> Alignment:
        """Engine thread, at the window's finish: the weights for ``sot_seq +
        text_tokens + [eot]`` over the row's encoder slots, and the probabilities of the text
        tokens (softmax over the text vocabulary ``[:eot]`` at the position before each)."""
        tokens = list(sot_seq) + list(text_tokens) + [eot]
        weights, logits = cross_attention_weights(self.model, kv.kv_pool, kv.encoder_slots,
                                                  tokens, self.heads, with_logits=True)
        n = len(text_tokens)
        text = torch.softmax(logits[len(sot_seq) - 1:len(sot_seq) - 1 + n, :eot], dim=-1)
        picked = text[torch.arange(n, device=text.device),
                      torch.tensor(text_tokens, dtype=torch.long, device=text.device)]
        return Alignment(weights.cpu(), picked.cpu().tolist(), list(sot_seq), list(text_tokens))


@dataclass(frozen=True)
class AlignmentReadout:
    """A long-form window's request for its alignment (``GenerateRequest.readout``, see
    :mod:`edserve.engine.readout`): the engine runs :meth:`read` when the window finishes and
    returns the :class:`Alignment` (None when the window has no finished segment text) in
    ``GenerateOutput.readout``. Token ids only, so it pickles to an engine worker process."""

    heads: tuple[tuple[int, int], ...]
    eot: int
    timestamp_begin: int
    forced: int  # generated tokens before the text (language detection: <|lang|>, task)
    # the sot sequence (without timestamps) by the first generated token (the detected
    # language's token) when ``forced``; else under the key None
    sot_seqs: dict[int | None, tuple[int, ...]]

    def read(self, kv: Any, model: Any) -> Alignment | None:
        tokens = list(kv.token_ids)
        text = segment_text_tokens(tokens[self.forced:], self.eot, self.timestamp_begin)
        if not text:
            return None
        key = tokens[0] if self.forced else None
        if key not in self.sot_seqs:
            raise ValueError(f"token {key} is not a language token")
        return Aligner(model, list(self.heads)).capture(kv, list(self.sot_seqs[key]), text,
                                                        self.eot)


def model_alignment_heads(engine: Any) -> list[tuple[int, int]]:
    """The alignment heads of ``engine``'s Whisper model: ``engine.alignment_heads`` when the
    engine provides them, else read from the model folder (CTranslate2 ``config.json`` or HF
    ``generation_config.json`` ``alignment_heads``), else the second half of the decoder
    layers' heads (openai-whisper's default)."""
    cfg = engine.model.config
    given = getattr(engine, "alignment_heads", None)
    if given:
        return [(int(layer), int(h)) for layer, h in given]
    folder_heads = _folder_heads(getattr(engine.config, "model", None))
    return alignment_heads({"alignment_heads": folder_heads}, cfg.decoder_layers,
                           cfg.decoder_attention_heads)


@lru_cache(maxsize=8)
def _folder_heads(model: str | None) -> tuple[tuple[int, int], ...]:
    from edserve.models.catalog import resolve_model
    from edserve.models.weights.errors import WeightsError

    try:
        folder = resolve_model(model)
    except (WeightsError, OSError, ImportError):
        return ()
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        try:
            heads = json.loads(path.read_text(encoding="utf-8")).get("alignment_heads")
        except (OSError, ValueError, AttributeError):
            continue
        if heads:
            return tuple((int(layer), int(h)) for layer, h in heads)
    return ()
