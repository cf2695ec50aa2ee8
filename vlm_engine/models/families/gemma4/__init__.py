"""Gemma 4's text model: sliding-window layers and global ones with their own head dim and
proportional (partial) RoPE, per-layer input embeddings, keys as values on the global layers
(`attention_k_eq_v`), and KV shared across layers (the last layers read an earlier layer's KV and
write none). Gemma4ForCausalLM checkpoints; the vision / audio towers are not served yet."""

from vlm_engine.models.families.gemma4.model import gemma4_prompts
from vlm_engine.models.family import ModelFamily

FAMILY = ModelFamily(
    name="gemma4",
    model_classes={"Gemma4ForCausalLM": "vlm_engine.models.families.gemma4.model:Gemma4ForCausalLM"},
    prompts=gemma4_prompts,
)
