"""Qwen2.5-VL: our paged-KV decoder with M-RoPE, and the window-attention vision tower."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import CausalLM, rope_parameters


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    # Transformers 5 saves model.language_model.* / model.visual.*; the released checkpoints have model.* / visual.*.
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))

    def __init__(self, config: Any) -> None:
        text_config = config.text_config
        mrope_section = list(rope_parameters(text_config).get("mrope_section") or [16, 24, 24])
        super().__init__(config, text_config, qkv_bias=True, mrope_section=mrope_section)
        self.visual = _build_vision_tower(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Vision-tower outputs, one [num_placeholder_tokens, hidden] tensor per item, in one pass."""
        parameter = next(self.visual.parameters())
        pixels = torch.cat([p.to(device=parameter.device, dtype=parameter.dtype) for p in pixel_values])
        merged = self.visual(pixels, grid_thw=torch.tensor(grids, dtype=torch.long, device=parameter.device))
        merged = merged if isinstance(merged, torch.Tensor) else merged.pooler_output
        return list(merged.split([t * h * w // self.spatial_merge_size**2 for t, h, w in grids]))


def _build_vision_tower(vision_config: Any) -> nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision_config._attn_implementation = "sdpa"
    with torch.device("cpu"):  # the tower computes RoPE buffers at init, even when the caller builds on meta
        return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)
