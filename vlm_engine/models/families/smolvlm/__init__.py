"""SmolVLM2 and Idefics3 (SmolVLM v1): the Llama decoder, the shared SigLIP tower with bucketed
positions, the pixel-shuffle connector, and SmolVLM's processor (image tiles + the global image with
row/column tokens, video frames behind their timestamps), one media item per tile or frame."""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.families.smolvlm.prompts import SmolVLMPrompts

FAMILY = ModelFamily(
    name="smolvlm",
    model_classes={
        "SmolVLMForConditionalGeneration": "vlm_engine.models.families.smolvlm.model:SmolVLMForConditionalGeneration",
        "Idefics3ForConditionalGeneration": "vlm_engine.models.families.smolvlm.model:SmolVLMForConditionalGeneration",
    },
    prompts=SmolVLMPrompts,
)
