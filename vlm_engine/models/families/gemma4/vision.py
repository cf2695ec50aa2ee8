"""Gemma 4 with its vision tower (Gemma4ForConditionalGeneration), images only.

The E2B / E4B releases also carry an audio tower: it is not built, and the loader passes its tensors over
unread (`checkpoint_skipped`); audio parts of a request are refused before they reach the model.

The tower and its projection are Transformers' own modules (Gemma4VisionModel: 16-px patches, a
learned 2-D position table, axial 2-D RoPE, q/k/v norms, a gated MLP, 3x3 pooling by patch position;
Gemma4MultimodalEmbedder: a scale-free norm and one matrix). An image becomes a variable number of
soft tokens, up to the processor's `max_soft_tokens` budget: the processor pads every image's patches
to that budget times 9 with position (-1, -1), and the tower drops the padding.

Each image's pixels reach `encode_media` as [1, patches, 3 * 16 * 16 + 2]: the patch rows with the
two patch-position columns after them (they are one tensor through the prompt side and its IPC).

Text side as Gemma4ForCausalLM, plus Transformers' two image rules: the per-layer inputs look image
tokens up as the pad token, and with `use_bidirectional_attention="vision"` an image's tokens see each
other both ways on the sliding-window layers only (the global layers stay causal)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preprocess.errors import PromptError
from preprocess.family_prompts import FamilyPrompts, placeholder_runs
from preprocess.video import DecodedVideo
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.families.gemma4.model import Gemma4ForCausalLM
from vlm_engine.models.hf_prompts import Expansion, ProcessorPrompts, TokenizerPrompts, item_hash
from vlm_engine.models.vision_blocks import register_transformers_tower_attention

logger = logging.getLogger(__name__)

POSITION_COLUMNS = 2  # a patch's (x, y), after its pixel values
# Transformers' Gemma4Model.audio_tower / .embed_audio, as the released files name them (no rename applies).
AUDIO_CHECKPOINT_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
AUDIO_NOT_SERVED = "audio is not served (text and images are); requests with audio parts are refused"


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    checkpoint_renames = (
        ("model.language_model.", "model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.embed_vision.", "embed_vision."),
    )
    encoder_modules = ("vision_tower",)
    checkpoint_skipped: tuple[str, ...] = ()
    checkpoint_skipped_reason = AUDIO_NOT_SERVED

    def __init__(self, config: Any) -> None:
        from transformers.models.gemma4.modeling_gemma4 import (
            Gemma4MultimodalEmbedder,
            Gemma4VisionModel,
            Gemma4VisionRotaryEmbedding,
        )

        vision = config.vision_config
        super().__init__(config, config.text_config)
        if getattr(config, "audio_config", None) is not None:  # E2B / E4B: served without their audio tower
            self.checkpoint_skipped = AUDIO_CHECKPOINT_PREFIXES
            logger.info("Gemma 4 audio tower not built: %s", AUDIO_NOT_SERVED)
        self.vision_tower = Gemma4VisionModel(vision)
        # Its attention on our flash kernel in bf16 on the CPU (torch's bf16 SDPA took half the tower's time); SDPA
        # itself otherwise, so fp32 stays Transformers' bit for bit.
        self.vision_tower.config._attn_implementation = register_transformers_tower_attention()
        _stored_buffers_as_parameters(self.vision_tower)
        with torch.device("cpu"):  # its rotary table is computed, not loaded: real even when built on meta
            self.vision_tower.encoder.rotary_emb = Gemma4VisionRotaryEmbedding(vision)
        self.embed_vision = Gemma4MultimodalEmbedder(vision, config.text_config)
        self.image_token_id = int(config.image_token_id)
        self.pad_token_id = int(config.text_config.pad_token_id)
        self.bidirectional_media = config.text_config.use_bidirectional_attention == "vision"
        for layer in self.model.layers:  # Transformers' vision mask: both ways on the sliding layers only
            layer.self_attn.causal_only = layer.self_attn.window == 0
        self.pooled_patches = int(vision.pooling_kernel_size) ** 2

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Image tokens are the pad token for the embeddings (their rows are overwritten by the image's)
        and for the per-layer inputs, as Transformers' `llm_input_ids`."""
        text_ids = torch.where(input_ids == self.image_token_id, self.pad_token_id, input_ids)
        return super().embed(text_ids)

    def encode_media(self, pixel_values: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        """One [soft tokens, hidden] tensor per image, one tower pass over the batch of padded images."""
        weight = self.embed_vision.embedding_projection.weight
        rows = torch.cat([p.to(device=weight.device, dtype=torch.float32) for p in pixel_values])
        pixels = rows[..., :-POSITION_COLUMNS].to(weight.dtype)
        patch_positions = rows[..., -POSITION_COLUMNS:].round().long()
        features = self.vision_tower(pixel_values=pixels, pixel_position_ids=patch_positions).last_hidden_state
        soft_tokens = self.embed_vision(features)
        counts = ((patch_positions != -1).all(dim=-1).sum(dim=-1) // self.pooled_patches).tolist()
        return list(soft_tokens.split(counts))


def _stored_buffers_as_parameters(module: nn.Module) -> None:
    """The tower's checkpoint buffers (the released E2B / E4B towers' clipping bounds, the larger ones'
    standardization) become parameters: the loader fills parameters only, and so refuses a checkpoint
    that lacks them. Computed buffers (the rotary table) stay buffers."""
    for submodule in module.modules():
        for name in [n for n in submodule._buffers if n not in submodule._non_persistent_buffers_set]:
            tensor = submodule._buffers.pop(name)
            assert tensor is not None
            submodule.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class Gemma4Prompts(ProcessorPrompts):
    """Gemma4Processor: each image is "<boi>", its soft tokens (as many as the processor's budget
    gives that size) and "<eoi>"; the run of image tokens is the item's span."""

    @property
    def accepts_videos(self) -> bool:
        return False  # not served yet

    def processor_kwargs(self, images: list[Any], videos: list[DecodedVideo]) -> dict[str, Any]:
        del videos
        return {"images": images or None}

    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        images = expansion.images
        if not images:
            return
        outputs = expansion.outputs
        pixels = outputs["pixel_values"].cpu().float()
        patch_positions = outputs["image_position_ids"].cpu().to(pixels.dtype)
        rows = torch.cat([pixels, patch_positions], dim=-1).split(1)  # [1, patches, 3 * 16 * 16 + 2] each
        runs = list(placeholder_runs(expansion.token_ids, self.image_token_id))
        if len(runs) != len(images):
            raise PromptError(f"found {len(runs)} image placeholders for {len(images)} images", param="messages")
        for (offset, length), image, view in zip(runs, images, rows):
            yield MediaInput("image", MediaSpan(offset, length, item_hash(image)), view, (1, 1, length))


def gemma4_prompts(model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> FamilyPrompts:
    """The VLM's processor, or a text checkpoint's (Gemma4ForCausalLM) tokenizer and chat template."""
    if getattr(config, "vision_config", None) is None:
        return TokenizerPrompts(model_dir, config, gguf_file, video_device)
    return Gemma4Prompts(model_dir, config, gguf_file, video_device)
