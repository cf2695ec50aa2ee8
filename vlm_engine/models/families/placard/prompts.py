"""placard-default's prompt side: SmolLM2's own chat template; each image (video) part becomes a
marker in the rendered text, then the intro sentence and a span as long as its label text."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from preprocess.errors import PromptError
from preprocess.family_prompts import FrameChooser, Timer
from preprocess.video import DecodedVideo, uniform_indices
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import TokenizerPrompts, item_hash
from vlm_engine.models.families.placard import labeller
from vlm_engine.models.families.placard.efficientnet_lite import preprocess as classifier_input

_IMAGE_MARKER = "\x00image\x00"  # where an image sits in the rendered template
_VIDEO_MARKER = "\x00video\x00"


class PlacardPrompts(TokenizerPrompts):
    """SmolLM2's tokenizer (from the GGUF) and template; media become label spans."""

    content_parts = False  # SmolLM2's template takes strings: media parts are text markers
    accepts_images = True
    accepts_videos = True
    placeholder_ids = frozenset({labeller.PLACEHOLDER_TOKEN_ID})

    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        self._labeller: labeller.ImageLabeller | None = None  # the classifier, loaded on the first media

    def media_part(self, kind: str) -> dict[str, Any]:
        return {"type": "text", "text": _IMAGE_MARKER if kind == "image" else _VIDEO_MARKER}

    def frame_chooser(self) -> tuple[FrameChooser, str]:
        return uniform_indices, "uniform"

    def expand(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timed: Timer
    ) -> tuple[list[int], list[MediaInput]]:
        """Each image marker becomes "A picture. An image classifier says it shows:" and a span of
        placeholders as long as the image's label text (the encoder input: its token ids); each
        video marker "A video. An image classifier says its frames show:" and the labels of every
        sampled frame with its time."""
        pieces = re.split(f"({_IMAGE_MARKER}|{_VIDEO_MARKER})", text)
        markers, texts = pieces[1::2], pieces[0::2]
        if markers.count(_IMAGE_MARKER) != len(images) or markers.count(_VIDEO_MARKER) != len(videos):
            raise PromptError("media parts could not be placed in the chat template", param="messages")
        if (images or videos) and self._labeller is None:
            self._labeller = labeller.ImageLabeller(self.tokenizer)
        image_spans = self._labeller.span_ids(torch.stack([classifier_input(i) for i in images])) if images else []
        video_spans = [
            self._labeller.video_span_ids(
                torch.stack([classifier_input(Image.fromarray(f)) for f in video.frames]), video.timestamps_s
            )
            for video in videos
        ]
        encode = self.tokenizer.encode
        token_ids: list[int] = encode(texts[0], add_special_tokens=False)
        media: list[MediaInput] = []
        next_image = next_video = 0
        for n, marker in enumerate(markers):
            if marker == _IMAGE_MARKER:
                intro = labeller.FIRST_PICTURE if next_image == 0 else labeller.NEXT_PICTURE
                ids, content_hash = image_spans[next_image], item_hash(images[next_image])
                kind, next_image = "image", next_image + 1
            else:
                intro = labeller.FIRST_VIDEO if next_video == 0 else labeller.NEXT_VIDEO
                ids, content_hash = video_spans[next_video], item_hash(videos[next_video])
                kind, next_video = "video", next_video + 1
            token_ids += encode(intro, add_special_tokens=False)
            span = MediaSpan(len(token_ids), len(ids), content_hash)
            media.append(MediaInput(kind, span, torch.tensor(ids, dtype=torch.int32), (1, 1, 1)))
            token_ids += [labeller.PLACEHOLDER_TOKEN_ID] * len(ids)
            token_ids += encode(labeller.AFTER_PICTURE, add_special_tokens=False)
            token_ids += encode(texts[n + 1], add_special_tokens=False)
        return token_ids, media

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        return None, 0
