"""Qwen3.5 (dense, and the MoE text variant): a hybrid decoder of Gated DeltaNet linear-attention layers
(a conv window and a recurrent state per sequence, in the engine's state pool) and gated full-attention
layers over paged KV, Qwen3-VL's vision tower without DeepStack and Qwen3-VL's processor and prompts.
Qwen3-Next (text only) is the same stack with 1-D RoPE and its tokenizer's prompts."""

from pathlib import Path
from typing import Any

from preprocess.family_prompts import FamilyPrompts
from vlm_engine.models.family import ModelFamily
from vlm_engine.models.hf_prompts import TokenizerPrompts
from vlm_engine.models.qwen3_vl_prompts import Qwen3VLPrompts


def qwen3_5_prompts(model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> FamilyPrompts:
    """Qwen3-VL's processor for the VLMs, the tokenizer for a text checkpoint (Qwen3-Next)."""
    if getattr(config, "vision_config", None) is None:
        return TokenizerPrompts(model_dir, config, gguf_file, video_device)
    return Qwen3VLPrompts(model_dir, config, gguf_file, video_device)


_MODEL = "vlm_engine.models.families.qwen3_5.model"
FAMILY = ModelFamily(
    name="qwen3_5",
    model_classes={
        "Qwen3_5ForConditionalGeneration": f"{_MODEL}:Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration": f"{_MODEL}:Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM": f"{_MODEL}:Qwen3NextForCausalLM",
    },
    prompts=qwen3_5_prompts,
)
