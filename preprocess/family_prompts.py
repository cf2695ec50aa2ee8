"""What a model family tells the prompt processor: the one protocol between preprocessing and a family.

`PromptProcessor` (preprocess/prompt.py) owns everything every family shares: OpenAI messages to
the chat-template format, loading images and videos under the limits, the media time budget, the
context-length check. A family owns what differs: its tokenizer and HF processor, what an image
or video part becomes in the template's messages, which video frames to keep, how the rendered
text and the loaded media become token ids and placeholder spans (how many tokens, which ids,
the text around them), and the positions of those tokens (1-D, or M-RoPE's three axes).

Families implement it in `vlm_engine/models/<family>/`; preprocessing never imports a family (it
sits below them: families use its media utilities), so the protocol lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np
from PIL import Image

from preprocess.video import DecodedVideo
from vlm_engine.inputs import MediaInput

# `timed("image_processor")` around a media step: the server's per-stage media timings.
Timer = Callable[[str], AbstractContextManager[None]]
# Chooses the frames to decode from a video's probed metadata (preprocess.video.hf_indices / uniform_indices).
FrameChooser = Callable[..., Any]


@runtime_checkable
class FamilyPrompts(Protocol):
    tokenizer: Any
    template_owner: Any  # what renders messages: the HF processor, or the tokenizer of a text model
    content_parts: bool  # the chat template takes lists of content parts (else one string per message)
    accepts_images: bool
    accepts_videos: bool
    # Media ids a raw token-id prompt may not contain (they need their media).
    placeholder_ids: frozenset[int]

    def media_part(self, kind: str) -> dict[str, Any]:
        """What an image / video content part becomes in the template's messages."""
        ...

    def frame_chooser(self) -> tuple[FrameChooser, str]:
        """The video frame sampler and its id (part of the decoded-frame cache key)."""
        ...

    def expand(
        self, text: str, images: list[Image.Image], videos: list[DecodedVideo], timed: Timer
    ) -> tuple[list[int], list[MediaInput]]:
        """The rendered prompt and its loaded media -> token ids and one MediaInput per item, in
        prompt order; raises preprocess.errors.PromptError for media that cannot be placed."""
        ...

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        """[axes, len(token_ids)] rotary positions and the delta that continues them in decode;
        (None, 0) for plain 1-D positions."""
        ...


def placeholder_runs(token_ids: list[int], placeholder: int | None) -> Iterator[tuple[int, int]]:
    """(offset, length) of each maximal run of `placeholder` tokens."""
    start = None
    for i, token in enumerate([*token_ids, None]):
        if token == placeholder and start is None:
            start = i
        elif token != placeholder and start is not None:
            yield start, i - start
            start = None
