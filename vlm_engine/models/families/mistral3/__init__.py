"""Mistral 3 (Mistral-Small-3.1) and LightOnOCR: the Pixtral tower at native resolution, a projector that
RMS-norms the patch features, merges each 2 x 2 block of patches into one token and projects them (two
linears around a GELU), in front of Mistral's decoder (Llama's) or, for LightOnOCR, Qwen3's (q/k norms)."""

from vlm_engine.models.families.mistral3.prompts import PixtralPrompts
from vlm_engine.models.family import ModelFamily

FAMILY = ModelFamily(
    name="mistral3",
    model_classes={
        "Mistral3ForConditionalGeneration": "vlm_engine.models.families.mistral3.model:Mistral3ForConditionalGeneration",
        "LightOnOcrForConditionalGeneration": "vlm_engine.models.families.mistral3.model:LightOnOcrForConditionalGeneration",
    },
    prompts=PixtralPrompts,
)
