"""Mistral 3's and LightOnOCR's prompt side: their processors resize each image so its longest edge fits and
both sides are multiples of patch_size * spatial_merge_size, pad the batch to its largest image (the
real size in `image_sizes`), and write per merged row of patches a run of [IMG] tokens ended by
[IMG_BREAK], the last by [IMG_END] (PixtralProcessor), or [IMG] tokens only (LightOnOcrProcessor in
Transformers 5). An image's span is its whole block of those tokens; its pixels are cropped to its size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from preprocess.errors import PromptError
from preprocess.video import DecodedVideo
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import Expansion, ProcessorPrompts, item_hash


class PixtralPrompts(ProcessorPrompts):
    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        self.patch_size = int(config.vision_config.patch_size)
        self.merge = int(config.spatial_merge_size)
        # both processors name the three tokens (LightOnOcrProcessor writes only the first)
        self.break_id = int(self.processor.image_break_token_id)
        self.end_id = int(self.processor.image_end_token_id)
        self.placeholder_ids = frozenset({self.image_token_id, self.break_id, self.end_id} - {None})

    @property
    def accepts_videos(self) -> bool:
        return False  # images only

    def processor_kwargs(self, images: list[Image.Image], videos: list[DecodedVideo]) -> dict[str, Any]:
        del videos  # images only (accepts_videos is False)
        return {"images": images or None}

    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        images = expansion.images
        if not images:
            return
        sizes = [(int(h), int(w)) for h, w in expansion.outputs["image_sizes"].tolist()]
        pixels = expansion.outputs["pixel_values"].cpu()  # IPC frames are host memory
        ids = expansion.token_ids
        breaks = self.end_id in ids  # the layout with [IMG_BREAK] / [IMG_END] (PixtralProcessor)
        if breaks and self.end_id != self.break_id + 1:
            # the model takes [IMG_END]'s embedding as the id after [IMG_BREAK] (model.PixtralGrid), as in
            # Mistral's tokenizers ([IMG] 10, [IMG_BREAK] 12, [IMG_END] 13)
            raise PromptError(f"[IMG_END] is id {self.end_id}, not the one after [IMG_BREAK] ({self.break_id})")
        positions = [i for i, t in enumerate(ids) if t in self.placeholder_ids]
        start = 0
        for index, (height, width) in enumerate(sizes):
            rows, cols = height // self.patch_size, width // self.patch_size
            tokens_per_row = cols // self.merge + int(breaks)
            length = (rows // self.merge) * tokens_per_row
            run = positions[start : start + length]
            if len(run) != length or run[-1] - run[0] != length - 1:
                raise PromptError(f"image {index}'s {length} placeholder tokens are not one run", param="messages")
            start += length
            view = pixels[index : index + 1, :, :height, :width].contiguous()
            grid = (rows, cols, self.break_id if breaks else -1)
            yield MediaInput("image", MediaSpan(run[0], length, item_hash(images[index])), view, grid)
        if start != len(positions):
            raise PromptError(
                f"found {len(positions)} image placeholder tokens for {len(images)} images", param="messages"
            )
