"""Qwen2-VL: our paged-KV decoder with M-RoPE, Transformers' vision tower, its own HF processor (M-RoPE
positions from models/mrope.py)."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.mrope import MRopePrompts

FAMILY = ModelFamily(
    name="qwen2_vl",
    model_classes={
        "Qwen2VLForConditionalGeneration": "vlm_engine.models.families.qwen2_vl.model:Qwen2VLForConditionalGeneration",
    },
    prompts=MRopePrompts,
)
