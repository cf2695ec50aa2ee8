"""PaddleOCR-VL: the ERNIE-4.5 decoder with M-RoPE (our paged-KV decoder), a NaViT encoder at native
resolution with 2-D RoPE and a resampled position table, a 2x2 merge projector; its own HF processor
(smart resize, one placeholder run per image) and Qwen2-VL's M-RoPE positions (models/mrope.py:
Transformers' get_rope_index lays images out the same way)."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.mrope import MRopePrompts

FAMILY = ModelFamily(
    name="paddleocr_vl",
    model_classes={
        "PaddleOCRVLForConditionalGeneration": "vlm_engine.models.families.paddleocr_vl.model:PaddleOCRVLForConditionalGeneration",
    },
    prompts=MRopePrompts,
)
