"""Mllama (Llama-3.2-Vision) for the engine: ``encode`` images once, then ``forward`` steps.

Engine contract (as ``edserve.engine.runner.ModelRunner`` calls it):
  * ``encoder_len(image_input)`` validates a request's encoder input and returns its
    encoder-region length (0 for text-only).
  * ``encode(images)``: one entry per request (None = text-only) -> the projected vision states
    of that request, ``[encoder_len(input), hidden]``: valid tiles only, keys ordered (image,
    tile, patch) ("compact" layout); with ``cross_attention_empty_rows == "hf"`` the padding
    tiles follow, in (image, tile) order. Text-only requests get ``[0, hidden]``. All images of
    all requests run through the vision encoder as one batch.
  * ``forward(input_ids [T], positions [T], batch, encoder_states) -> hidden [T, hidden]``
    (final norm applied); ``encoder_states`` is the concatenation of ``encode`` outputs of the
    requests whose encoder region is written this step, in batch order (matching
    ``batch.encoder_out_cache_loc``), or None. ``compute_logits(hidden [N, d]) -> [N, vocab]``.
  * ``batch.cross_kv_ranges`` ``[T, 2]`` (from :meth:`cross_attention_layout`) limits each token
    to the encoder keys of the images it may see; None = every key of its request.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from edserve.layers.elementwise import elementwise_ops
from edserve.layers.forward_batch import ForwardBatch
from edserve.models.mllama.config import MllamaConfig, MllamaTextConfig
from edserve.models.mllama.inputs import MllamaInputs
from edserve.models.mllama.rope import RotaryEmbedding
from edserve.models.mllama.text import (
    CrossAttentionDecoderLayer,
    RMSNorm,
    SelfAttentionDecoderLayer,
    kv_pool_layers,
)
from edserve.models.mllama.vision import MllamaVisionModel
from edserve.multimodal.mllama_image import MllamaImageInput, stack_pixels


class MllamaTextModel(nn.Module):
    def __init__(self, cfg: MllamaTextConfig) -> None:
        super().__init__()
        # vocab + 8 rows: <|image|> (= vocab_size) and spares; never produced by lm_head.
        self.embed_tokens = nn.Embedding(cfg.vocab_size + 8, cfg.hidden_size)
        cross = set(cfg.cross_attention_layers)
        self.layers = nn.ModuleList(
            CrossAttentionDecoderLayer(cfg, kv) if i in cross
            else SelfAttentionDecoderLayer(cfg, kv)
            for i, kv in enumerate(kv_pool_layers(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)


class MllamaModel(MllamaInputs, nn.Module):
    model_type = "mllama"  # the registry key (edserve.models.registry)
    # Decode batches carry per-row cross-attention key ranges (image requests); CUDA graphs
    # keep a static range buffer so image and text-only rows replay one graph.
    reads_cross_kv_ranges = True

    def __init__(self, config: MllamaConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = MllamaVisionModel(config.vision, config.vision_intermediate_semantics)
        self.multi_modal_projector = nn.Linear(config.vision.vision_output_dim,
                                               config.text.hidden_size)
        self.language_model = MllamaTextModel(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    # ---- sizes the engine lays out the KV pool with ------------------------------------
    @property
    def num_kv_layers(self) -> int:
        """KV-pool layers: a self layer and a cross layer share one (self K/V at decoder
        slots, cross K/V at encoder slots: :func:`~edserve.models.mllama.text.kv_pool_layers`),
        so max(self layers, cross layers)."""
        return max(kv_pool_layers(self.config.text)) + 1

    @property
    def num_kv_heads(self) -> int:
        return self.config.text.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.text.head_dim

    @property
    def max_decoder_len(self) -> int:
        return self.config.text.max_position_embeddings

    @property
    def input_vocab_size(self) -> int:
        """Token ids a prompt may hold (embedding rows: the vocabulary, <|image|>, spares)."""
        return self.language_model.embed_tokens.num_embeddings

    # ---- encoder -----------------------------------------------------------------------
    def encode(self, images: list[MllamaImageInput | None]) -> list[torch.Tensor]:
        """Projected vision states per request (see the module docstring for the layout).

        One vision-encoder pass over every tile of every image of every request; the encoder
        returns, and the projector runs on, only the tiles a request keeps (valid tiles, plus
        the padding tiles in "hf" mode), in output order (an index on the host's tile counts).
        """
        hidden = self.config.text.hidden_size
        p = self.multi_modal_projector.weight
        present = [x for x in images if x is not None and x.num_images > 0]
        if not present:
            return [torch.zeros(0, hidden, device=p.device, dtype=p.dtype) for _ in images]
        pv = stack_pixels(present, p.device, p.dtype)  # [N, T, 3, S, S]
        ids = torch.cat([x.aspect_ratio_ids for x in present]).to(p.device)
        mask = torch.cat([x.aspect_ratio_mask for x in present])  # host: the vision plan's
        T = pv.shape[1]
        keep: list[int] = []  # flat (image, tile) indices in output order
        counts: list[int] = []  # tiles kept per request (0: text-only)
        n = 0
        for x in images:
            if x is None or x.num_images == 0:
                counts.append(0)
                continue
            before = len(keep)
            keep += [(n + i) * T + k for i, t in enumerate(x.num_tiles) for k in range(t)]
            if self.config.cross_attention_empty_rows == "hf":
                keep += [(n + i) * T + k for i, t in enumerate(x.num_tiles)
                         for k in range(t, T)]
            counts.append(len(keep) - before)
            n += x.num_images
        feats = self.vision_model(pv, ids, mask, tiles=keep)  # [K, P, vision_output_dim]
        tiles = self.multi_modal_projector(feats)  # [K, P, H]
        return [part.reshape(-1, hidden) for part in tiles.split(counts)]

    # ---- decoder -----------------------------------------------------------------------
    def _cross_masks(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                         ForwardBatch]:
        """Per-token ``[T]`` bool masks for the cross-attention and MLP branches, and the batch
        the cross-attention sites read (``cross_kv_ranges`` rewritten in "hf" mode)."""
        dev = batch.positions.device
        q_lens = (batch.cu_q[1:] - batch.cu_q[:-1]).long().to(dev)
        enc_len = torch.repeat_interleave(batch.encoder_lens.long().to(dev), q_lens,
                                          output_size=batch.num_tokens)  # [T]
        has_enc = enc_len > 0
        ranges = batch.cross_kv_ranges
        visible = has_enc if ranges is None else has_enc & (ranges[:, 1] > ranges[:, 0]).to(dev)
        if self.config.cross_attention_empty_rows == "zero":
            return visible, visible, batch
        # "hf": a row that sees no image attends over all keys of its request (unzeroed).
        if ranges is None:
            if batch.encoder_lens_cpu and any(batch.encoder_lens_cpu):
                raise ValueError('cross_attention_empty_rows="hf" stores padding-tile keys: '
                                 "image requests need cross_kv_ranges to exclude them")
            return has_enc, visible, batch
        full = torch.stack([torch.zeros_like(enc_len), enc_len], dim=1)
        new = torch.where(visible[:, None], ranges.long().to(dev), full).to(ranges.dtype)
        return has_enc, visible, dataclasses.replace(batch, cross_kv_ranges=new)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                encoder_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions ``[T]`` -> hidden states ``[T, hidden]`` (final norm applied)."""
        lm = self.language_model
        x = lm.embed_tokens(input_ids)  # [T, H]
        cos, sin = lm.rotary_emb(positions, x.dtype)
        attn_rows, mlp_rows, cross_batch = self._cross_masks(batch)
        attn_mask = attn_rows[:, None].to(x.dtype)  # [T, 1]
        mlp_mask = mlp_rows[:, None].to(x.dtype)
        enc = encoder_states.to(x.dtype) if encoder_states is not None else None
        # No request has an image (host lengths; a graph never decides on the host): every
        # cross layer would add exactly 0 (both branches masked), so it is skipped, as HF does.
        lens = batch.encoder_lens_cpu
        text_only = not batch.static_shapes and len(lens) == batch.batch_size and not any(lens)
        for layer in lm.layers:
            if isinstance(layer, CrossAttentionDecoderLayer):
                if not text_only:
                    x = layer(x, enc, cross_batch, attn_mask, mlp_mask)
            else:
                x = layer(x, cos, sin, batch)
        return lm.norm(x, elementwise_ops(batch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, vocab] float32 (lm_head is not tied to the embedding)
        return self.lm_head(hidden).float()
