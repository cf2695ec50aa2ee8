"""Gemma 4: a decoder of sliding-window layers and global ones with their own head dim and
proportional (partial) RoPE, per-layer input embeddings, keys as values on the global layers
(`attention_k_eq_v`), and KV shared across layers (the last layers read an earlier layer's KV and
write none); Transformers' vision tower (images; a variable number of soft tokens each). Audio and
video are not served yet: the E2B / E4B releases load without their audio tower (never built, its
tensors skipped unread), and audio parts of a request are refused."""

from vlm_engine.models.families.gemma4.vision import gemma4_prompts
from vlm_engine.models.family import ModelFamily

FAMILY = ModelFamily(
    name="gemma4",
    model_classes={
        "Gemma4ForConditionalGeneration": "vlm_engine.models.families.gemma4.vision:Gemma4ForConditionalGeneration",
        "Gemma4ForCausalLM": "vlm_engine.models.families.gemma4.model:Gemma4ForCausalLM",
    },
    prompts=gemma4_prompts,
)
