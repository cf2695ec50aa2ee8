"""PaddleOCR-VL (0.9B): the Qwen-VL shell (models/qwen_vl.py: our paged-KV decoder with M-RoPE, here
ERNIE-4.5's Llama-shaped layers without biases), the NaViT encoder and the 2x2 merge projector
(vision.py).

Names: ours are `model.*` (decoder), `visual.vision_model.*` (encoder), `projector.*`. The released
PaddlePaddle/PaddleOCR-VL files name the projector `mlp_AR.*` and the rest as ours; Transformers 5 renames
them on load (its conversion_mapping "paddleocr_vl": mlp_AR -> model.projector, visual -> model.visual,
model -> model.language_model) and back on save (the tiny test checkpoints hold the released names). Both
namings load here. The released encoder's
`packing_position_embedding` and `head` tensors, which Transformers ignores too, are reported unused.

The LM head: the released config.json is flat (text values at the top level) and says
`tie_word_embeddings: false`, but Transformers 5.25 reads that form as tied (the flag lands on the outer
config, the text config keeps its default True, and the outer one follows it); its loader then unties again
because the file stores its own `lm_head.weight`. We follow the same rule, for every family, in the loader
(`loader.untie_stored`, called by build.build_model): tied as the config says, unless the checkpoint stores a
separate `lm_head.weight`.
"""

from __future__ import annotations

from typing import Any

import torch

from vlm_engine.models.families.paddleocr_vl.vision import MergeProjector, NaViTVisionTower
from vlm_engine.models.family import text_config_of
from vlm_engine.models.qwen_vl import QwenVLForConditionalGeneration


class PaddleOCRVLForConditionalGeneration(QwenVLForConditionalGeneration):
    checkpoint_renames = (
        ("model.visual.", "visual."),
        ("model.projector.", "projector."),
        ("mlp_AR.", "projector."),
        ("model.language_model.", "model."),
    )
    encoder_modules = ("visual", "projector")

    def __init__(self, config: Any) -> None:
        if text_config_of(config).use_bias:  # no release sets it; our decoder has biases on q/k/v only
            raise ValueError("PaddleOCR-VL with use_bias=True (biases on every projection) is not supported")
        super().__init__(config, NaViTVisionTower, qkv_bias=False)
        self.projector = MergeProjector(
            config.vision_config.hidden_size, text_config_of(config).hidden_size, self.spatial_merge_size
        )

    def visual_features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
        return self.projector(self.visual(pixels, grids), grids)
