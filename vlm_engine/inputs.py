"""What preprocessing hands the engine: token ids plus media, ready for the scheduler and runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlm_engine.cache.page_hash import MediaSpan


@dataclass
class MediaInput:
    """One image or video already turned into encoder input.

    `span` says where its placeholder tokens sit in the prompt; `pixel_values` and `grid_thw`
    are what the vision tower consumes. The scheduler only ever looks at `span`.
    """

    kind: str  # "image" | "video"
    span: MediaSpan
    pixel_values: Any  # the encoder's input (a torch.Tensor); typed loosely to keep torch out of the scheduler
    grid_thw: tuple[int, int, int]  # the family's shape of it (Qwen2-VL: the patch grid); (1, 1, 1) where unused
    # A video's seconds per temporal grid step (frames per step / sampled fps), for families whose
    # positions follow time; None for images and where the processor does not say.
    grid_seconds: float | None = None


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    media: list[MediaInput] = field(default_factory=list)
    # Rotary positions when the family's are not plain 1-D ones: [axes, len(token_ids)] (M-RoPE: the
    # t, h, w axes), and the offset that continues them in decode (every axis at position + delta).
    positions: np.ndarray | None = None
    position_delta: int = 0
    text: str | None = None  # the rendered prompt, for logs and tests
    # Rows of `positions` (1 for plain ones). A model with another number of rotary axes (a text draft
    # model of an M-RoPE target) runs this prompt on plain positions: these are its family's.
    position_axes: int = field(init=False)

    def __post_init__(self) -> None:
        self.position_axes = 1 if self.positions is None else len(self.positions)

    @property
    def media_spans(self) -> list[MediaSpan]:
        return [m.span for m in self.media]


def context_exceeded(tokens: int, context: int, lower_bound: bool = False) -> str:
    """Why a prompt cannot run (the scheduler's refusal, and the workers' earlier one made from a
    lower bound on the token count); the API marks it context_length_exceeded."""
    count = f"at least {tokens}" if lower_bound else str(tokens)
    return (
        f"the prompt has {count} tokens, but this model's context is {context} tokens and at least one "
        "must be left to generate"
    )
