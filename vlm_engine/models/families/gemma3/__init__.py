"""Gemma 3: its decoder (Gemma's norms, GELU MLP, sliding-window layers mixed with global ones, a rotary
table per layer type) over the shared SigLIP tower and an average-pool projector; image tokens attend to
each other both ways. Gemma3ForCausalLM text checkpoints (gemma-3-1b) are its decoder alone."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.families.gemma3.prompts import gemma3_prompts

FAMILY = ModelFamily(
    name="gemma3",
    model_classes={
        "Gemma3ForConditionalGeneration": "vlm_engine.models.families.gemma3.model:Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM": "vlm_engine.models.families.gemma3.model:Gemma3ForCausalLM",
    },
    prompts=gemma3_prompts,
)
