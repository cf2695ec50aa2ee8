"""Qwen2-VL: our paged-KV decoder with M-RoPE, plus Transformers' own vision tower."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import CausalLM, rope_parameters


class Qwen2VLForConditionalGeneration(CausalLM):
    # Transformers 5 saves model.language_model.* / model.visual.*; the original release has model.* / visual.*.
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))
    encoder_modules = ("visual",)  # prefill-sized products only: one weight layout when prepacked

    def __init__(self, config: Any) -> None:
        text_config = getattr(config, "text_config", None) or config
        mrope_section = list(rope_parameters(text_config).get("mrope_section") or [16, 24, 24])
        super().__init__(config, text_config, qkv_bias=True, mrope_section=mrope_section)
        self.visual = _build_vision_tower(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

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
