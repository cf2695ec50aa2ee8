"""Qwen3.5 (dense, and the MoE text variant): a hybrid decoder of Gated DeltaNet linear-attention layers
(a conv window and a recurrent state per sequence, in the engine's state pool) and gated full-attention
layers over paged KV, Qwen3-VL's vision tower without DeepStack and Qwen3-VL's processor and prompts."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.qwen3_vl_prompts import Qwen3VLPrompts

FAMILY = ModelFamily(
    name="qwen3_5",
    model_classes={
        "Qwen3_5ForConditionalGeneration": "vlm_engine.models.families.qwen3_5.model:Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration": "vlm_engine.models.families.qwen3_5.model:Qwen3_5MoeForConditionalGeneration",
    },
    prompts=Qwen3VLPrompts,
)
