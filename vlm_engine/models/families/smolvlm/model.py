"""SmolVLM2 / Idefics3: our paged-KV Llama decoder, the shared SigLIP tower with Idefics3's bucketed
positions (models/siglip.py), and the connector: a pixel shuffle that folds each scale x scale block of
a tile's patch features into one token, then one linear projection into the text hidden size.

A media item is one tile (or the global image, or one video frame): pixels [C, S, S] and
grid (1, valid patch rows, valid patch columns); a tile is never padded by SmolVLM's processors (tiles,
global images and frames are all `image_size` square), but a padded one is encoded as Transformers
encodes it (its padded patches masked out as keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import CausalLM
from vlm_engine.models.siglip import SiglipVisionTower

# Tiles encoded per tower call: bounds the activations (a 512-px SmolVLM2 tile is 1,024 patches; its
# MLP rows are 12 MB in fp32) when many images arrive in one step. Each tile's rows do not depend on
# the others in its batch.
TILES_PER_CALL = 16


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side * side, D] patch features -> [B, side * side / scale**2, D * scale**2]: output token
    (i, j) is patches (i * scale + r, j * scale + c) for r, then c, in 0..scale-1, concatenated (the
    order of Idefics3's connector)."""
    b, n, d = x.shape
    side = int(n**0.5)
    if side * side != n or side % scale:
        raise ValueError(f"{n} patches are not a square grid divisible by the scale factor {scale}")
    blocks = side // scale
    return x.view(b, blocks, scale, blocks, scale, d).permute(0, 1, 3, 2, 4, 5).reshape(b, blocks * blocks, -1)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden * scale_factor**2, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale_factor))


class SmolVLMForConditionalGeneration(CausalLM):
    # Transformers' names (the released SmolVLM2 / Idefics3 checkpoints use them too) -> ours
    checkpoint_renames = (
        ("model.text_model.", "model."),
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
    )
    encoder_modules = ("vision_model", "connector")  # prefill-sized products only: one layout when prepacked

    def __init__(self, config: Any) -> None:
        text_config = config.text_config
        super().__init__(config, text_config, qkv_bias=bool(getattr(text_config, "attention_bias", False)))
        vision = config.vision_config
        self.vision_model = SiglipVisionTower(vision, positions="bucketed")
        self.connector = Connector(vision.hidden_size, text_config.hidden_size, int(config.scale_factor))
        self.patch_size = int(vision.patch_size)

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One [tokens, hidden] tensor per tile: tiles of one size go through the tower together
        (TILES_PER_CALL at a time), then the connector."""
        parameter = next(self.vision_model.parameters())
        out: list[torch.Tensor | None] = [None] * len(pixel_values)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, pixels in enumerate(pixel_values):
            by_shape.setdefault(tuple(pixels.shape), []).append(i)
        for shape, indices in by_shape.items():
            rows, cols = shape[-2] // self.patch_size, shape[-1] // self.patch_size
            for start in range(0, len(indices), TILES_PER_CALL):
                batch = indices[start : start + TILES_PER_CALL]
                pixels = torch.stack([pixel_values[i] for i in batch]).to(
                    device=parameter.device, dtype=parameter.dtype
                )
                mask = self._patch_mask([grids[i] for i in batch], rows, cols, parameter.device)
                features = self.connector(self.vision_model(pixels, mask))
                for i, tokens in zip(batch, features):
                    out[i] = tokens
        return [t for t in out if t is not None]

    @staticmethod
    def _patch_mask(
        grids: list[tuple[int, int, int]], rows: int, cols: int, device: torch.device
    ) -> torch.Tensor | None:
        """[B, rows, cols] valid patches (each tile's top-left grid[1] x grid[2]), or None when all are."""
        if all((h, w) == (rows, cols) for _, h, w in grids):
            return None
        mask = torch.zeros(len(grids), rows, cols, dtype=torch.bool, device=device)
        for m, (_, h, w) in zip(mask, grids):
            m[:h, :w] = True
        return mask
