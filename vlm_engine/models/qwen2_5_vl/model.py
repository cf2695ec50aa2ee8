"""Qwen2.5-VL: our paged-KV decoder with M-RoPE, and the window-attention vision tower."""

from __future__ import annotations

from typing import Any

import torch

from vlm_engine.models.decoder import CausalLM, rope_parameters
from vlm_engine.models.qwen2_5_vl.vision import Qwen25VisionTower


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    # Transformers 5 saves model.language_model.* / model.visual.*; the released checkpoints have model.* / visual.*.
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))
    encoder_modules = ("visual",)  # prefill-sized products only: one weight layout when prepacked

    def __init__(self, config: Any) -> None:
        text_config = config.text_config
        mrope_section = list(rope_parameters(text_config).get("mrope_section") or [16, 24, 24])
        super().__init__(config, text_config, qkv_bias=True, mrope_section=mrope_section)
        self.visual = Qwen25VisionTower(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Vision-tower outputs, one [num_placeholder_tokens, hidden] tensor per item, in one pass."""
        parameter = next(self.visual.parameters())
        pixels = torch.cat([p.to(device=parameter.device, dtype=parameter.dtype) for p in pixel_values])
        merged = self.visual(pixels, torch.tensor(grids, dtype=torch.long, device=parameter.device))
        return list(merged.split([t * h * w // self.spatial_merge_size**2 for t, h, w in grids]))

