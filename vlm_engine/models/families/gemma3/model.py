"""Gemma 3: the shared decoder with Gemma's options (unit-offset RMSNorms in fp32, sandwich norms, a
GELU-tanh gated MLP, q/k norms, scores scaled by query_pre_attn_scalar ** -0.5, sliding-window layers
and a rotary table per layer type), token embeddings scaled by sqrt(hidden) in their own dtype, tied
LM head; the vision side is the shared SigLIP tower and Gemma's projector (average-pool the patch
grid to `mm_tokens_per_image` tokens, RMSNorm, one projection matrix). An image's tokens attend to
each other both ways (`bidirectional_media`): the runner gives them their span's end as KV end."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.decoder import CausalLM, DecoderOptions
from vlm_engine.models.layers import RMSNorm
from vlm_engine.models.siglip import SiglipVisionTower

SLIDING, FULL = "sliding_attention", "full_attention"


def decoder_options(text_config: Any) -> DecoderOptions:
    """The shared decoder's options for a Gemma3TextConfig; what it does not implement is refused."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text_config, name, None) is not None:  # Gemma 2's; every Gemma 3 release has None
            raise NotImplementedError(f"Gemma 3 with {name}={getattr(text_config, name)} is not supported")
    if getattr(text_config, "use_bidirectional_attention", False):  # EmbeddingGemma: an encoder, not served here
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention is not supported")
    layer_types = tuple(text_config.layer_types)
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise NotImplementedError(f"Gemma 3 layer types {sorted(unknown)} are not supported")
    window = int(text_config.sliding_window or 0)
    return DecoderOptions(
        norm_unit_offset=True,
        sandwich_norms=True,
        mlp_activation=text_config.hidden_activation,
        attention_scale=float(text_config.query_pre_attn_scalar) ** -0.5,
        attention_windows=tuple(window if t == SLIDING else 0 for t in layer_types),
        layer_types=layer_types,
    )


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model (gemma-3-1b, or any Gemma3TextConfig checkpoint); Transformers' names."""

    bidirectional_media = False

    def __init__(self, config: Any, text_config: Any = None) -> None:
        text_config = config if text_config is None else text_config
        options = decoder_options(text_config)
        super().__init__(config, text_config, qkv_bias=bool(text_config.attention_bias), qk_norm=True, options=options)
        # Read by the runner: the KV of layers with a window lives in the window pool.
        assert options.attention_windows is not None
        self.attention_windows: tuple[int, ...] = options.attention_windows
        self.embed_scale = float(text_config.hidden_size) ** 0.5
        self._embed_scales: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden) rounded to their dtype, as Transformers multiplies them (bf16:
        sqrt(2560) becomes 50.5). Media rows are overwritten afterwards, unscaled, as there."""
        embeds = self.model.embed_tokens(input_ids)
        key = (embeds.dtype, embeds.device)
        scale = self._embed_scales.get(key)
        if scale is None:
            scale = self._embed_scales[key] = torch.tensor(self.embed_scale, dtype=embeds.dtype, device=embeds.device)
        return embeds * scale


class Gemma3Projector(nn.Module):
    """SigLIP patch features [B, side * side, vision hidden] -> [B, mm_tokens_per_image, text hidden]:
    average pooling over the patch grid, Gemma's RMSNorm, then one matrix (Transformers' names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens_per_side = round(int(config.mm_tokens_per_image) ** 0.5)
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square that divides a "
                f"{self.patches_per_side}x{self.patches_per_side} patch grid"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, unit_offset=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        b, _, channels = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(b, channels, side, side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        projected = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return projected.type_as(features)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    # Checkpoint names -> ours. The released files prefix the text model `language_model.model.` and
    # the tower `vision_tower.vision_model.`; Transformers 5 names them `model.language_model.` /
    # `model.vision_tower.` (its SigLIP without the `vision_model` level) and saves `vision_tower.`.
    checkpoint_renames = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    encoder_modules = ("vision_tower",)  # prefill-sized products only: one weight layout when prepacked
    bidirectional_media = True  # an image's tokens see each other both ways (Transformers' token_type_ids)

    def __init__(self, config: Any) -> None:
        super().__init__(config, config.text_config)
        self.vision_tower = SiglipVisionTower(config.vision_config, positions="fixed")
        self.multi_modal_projector = Gemma3Projector(config)

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, hidden] tensor per image (each [1, 3, size, size]), one tower pass."""
        parameter = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([p.to(device=parameter.device, dtype=parameter.dtype) for p in pixel_values])
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))
