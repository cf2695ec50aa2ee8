"""The model shell the Qwen-VL families share (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the shared decoder with
M-RoPE, and a vision tower named `visual` whose merged features replace the placeholder embeddings.
A family gives its tower and its decoder options; `visual_features` is the hook for a tower whose
output is not one [N / merge**2, out_hidden] tensor (Transformers' own Qwen2-VL tower, Qwen3-VL's
DeepStack features)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import CausalLM, rope_parameters
from vlm_engine.models.family import text_config_of


class QwenVLForConditionalGeneration(CausalLM):
    # Transformers 5's names (model.language_model.*, model.visual.*; Qwen3-VL's releases use them too) and
    # the Qwen2(.5)-VL releases' (model.*, visual.*) -> ours
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))
    encoder_modules = ("visual",)  # prefill-sized products only: one weight layout when prepacked

    def __init__(
        self,
        config: Any,
        vision_tower: Callable[[Any], nn.Module],
        default_mrope_section: tuple[int, int, int] = (16, 24, 24),
        **decoder_options: Any,
    ) -> None:
        text_config = text_config_of(config)
        mrope_section = list(rope_parameters(text_config).get("mrope_section") or default_mrope_section)
        super().__init__(config, text_config, mrope_section=mrope_section, **decoder_options)
        self.visual = vision_tower(config.vision_config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def visual_features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[N, C * T * P * P] patches -> [N / merge**2, width] rows, items back to back."""
        out: torch.Tensor = self.visual(pixels, grid_thw)
        return out

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Vision-tower outputs, one [num_placeholder_tokens, width] tensor per item, in one pass."""
        parameter = next(self.visual.parameters())
        pixels = torch.cat([p.to(device=parameter.device, dtype=parameter.dtype) for p in pixel_values])
        merged = self.visual_features(pixels, torch.tensor(grids, dtype=torch.long, device=parameter.device))
        return list(merged.split([t * h * w // self.spatial_merge_size**2 for t, h, w in grids]))
