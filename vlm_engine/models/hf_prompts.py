"""The prompt sides families compose (`preprocess.family_prompts.FamilyPrompts`): a text model's
tokenizer, and a VLM's own Hugging Face processor, which expands each image and video into its
placeholder tokens exactly as Transformers does (so outputs can match it token for token)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from preprocess.errors import PromptError
from preprocess.family_prompts import FrameChooser, Timer, placeholder_runs
from preprocess.hashing import hash_to_int, image_content_hash
from preprocess.video import DecodedVideo, hf_indices, hf_video_metadata, uniform_indices
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput


class TokenizerPrompts:
    """A text model: its tokenizer renders and encodes; no media."""

    content_parts = False
    accepts_images = False
    accepts_videos = False
    placeholder_ids: frozenset[int] = frozenset()

    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        from transformers import AutoTokenizer

        del config, video_device  # a text model needs neither
        if gguf_file:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=gguf_file)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.template_owner = self.tokenizer

    def media_part(self, kind: str) -> dict[str, Any]:
        raise PromptError(f"this model does not accept {kind}s", param="messages")

    def frame_chooser(self) -> tuple[FrameChooser, str]:
        return uniform_indices, "uniform"

    def expand(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timed: Timer
    ) -> tuple[list[int], list[MediaInput]]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), []

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        return None, 0


class ProcessorPrompts:
    """A VLM whose Hugging Face processor renders the template and expands media: each image or
    video becomes one run of its placeholder token, with its pixels and grid beside it."""

    content_parts = True
    accepts_images = True

    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        from transformers import AutoProcessor

        del gguf_file  # VLM checkpoints are HF directories
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.processor.tokenizer
        self.template_owner = self.processor
        self.image_token_id: int | None = getattr(config, "image_token_id", None)
        self.video_token_id: int | None = getattr(config, "video_token_id", None)
        self.placeholder_ids = frozenset({self.image_token_id, self.video_token_id} - {None})
        self.video_device = video_device  # where the processor resizes/normalizes frames (select_video_device)

    @property
    def accepts_videos(self) -> bool:
        return getattr(self.processor, "video_processor", None) is not None and self.video_token_id is not None

    def media_part(self, kind: str) -> dict[str, Any]:
        return {"type": kind}

    def frame_chooser(self) -> tuple[FrameChooser, str]:
        video_processor = self.processor.video_processor
        return hf_indices(video_processor), type(video_processor).__name__

    def expand(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timed: Timer
    ) -> tuple[list[int], list[MediaInput]]:
        inputs = self._run_processor(text, images, videos, timed("image_processor"))
        token_ids = inputs["input_ids"][0].tolist()
        media = [
            *self._items("image", images, inputs, token_ids),
            *self._items("video", videos, inputs, token_ids),
        ]
        media.sort(key=lambda m: m.span.offset)
        return token_ids, media

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        return None, 0

    def _run_processor(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timing: AbstractContextManager[None]
    ) -> Any:
        try:
            with timing:
                return self.processor(
                    text=[text],
                    images=images or None,
                    videos=[v.frames for v in videos] or None,
                    # what Transformers' own reader reports: the timing of the chosen frames (Qwen2.5-VL's
                    # temporal positions and Qwen3-VL's timestamp text follow it)
                    **({"video_metadata": [hf_video_metadata(v.info, list(v.indices)) for v in videos]} if videos else {}),
                    do_sample_frames=False,  # the frames were chosen (and decoded) by preprocess.video
                    return_tensors="pt",
                    **({"device": self.video_device} if videos and self.video_device != "cpu" else {}),
                )
        except Exception as exc:
            raise PromptError(f"could not process the media: {exc}", param="messages") from exc

    def _items(self, kind: str, items: list[Any], inputs: Any, token_ids: list[int]) -> Iterator[MediaInput]:
        """One MediaInput per image (or video) of the processor's output, matched to its placeholder run."""
        if not items:
            return
        grids = [tuple(int(x) for x in g) for g in inputs[f"{kind}_grid_thw"].tolist()]
        pixel_key = "pixel_values" if kind == "image" else "pixel_values_videos"
        pixel_chunks = inputs[pixel_key].cpu().split([t * h * w for t, h, w in grids])  # IPC frames are host memory
        placeholder = self.image_token_id if kind == "image" else self.video_token_id
        spans = list(placeholder_runs(token_ids, placeholder))
        if len(spans) != len(items):
            raise PromptError(f"found {len(spans)} {kind} placeholders for {len(items)} {kind}s", param="messages")
        seconds = inputs.get("second_per_grid_ts") if kind == "video" else None
        for i, ((offset, length), item, grid, pixels) in enumerate(zip(spans, items, grids, pixel_chunks)):
            content_hash = hash_to_int(image_content_hash(item)) if kind == "image" else item.content_hash
            grid_seconds = float(seconds[i]) if seconds is not None else None
            yield MediaInput(kind, MediaSpan(offset, length, content_hash), pixels, grid, grid_seconds)

