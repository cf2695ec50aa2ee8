"""Qwen2-VL: our paged-KV decoder with M-RoPE, Transformers' vision tower, its own HF processor."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.qwen2_vl.prompts import Qwen2VLPrompts

FAMILY = ModelFamily(
    name="qwen2_vl",
    model_classes={
        "Qwen2VLForConditionalGeneration": "vlm_engine.models.qwen2_vl.model:Qwen2VLForConditionalGeneration",
    },
    prompts=Qwen2VLPrompts,
)
