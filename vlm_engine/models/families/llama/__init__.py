"""Llama-architecture text models: Llama, SmolLM2, Mistral, Qwen2 (safetensors or GGUF)."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.hf_prompts import TokenizerPrompts

FAMILY = ModelFamily(
    name="llama",
    model_classes={
        "LlamaForCausalLM": "vlm_engine.models.families.llama.model:LlamaForCausalLM",
        "MistralForCausalLM": "vlm_engine.models.families.llama.model:LlamaForCausalLM",
        "Qwen2ForCausalLM": "vlm_engine.models.families.llama.model:Qwen2ForCausalLM",
    },
    prompts=TokenizerPrompts,
)
