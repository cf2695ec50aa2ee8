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

import hashlib
import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from preprocess.errors import MediaError, PromptError
from preprocess.family_prompts import FrameChooser, Timer, placeholder_runs
from preprocess.hashing import hash_to_int, image_content_hash
from preprocess.video import DecodedVideo, VideoInfo, VideoSampling, hf_video_metadata
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import ProcessorPrompts


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

        def choose(info: VideoInfo, sampling: VideoSampling) -> list[int]:
            cap = min(sampling.max_frames, int(video_processor.num_frames))
            try:
                indices = video_processor.sample_frames(hf_video_metadata(info), num_frames=cap, fps=sampling.fps)
            except ValueError as exc:
                raise MediaError(f"cannot sample frames from this video: {exc}") from None
            return [int(i) for i in indices]

        return choose, type(video_processor).__name__

    def expand(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timed: Timer
    ) -> tuple[list[int], list[MediaInput]]:
        inputs = self._run_processor(text, images, videos, timed("image_processor"))
        token_ids = inputs["input_ids"][0].tolist()
        image_tiles = video_frames = None
        if videos:
            video_frames = (inputs["pixel_values"], inputs.get("pixel_attention_mask"))
        if images:
            # The processor returns one `pixel_values`: a video's overwrites the images' (Transformers'
            # SmolVLM takes either in one prompt, not both); the image processor alone gives them.
            image_inputs = inputs if not videos else self._image_pixels(images, timed)
            image_tiles = (image_inputs["pixel_values"][0], _first(image_inputs.get("pixel_attention_mask")))
        media = list(self._items(text, token_ids, images, videos, image_tiles, video_frames))
        return token_ids, media

    def _image_pixels(self, images: list[Image.Image], timed: Timer) -> Any:
        try:
            with timed("image_processor"):
                return self.processor.image_processor([images], return_tensors="pt")
        except Exception as exc:
            raise PromptError(f"could not process the images: {exc}", param="messages") from exc

    def _items(
        self,
        text: str,
        token_ids: list[int],
        images: list[Image.Image],
        videos: list[DecodedVideo],
        image_tiles: tuple[torch.Tensor, torch.Tensor | None] | None,
        video_frames: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> Iterator[MediaInput]:
        """Walks the media in prompt order (their marks in the rendered text) and the `<image>` runs in
        token order: an image takes runs up to and including its global image (the run right after
        `<global-img>`); a video takes one run per frame."""
        runs = placeholder_runs(token_ids, self.image_token_id)
        image_iter, video_iter = iter(images), iter(range(len(videos)))
        tile_cursor = 0
        for mark in self._media_marks.finditer(text):
            if mark.group() == self.processor.image_token:
                image = next(image_iter)
                base = image_content_hash(image)
                assert image_tiles is not None
                for tile in itertools.count():
                    offset, length = _next_run(runs, "image")
                    pixels, grid = self._tile(image_tiles, tile_cursor)
                    tile_cursor += 1
                    yield MediaInput("image", MediaSpan(offset, length, _part_hash(base, "tile", tile)), pixels, grid)
                    if token_ids[offset - 1] == self.global_image_id:
                        break
            else:
                v = next(video_iter)
                assert video_frames is not None
                pixels_v, masks_v = video_frames
                for frame in range(len(videos[v].indices)):
                    offset, length = _next_run(runs, "video frame")
                    pixels, grid = self._tile((pixels_v[v], _first(masks_v, v)), frame)
                    content_hash = _part_hash(str(videos[v].content_hash), "frame", frame)
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


def _part_hash(base: str, part: str, index: int) -> int:
    return hash_to_int(hashlib.sha256(f"{base}/{part}/{index}".encode()).hexdigest()[:32])
