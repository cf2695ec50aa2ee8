"""SmolVLM2's prompt side: its processor splits an image into rows x cols tiles plus the global image
(each tile behind `<fake_token_around_image><row_r_col_c>`, the global image behind
`<fake_token_around_image><global-img>`), and writes a video as its frames, each a global image behind
its "Frame from MM:SS:" text, after an intro naming the frame count and the duration.

Each tile / global image / frame is one contiguous run of `<image>` tokens, so each is one MediaInput
here (pixels [C, S, S], grid (1, valid patch rows, valid patch cols), content hash = the image's or
video's hash + the tile's or frame's index): the encoder cache, the prefix cache and chunked prefill
then work on tiles as on any media item, and a repeated image reuses every tile.

Positions are plain 1-D. The chat template and the expansion are the processor's own; the frames are
chosen by its video processor's sampler.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from preprocess.errors import MediaError, PromptError
from preprocess.family_prompts import FrameChooser, placeholder_runs
from preprocess.video import VideoInfo, hf_video_metadata
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.config import MediaConfig
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import Expansion, ProcessorPrompts, part_hashes, processor_step


class SmolVLMPrompts(ProcessorPrompts):
    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        processor = self.processor
        # Frames are written with the image token: it is the one placeholder.
        self.video_token_id = None
        self.placeholder_ids = frozenset({self.image_token_id} - {None})
        # SmolVLMProcessor's names; Idefics3Processor (SmolVLM v1) calls the global one a tag and has no video
        global_image = getattr(processor, "global_image_token", None) or processor.global_image_tag
        self.global_image_id = self.tokenizer.convert_tokens_to_ids(global_image)
        marks = [processor.image_token, *([processor.video_token] if self.accepts_videos else [])]
        self._media_marks = re.compile("|".join(re.escape(t) for t in marks))
        self.patch_size = int(config.vision_config.patch_size)

    @property
    def accepts_videos(self) -> bool:
        return getattr(self.processor, "video_processor", None) is not None and hasattr(self.processor, "video_token")

    def frame_chooser(self) -> tuple[FrameChooser, str]:
        """The video processor's sampler, asked as Transformers asks it with the request's fps and (its
        own frame cap lowered to) the request's max_frames: its cap also decides whether it skips the
        clip's first and last second, so it must be the cap in force."""
        video_processor = self.processor.video_processor

        def choose(info: VideoInfo, media: MediaConfig) -> list[int]:
            cap = min(media.video_max_frames, int(video_processor.num_frames))
            try:
                indices = video_processor.sample_frames(hf_video_metadata(info), num_frames=cap, fps=media.video_fps)
            except ValueError as exc:
                raise MediaError(f"cannot sample frames from this video: {exc}") from None
            return [int(i) for i in indices]

        return choose, type(video_processor).__name__

    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        outputs = expansion.outputs
        image_tiles = video_frames = None
        if expansion.videos:
            video_frames = (outputs["pixel_values"], outputs.get("pixel_attention_mask"))
        if expansion.images:
            # The processor returns one `pixel_values`: a video's overwrites the images' (Transformers'
            # SmolVLM takes either in one prompt, not both); the image processor alone gives them.
            if expansion.videos:
                with processor_step(expansion.timed, "images"):
                    outputs = self.processor.image_processor([expansion.images], return_tensors="pt")
            image_tiles = (outputs["pixel_values"][0], _first(outputs.get("pixel_attention_mask")))
        return self._walk(expansion, image_tiles, video_frames)

    def _walk(
        self,
        expansion: Expansion,
        image_tiles: tuple[torch.Tensor, torch.Tensor | None] | None,
        video_frames: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> Iterator[MediaInput]:
        """Walks the media in prompt order (their marks in the rendered text) and the `<image>` runs in
        token order: an image takes runs up to and including its global image (the run right after
        `<global-img>`); a video takes one run per frame."""
        token_ids, videos = expansion.token_ids, expansion.videos
        runs = placeholder_runs(token_ids, self.image_token_id)
        image_iter, video_iter = iter(expansion.images), iter(range(len(videos)))
        tile_cursor = 0
        for mark in self._media_marks.finditer(expansion.text):
            if mark.group() == self.processor.image_token:
                assert image_tiles is not None
                for content_hash in part_hashes(next(image_iter), "tile"):
                    offset, length = _next_run(runs, "image")
                    pixels, grid = self._tile(image_tiles, tile_cursor)
                    tile_cursor += 1
                    yield MediaInput("image", MediaSpan(offset, length, content_hash), pixels, grid)
                    if token_ids[offset - 1] == self.global_image_id:
                        break
            else:
                v = next(video_iter)
                assert video_frames is not None
                pixels_v, masks_v = video_frames
                for frame, content_hash in zip(range(len(videos[v].indices)), part_hashes(videos[v], "frame")):
                    offset, length = _next_run(runs, "video frame")
                    pixels, grid = self._tile((pixels_v[v], _first(masks_v, v)), frame)
                    yield MediaInput("video", MediaSpan(offset, length, content_hash), pixels, grid)
        if next(runs, None) is not None:
            raise PromptError("the prompt has more image placeholders than its media make", param="messages")

    def _tile(
        self, tiles: tuple[torch.Tensor, torch.Tensor | None], index: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Pixels [C, S, S] of one tile (host memory: IPC frames) and (1, valid patch rows, cols): a
        patch counts when any of its pixels is real, as Transformers' patch mask."""
        pixels, masks = tiles
        tile = pixels[index].cpu()
        height, width = tile.shape[-2:]
        if masks is None:
            return tile, (1, height // self.patch_size, width // self.patch_size)
        mask = masks[index]
        rows, cols = int(mask[:, 0].sum()), int(mask[0, :].sum())
        return tile, (1, math.ceil(rows / self.patch_size), math.ceil(cols / self.patch_size))


def _first(mask: torch.Tensor | None, index: int = 0) -> torch.Tensor | None:
    return None if mask is None else mask[index]


def _next_run(runs: Iterator[tuple[int, int]], what: str) -> tuple[int, int]:
    run = next(runs, None)
    if run is None:
        raise PromptError(
            f"found fewer image placeholder runs than the prompt's media need (at a {what})", param="messages"
        )
    return run
