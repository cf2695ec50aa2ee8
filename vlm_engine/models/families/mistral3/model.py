"""Mistral 3 and LightOnOCR: the shared Pixtral tower, the Mistral 3 projector (RMSNorm over the patch
features, a learned merge of each spatial_merge_size^2 block of patches, linear - GELU - linear), and the
shared decoder (Mistral: Llama's; LightOnOCR: Qwen3's, with q/k norms).

An image's span is its whole placeholder block: with Pixtral's layout (`PixtralGrid.break_id` >= 0) a
row of [IMG] tokens ends in [IMG_BREAK] and the last one in [IMG_END], whose rows stay those tokens' own
embeddings (Transformers replaces only the [IMG] rows): `encode_media` writes them between the merged
tokens. LightOnOCR's processor writes [IMG] tokens only (break_id -1)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import CausalLM
from vlm_engine.models.layers import RMSNorm
from vlm_engine.models.pixtral import PixtralVisionTower
from vlm_engine.models.vision_blocks import activation

# grid_thw of a Pixtral image: (patch rows, patch columns, the [IMG_BREAK] id or -1 for [IMG] tokens only);
# [IMG_END] is the id after [IMG_BREAK] (prompts.PixtralPrompts checks it of the tokenizer)
PixtralGrid = tuple[int, int, int]


class PatchMerger(nn.Module):
    """[rows * cols, d] patch features of one image -> [(rows // m) * (cols // m), d]: each m x m block's
    features concatenated (feature-major, as torch's unfold orders them) and mixed by one matrix."""

    def __init__(self, hidden_size: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden_size * merge * merge, hidden_size, bias=False)

    def blocks(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        m, d = self.merge, features.shape[-1]
        # A last odd row or column of patches is left out, as torch's unfold leaves it (LightOnOCR's processor
        # sizes images to patch multiples only; Pixtral's to merged-patch multiples).
        grid = features.view(rows, cols, d)[: rows - rows % m, : cols - cols % m]
        grid = grid.reshape(rows // m, m, cols // m, m, d).permute(0, 2, 4, 1, 3)
        return grid.reshape((rows // m) * (cols // m), d * m * m)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        parts = features.split([r * c for r, c in grids])
        return self.merging_layer(torch.cat([self.blocks(p, r, c) for p, (r, c) in zip(parts, grids)]))


class Mistral3Projector(nn.Module):
    """Transformers' Mistral3MultiModalProjector / LightOnOcr's (its names: norm, patch_merger, linear_1/2)."""

    def __init__(self, config: Any, activation_name: str, bias: bool) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.norm = RMSNorm(vision.hidden_size, text.rms_norm_eps)
        self.patch_merger = PatchMerger(vision.hidden_size, int(config.spatial_merge_size))
        self.linear_1 = nn.Linear(vision.hidden_size, text.hidden_size, bias=bias)
        self.act = activation(activation_name)
        self.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=bias)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        merged = self.patch_merger(self.norm(features), grids)
        return self.linear_2(self.act(self.linear_1(merged)))


class PixtralVLM(CausalLM):
    """The decoder plus `vision_tower` and `multi_modal_projector` (a family class sets the checkpoint
    renames onto these names)."""

    encoder_modules = ("vision_tower", "multi_modal_projector")  # prefill-sized products only
    feature_layer = -1

    text_model_types: tuple[str, ...] = ()  # the text configs whose decoder the shared one is

    def __init__(self, config: Any, projector: Mistral3Projector, **decoder_options: Any) -> None:
        text = config.text_config
        if text.model_type not in self.text_model_types:
            # e.g. Ministral 3's text model (its own attention scaling), which the shared decoder does not have
            raise NotImplementedError(f"{type(self).__name__} with a {text.model_type!r} text model")
        if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
            # Mistral-Small-3.1 and LightOnOCR have none; a windowed Mistral would need the window pool
            raise NotImplementedError(f"{type(self).__name__} with sliding_window={text.sliding_window}")
        super().__init__(config, text, bool(getattr(text, "attention_bias", False)), **decoder_options)
        if self.lm_head.weight is self.model.embed_tokens.weight and not getattr(text, "tie_word_embeddings", True):
            # Mistral-Small-3.1's config.json says nothing at the top level (Mistral3Config's default: tied) while
            # its text config is untied (MistralConfig's default) and the file stores the LM head: keep it its own.
            self.lm_head.weight = nn.Parameter(torch.empty_like(self.lm_head.weight))
        self.vision_tower = PixtralVisionTower(config.vision_config)
        self.multi_modal_projector = projector
        self.merge = int(config.spatial_merge_size)

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        """One tower pass over all images (each [1, C, H, W]); per image its span's rows."""
        weight = self.multi_modal_projector.linear_1.weight
        images = [p.to(device=weight.device, dtype=weight.dtype) for p in pixel_values]
        features = self.vision_tower(images, (self.feature_layer,))
        patch_grids = [(int(g[0]), int(g[1])) for g in grids]
        tokens = self.multi_modal_projector(features, patch_grids)
        sizes = [(r // self.merge) * (c // self.merge) for r, c in patch_grids]
        return [
            self.span_rows(t, r // self.merge, int(g[2]))
            for t, (r, _), g in zip(tokens.split(sizes), patch_grids, grids)
        ]

    def span_rows(self, tokens: torch.Tensor, rows: int, break_id: int) -> torch.Tensor:
        """The merged tokens, and with Pixtral's layout an [IMG_BREAK] embedding after each row of them
        ([IMG_END]'s after the last)."""
        if break_id < 0:
            return tokens
        ids = torch.tensor([break_id] * (rows - 1) + [break_id + 1], device=tokens.device)
        ends = self.embed(ids).to(tokens.dtype)
        return torch.cat([tokens.view(rows, -1, tokens.shape[-1]), ends[:, None]], dim=1).flatten(0, 1)


def _feature_layer(config: Any) -> int:
    layer = getattr(config, "vision_feature_layer", -1)
    if not isinstance(layer, int):  # Transformers' projector cannot take several either (its norm is one layer wide)
        raise NotImplementedError(f"vision_feature_layer={layer} (several layers) is not supported")
    return layer


class Mistral3ForConditionalGeneration(PixtralVLM):
    # The released files name the parts `language_model.model.` / `language_model.lm_head.` /
    # `vision_tower.` / `multi_modal_projector.`; Transformers 5 saves them under `model.`.
    checkpoint_renames = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    text_model_types = ("mistral",)

    def __init__(self, config: Any) -> None:
        projector = Mistral3Projector(config, config.projector_hidden_act, bool(config.multimodal_projector_bias))
        super().__init__(config, projector)
        self.feature_layer = _feature_layer(config)


class LightOnOcrForConditionalGeneration(PixtralVLM):
    """Pixtral + Qwen3: the same projector with an exact GELU and no biases; the last tower layer's output."""

    checkpoint_renames = (
        ("model.language_model.", "model."),
        ("model.vision_encoder.", "vision_tower."),
        ("model.vision_projection.", "multi_modal_projector."),
    )
    text_model_types = ("qwen3",)

    def __init__(self, config: Any) -> None:
        super().__init__(config, Mistral3Projector(config, "gelu", bias=False), qk_norm=True)
