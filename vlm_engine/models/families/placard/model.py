"""placard-default's model: SmolLM2's decoder, whose media embeddings are its own token embeddings
of each image's label text."""

from __future__ import annotations

from typing import Any

import torch

from vlm_engine.models.decoder import CausalLM


class PlacardForConditionalGeneration(CausalLM):
    """SmolLM2's decoder; an image's encoder input is its label token ids (see the family's doc)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, config, qkv_bias=bool(getattr(config, "attention_bias", False)))

    def encode_media(self, inputs: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        device = self.lm_head.weight.device
        return [self.embed(ids.to(device=device, dtype=torch.long).reshape(-1)) for ids in inputs]
