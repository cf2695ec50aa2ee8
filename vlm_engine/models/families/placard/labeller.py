"""placard-default's vision tower as the preprocess worker runs it: images -> their top ImageNet
labels as text (EfficientNet-Lite0), whose token ids fill the image's placeholder span."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ARCHITECTURE = "PlacardForConditionalGeneration"
PLACEHOLDER_TOKEN_ID = 16  # <empty_output> in SmolLM2's vocabulary
TOP_K = 3
MAX_SPAN = 48  # label text longer than this (three long class names) is cut
FIRST_PICTURE = "A picture. An image classifier says it shows:"
NEXT_PICTURE = "Another picture. An image classifier says it shows:"
AFTER_PICTURE = "\n"
FIRST_VIDEO = "A video. An image classifier says its frames show:"
NEXT_VIDEO = "Another video. An image classifier says its frames show:"
MAX_VIDEO_SPAN = 512  # a video's span: MAX_SPAN per frame, and at most this in all


def placard_config(text_config: Any) -> Any:
    """SmolLM2's config, marked as the composed family (the decoder reads it unchanged)."""
    text_config.architectures = [ARCHITECTURE]
    text_config.image_token_id = PLACEHOLDER_TOKEN_ID
    text_config.placard_labels = TOP_K
    return text_config


def label_text(labels: Sequence[tuple[str, float]]) -> str:
    """' tiger cat (39%), Egyptian cat (36%), tabby (17%).' from (label, probability) pairs."""
    return " " + ", ".join(f"{name} ({round(100 * p)}%)" for name, p in labels) + "."


class ImageLabeller:
    """The vision tower as the preprocess worker runs it: images -> label token ids."""

    def __init__(self, tokenizer: Any) -> None:
        from vlm_engine.models.families.placard.efficientnet_lite import load_efficientnet_lite0

        self.tokenizer = tokenizer
        self.classifier = load_efficientnet_lite0()

    def labels(self, pixels: torch.Tensor) -> list[list[tuple[str, float]]]:
        """Top-K (label, probability) for each image of a [B, 3, 224, 224] batch."""
        from vlm_engine.models.families.placard.efficientnet_lite import top_labels

        with torch.inference_mode():
            return top_labels(self.classifier(pixels.float()), TOP_K)

    def span_ids(self, pixels: torch.Tensor) -> list[list[int]]:
        return [
            self.tokenizer.encode(label_text(ls), add_special_tokens=False)[:MAX_SPAN] for ls in self.labels(pixels)
        ]

    def video_span_ids(self, frames: torch.Tensor, timestamps_s: Sequence[float]) -> list[int]:
        """One span for a video: ' At 0.0 s: tabby (40%), ... At 0.5 s: ...', each sampled frame's
        labels after its time, so the model can tell what changes."""
        ids: list[int] = []
        for t, labels in zip(timestamps_s, self.labels(frames)):
            text = f" At {t:.1f} s:" + label_text(labels)
            ids += self.tokenizer.encode(text, add_special_tokens=False)[:MAX_SPAN]
        return ids[:MAX_VIDEO_SPAN]
