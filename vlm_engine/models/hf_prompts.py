"""The prompt sides families compose (`preprocess.family_prompts.FamilyPrompts`): a text model's
tokenizer, and a VLM's own Hugging Face processor, which expands each image and video into its
placeholder tokens exactly as Transformers does (so outputs can match it token for token).

A VLM family subclasses `ProcessorPrompts` and overrides its two public hooks, not `expand`:

- `processor_kwargs(images, videos)`: the media arguments of the one processor call (Gemma 3 passes
  its pan-and-scan settings and no video arguments);
- `media_inputs(expansion)`: the processor's output (`Expansion`) -> one `MediaInput` per media item
  or piece of one (Qwen3-VL's video frame groups, SmolVLM's tiles, Gemma 3's crops), built with
  `items_by_run` (one item per placeholder run, the default) and hashed with `item_hash` /
  `part_hashes` / `pixels_hash`, the one way each kind of content hash is written.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from preprocess.errors import PromptError
from preprocess.family_prompts import FrameChooser, Timer, placeholder_runs
from preprocess.hashing import hash_to_int, image_content_hash
from preprocess.video import DecodedVideo, hf_indices, hf_video_metadata, uniform_indices
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput

MediaItem = Image.Image | DecodedVideo


def item_hash(item: MediaItem) -> int:
    """A whole image's or video's content hash, the key of its span (a video's is taken when decoded)."""
    return item.content_hash if isinstance(item, DecodedVideo) else hash_to_int(image_content_hash(item))


def part_hashes(item: MediaItem, part: str) -> Iterator[int]:
    """The content hashes of an item's pieces 0, 1, 2, ... (`part`: "tile", "frame", "frame-group"):
    the item's own hash (an image's hex digest, a video's int), the part and its index, folded. The
    item is hashed once, however many pieces are drawn."""
    base = item.content_hash if isinstance(item, DecodedVideo) else image_content_hash(item)
    for index in itertools.count():
        yield hash_to_int(hashlib.sha256(f"{base}/{part}/{index}".encode()).hexdigest()[:32])


def pixels_hash(tag: str, pixels: torch.Tensor) -> int:
    """The content hash of processed pixels whose source item is not known (Gemma 3's pan-and-scan
    crops): `tag`, their shape, dtype and bytes."""
    h = hashlib.sha256(f"{tag}/{tuple(pixels.shape)}/{pixels.dtype}/".encode())
    h.update(pixels.contiguous().numpy().tobytes())
    return hash_to_int(h.hexdigest())


@contextmanager
def processor_step(timed: Timer, what: str = "media") -> Iterator[None]:
    """Times a processor call as the "image_processor" stage; its failure is the request's PromptError."""
    try:
        with timed("image_processor"):
            yield
    except Exception as exc:
        raise PromptError(f"could not process the {what}: {exc}", param="messages") from exc


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


@dataclass(frozen=True)
class Expansion:
    """One prompt as the processor expanded it: what `ProcessorPrompts.media_inputs` reads."""

    text: str  # the rendered prompt the processor was given
    token_ids: list[int]  # its output ids, placeholder runs included
    images: list[Image.Image]
    videos: list[DecodedVideo]
    outputs: Any  # the processor's BatchFeature: pixels, grids, masks, as the family's processor names them
    timed: Timer  # for a further processor step (wrap it in `processor_step`)


class ProcessorPrompts:
    """A VLM whose Hugging Face processor renders the template and expands media: each image or
    video becomes one run of its placeholder token, with its pixels and grid beside it. A family
    changes it through `processor_kwargs` and `media_inputs` (the module docstring)."""

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
        with processor_step(timed):
            outputs = self.processor(text=[text], return_tensors="pt", **self.processor_kwargs(images, videos))
        token_ids = outputs["input_ids"][0].tolist()
        media = list(self.media_inputs(Expansion(text, token_ids, images, videos, outputs, timed)))
        media.sort(key=lambda m: m.span.offset)
        return token_ids, media

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        return None, 0

    # ---- the hooks a family overrides

    def processor_kwargs(self, images: list[Image.Image], videos: list[DecodedVideo]) -> dict[str, Any]:
        """The processor call's media arguments (besides `text=[text]` and `return_tensors="pt"`)."""
        return {
            "images": images or None,
            "videos": [v.frames for v in videos] or None,
            # what Transformers' own reader reports: the timing of the chosen frames (Qwen2.5-VL's
            # temporal positions and Qwen3-VL's timestamp text follow it)
            **({"video_metadata": [hf_video_metadata(v.info, list(v.indices)) for v in videos]} if videos else {}),
            "do_sample_frames": False,  # the frames were chosen (and decoded) by preprocess.video
            **({"device": self.video_device} if videos and self.video_device != "cpu" else {}),
        }

    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        """One MediaInput per media item or piece, in any order (`expand` sorts them by offset). By
        default each image and each video is one item: `items_by_run`."""
        yield from self.items_by_run(expansion, "image")
        yield from self.items_by_run(expansion, "video")

    # ---- for the hooks

    def items_by_run(self, expansion: Expansion, kind: str) -> Iterator[MediaInput]:
        """One MediaInput per image (or video) of the processor's output, matched to its placeholder
        run: pixels split by `<kind>_grid_thw`, hash `item_hash`, a video's seconds per grid step."""
        items: list[Any] = expansion.images if kind == "image" else expansion.videos
        if not items:
            return
        outputs = expansion.outputs
        grids = [tuple(int(x) for x in g) for g in outputs[f"{kind}_grid_thw"].tolist()]
        pixel_key = "pixel_values" if kind == "image" else "pixel_values_videos"
        pixel_chunks = outputs[pixel_key].cpu().split([t * h * w for t, h, w in grids])  # IPC frames are host memory
        placeholder = self.image_token_id if kind == "image" else self.video_token_id
        spans = list(placeholder_runs(expansion.token_ids, placeholder))
        if len(spans) != len(items):
            raise PromptError(f"found {len(spans)} {kind} placeholders for {len(items)} {kind}s", param="messages")
        seconds = outputs.get("second_per_grid_ts") if kind == "video" else None
        for i, ((offset, length), item, grid, pixels) in enumerate(zip(spans, items, grids, pixel_chunks)):
            grid_seconds = float(seconds[i]) if seconds is not None else None
            yield MediaInput(kind, MediaSpan(offset, length, item_hash(item)), pixels, grid, grid_seconds)
