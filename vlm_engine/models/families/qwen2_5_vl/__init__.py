"""Qwen2.5-VL: the Qwen2-VL decoder (M-RoPE, qkv bias), a window-attention vision tower, M-RoPE
positions in absolute time for video (models/mrope.py), its own HF processor."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.mrope import MRopePrompts

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    model_classes={
        "Qwen2_5_VLForConditionalGeneration": "vlm_engine.models.families.qwen2_5_vl.model:Qwen2_5_VLForConditionalGeneration",
    },
    prompts=MRopePrompts,
)
