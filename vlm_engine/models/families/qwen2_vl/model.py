"""Qwen2-VL: the Qwen-VL shell (models/qwen_vl.py: our paged-KV decoder with M-RoPE), plus
Transformers' own vision tower."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen2VLForConditionalGeneration(QwenVLForConditionalGeneration):
    def __init__(self, config: Any) -> None:
        super().__init__(config, _build_vision_tower, qkv_bias=True)

    def visual_features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        out = self.visual(pixels, grid_thw=grid_thw)
        return out if isinstance(out, torch.Tensor) else out.pooler_output  # Transformers 5 returns an output record


def _build_vision_tower(vision_config: Any) -> nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision_config._attn_implementation = "sdpa"
    # On the CPU even when the caller builds on meta: the tower computes RoPE buffers at init.
    with torch.device("cpu"):
        return Qwen2VisionTransformerPretrainedModel._from_config(vision_config)
