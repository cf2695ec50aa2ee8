"""Qwen2.5-VL: the Qwen-VL shell (models/qwen_vl.py: our paged-KV decoder with M-RoPE) and the
window-attention vision tower."""

from __future__ import annotations

from typing import Any

from vlm_engine.models.families.qwen2_5_vl.vision import Qwen25VisionTower
from vlm_engine.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(QwenVLForConditionalGeneration):
    def __init__(self, config: Any) -> None:
        super().__init__(config, Qwen25VisionTower, qkv_bias=True)
