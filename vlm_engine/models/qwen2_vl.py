"""Qwen2-VL: our paged-KV decoder with M-RoPE, plus Transformers' own vision tower."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from vlm_engine.models.layers import ForwardContext
from vlm_engine.models.llama import DecoderModel, rope_parameters


def mrope_positions(
    num_tokens: int,
    media: list[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """3-D positions [3, num_tokens] for a prompt, and the delta that continues them in decode.

    `media` holds (offset, length, grid_thw) per image/video in prompt order. Text advances all
    three axes together; a media item lays its (t, h, w) grid out from the current position, and
    the text after it resumes at current + max(h, w) / merge — as Transformers' `get_rope_index`.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = 0
    cursor = 0
    for offset, length, (t, h, w) in sorted(media):
        text_len = offset - cursor
        positions[:, cursor:offset] = np.arange(current, current + text_len)
        current += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != length:
            raise ValueError(f"media grid {t}x{gh}x{gw} does not match its {length} placeholder tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, offset : offset + length] = tt.reshape(-1) + current
        positions[1, offset : offset + length] = hh.reshape(-1) + current
        positions[2, offset : offset + length] = ww.reshape(-1) + current
        current += max(h, w) // spatial_merge_size
        cursor = offset + length
    positions[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


class Qwen2VLForConditionalGeneration(nn.Module):
    uses_mrope = True
    # Transformers 5 saves model.language_model.* / model.visual.*; the original release has model.* / visual.*.
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text_config = getattr(config, "text_config", None) or config
        self.text_config = text_config
        mrope_section = list(rope_parameters(text_config).get("mrope_section") or [16, 24, 24])
        self.model = DecoderModel(text_config, qkv_bias=True, mrope_section=mrope_section)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.visual = _build_vision_tower(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(hidden, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Vision-tower outputs, one [num_placeholder_tokens, hidden] tensor per item, in one pass."""
        dtype = next(self.visual.parameters()).dtype
        device = next(self.visual.parameters()).device
        pixels = torch.cat([p.to(device=device, dtype=dtype) for p in pixel_values])
        grid_thw = torch.tensor(grids, dtype=torch.long, device=device)
        out = self.visual(pixels, grid_thw=grid_thw)
        merged = out if isinstance(out, torch.Tensor) else out.pooler_output
        sizes = [t * h * w // self.spatial_merge_size**2 for t, h, w in grids]
        return list(merged.split(sizes))


def _build_vision_tower(vision_config: Any) -> nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision_config._attn_implementation = "sdpa"
    # On the CPU even when the caller builds on meta: the tower computes RoPE buffers at init.
    with torch.device("cpu"):
        return Qwen2VisionTransformerPretrainedModel._from_config(vision_config)
