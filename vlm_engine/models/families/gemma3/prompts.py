"""Gemma 3's prompt side: its processor writes each image as "\n\n<start_of_image>", mm_tokens_per_image
image tokens and "<end_of_image>\n\n"; the run of image tokens is the item's span (the tokens that
attend to each other both ways). With pan-and-scan on, an image of a wide or tall aspect also gets
crops after it (behind "Here is the original image ... and
here are some crops to help you see better"), each its own image-token run: each crop is a media item
of its own, in the processor's order (the whole image, then its crops).

Pan-and-scan is a processor call argument in Transformers (`do_pan_and_scan=True`; the processor's
own defaults override the image processor's config). Here it follows the checkpoint: an image
processor config that sets `do_pan_and_scan` true (and any `pan_and_scan_*` values) is passed to
every processor call. A per-request switch would need the request's processor kwargs in `expand`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from preprocess.errors import PromptError
from preprocess.family_prompts import FamilyPrompts, placeholder_runs
from preprocess.video import DecodedVideo
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import Expansion, ProcessorPrompts, TokenizerPrompts, item_hash, pixels_hash

# Gemma3ImageProcessor's pan-and-scan settings, passed on when its config turns pan-and-scan on.
PAN_AND_SCAN_OPTIONS = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


class Gemma3Prompts(ProcessorPrompts):
    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        vision = config.vision_config
        side = int(vision.image_size) // int(vision.patch_size)
        self.grid = (1, side, side)  # the tower's patch grid, the same for every image
        image_processor = self.processor.image_processor
        self.image_kwargs: dict[str, Any] = {}
        if getattr(image_processor, "do_pan_and_scan", None):
            self.image_kwargs = {
                name: getattr(image_processor, name)
                for name in PAN_AND_SCAN_OPTIONS
                if getattr(image_processor, name, None) is not None
            }

    @property
    def accepts_videos(self) -> bool:
        return False  # Gemma 3 takes images only

    def processor_kwargs(self, images: list[Image.Image], videos: list[DecodedVideo]) -> dict[str, Any]:
        del videos  # images only (accepts_videos is False)
        return {"images": images or None, **self.image_kwargs}

    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        images = expansion.images
        if not images:
            return
        pixels = expansion.outputs["pixel_values"].cpu().split(1)  # IPC frames are host memory
        runs = list(placeholder_runs(expansion.token_ids, self.image_token_id))
        if len(runs) != len(pixels) or len(pixels) < len(images):
            raise PromptError(f"found {len(runs)} image placeholders for {len(pixels)} images", param="messages")
        # Without crops each run is one image, hashed as every family hashes images. Pan-and-scan adds
        # crops after their image, and the processor does not say how many per image (it drops
        # num_crops): then every run is hashed by its own processed pixels, which is what its
        # embedding depends on.
        cropped = len(pixels) > len(images)
        for index, ((offset, length), view) in enumerate(zip(runs, pixels)):
            content_hash = pixels_hash("gemma3-pixels", view) if cropped else item_hash(images[index])
            yield MediaInput("image", MediaSpan(offset, length, content_hash), view, self.grid)


def gemma3_prompts(model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> FamilyPrompts:
    """The VLM's processor, or a text-only checkpoint's (Gemma3ForCausalLM) tokenizer."""
    if getattr(config, "vision_config", None) is None:
        return TokenizerPrompts(model_dir, config, gguf_file, video_device)
    return Gemma3Prompts(model_dir, config, gguf_file, video_device)
