"""Qwen3-VL (dense, and the MoE text variant): the Qwen3 decoder (q/k norms, explicit head_dim,
interleaved M-RoPE) with DeepStack visual features in its first layers, a learned-position vision
tower with 16-px patches, and its HF processor (videos as timestamped frame groups)."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.qwen3_vl_prompts import Qwen3VLPrompts

FAMILY = ModelFamily(
    name="qwen3_vl",
    model_classes={
        "Qwen3VLForConditionalGeneration": "vlm_engine.models.families.qwen3_vl.model:Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration": "vlm_engine.models.families.qwen3_vl.model:Qwen3VLMoeForConditionalGeneration",
    },
    prompts=Qwen3VLPrompts,
)
