"""Chat messages / text / token ids -> `ProcessedPrompt`: the model's own chat template and
processor, media loaded under limits and hashed, placeholder spans located, M-RoPE positions.

The rendered prompt is exactly what the model's Hugging Face processor produces, so outputs can
be compared with Transformers token for token.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from preprocess.hashing import hash_to_int, image_content_hash
from preprocess.media import DEFAULT_LIMITS, MediaLimits, load_image
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput, ProcessedPrompt

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class PromptError(ValueError):
    """A malformed request (messages, prompt); the message is safe to show the client."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class MediaTokens:
    image_token_id: int | None
    video_token_id: int | None
    spatial_merge_size: int


class PromptProcessor:
    """Owns the tokenizer (and image processor) of one model."""

    def __init__(
        self,
        model_dir: Path,
        config: Any,
        gguf_file: str | None = None,
        limits: MediaLimits = DEFAULT_LIMITS,
        max_images: int | None = None,
    ) -> None:
        from transformers import AutoProcessor, AutoTokenizer

        self.config = config
        self.limits = limits
        self.max_images = max_images
        self.processor: Any = None
        vision = getattr(config, "vision_config", None)
        if gguf_file:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=gguf_file)
        elif vision is not None:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.media_tokens = MediaTokens(
            getattr(config, "image_token_id", None),
            getattr(config, "video_token_id", None),
            getattr(vision, "spatial_merge_size", 1) if vision is not None else 1,
        )
        self.uses_mrope = vision is not None
        # placard-default (vlm_engine/models/placard.py): each image becomes the text of its
        # classifier labels, computed here; the chat template is SmolLM2's own.
        self.labels_images = bool(getattr(config, "placard_labels", None))
        self._labeller: Any = None

    @property
    def is_multimodal(self) -> bool:
        return self.processor is not None

    @property
    def accepts_images(self) -> bool:
        return self.processor is not None or self.labels_images

    # ---- entry points ---------------------------------------------------------------------

    def from_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> ProcessedPrompt:
        """`tools` (OpenAI's list) are rendered by the model's own chat template, as Transformers does."""
        hf_messages, images = self._convert_messages(messages)
        template_owner = self.processor if self.is_multimodal else self.tokenizer
        extra = {"tools": tools} if tools else {}
        try:
            text = template_owner.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as exc:  # template errors are caused by the messages' shape
            raise PromptError(f"could not apply the chat template: {exc}", param="messages") from exc
        if self.labels_images:
            return self._process_label_spans(text, images)
        if not self.is_multimodal:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return self._finish(list(ids), text=text)
        return self._process_multimodal(text, images)

    def from_text(self, text: str) -> ProcessedPrompt:
        if not text:
            raise PromptError("the prompt is empty", param="prompt")
        ids = self.tokenizer(text)["input_ids"]
        return self._finish(list(ids), text=text)

    def from_token_ids(self, token_ids: list[int]) -> ProcessedPrompt:
        if not token_ids:
            raise PromptError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        media_ids = {self.media_tokens.image_token_id, self.media_tokens.video_token_id} - {None}
        if media_ids.intersection(token_ids):
            raise PromptError("media placeholder tokens need their media; send images as message parts", param="prompt")
        return self._finish([int(t) for t in token_ids])

    @property
    def vocab_size(self) -> int:
        text_config = getattr(self.config, "text_config", None) or self.config
        return int(text_config.vocab_size)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- internals ------------------------------------------------------------------------

    def _convert_messages(self, messages: Any) -> tuple[list[dict[str, Any]], list[Image.Image]]:
        """OpenAI message list -> the Transformers chat format, loading every image on the way."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list", param="messages")
        converted: list[dict[str, Any]] = []
        images: list[Image.Image] = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise PromptError(f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
            role = message["role"]
            if role not in ("system", "user", "assistant", "developer", "tool"):
                raise PromptError(f"messages[{i}].role {role!r} is not supported", param=f"messages[{i}].role")
            content = message.get("content")
            if content is None:
                content = ""
            extra = _tool_fields(message, i)
            if isinstance(content, str):
                converted.append({"role": role, "content": content, **extra})
                continue
            if not isinstance(content, list):
                raise PromptError(f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content")
            parts = [self._convert_part(part, f"messages[{i}].content[{j}]", images) for j, part in enumerate(content)]
            if not self.is_multimodal:
                # Text-only templates expect a string; parts are plain text here.
                converted.append({"role": role, "content": "".join(p["text"] for p in parts), **extra})
            else:
                converted.append({"role": role, "content": parts, **extra})
        if self.max_images is not None and len(images) > self.max_images:
            raise PromptError(
                f"at most {self.max_images} images per prompt are allowed, got {len(images)}", param="messages"
            )
        return converted, images

    def _convert_part(self, part: Any, where: str, images: list[Image.Image]) -> dict[str, Any]:
        if not isinstance(part, dict) or "type" not in part:
            raise PromptError(f"{where} must be an object with a type", param=where)
        kind = part["type"]
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise PromptError(f"{where}.text must be a string", param=where)
            return {"type": "text", "text": text}
        if kind in ("image_url", "image"):
            if not self.accepts_images:
                raise PromptError("this model does not accept images", param=where)
            source = part.get("image_url") if kind == "image_url" else part.get("image")
            if isinstance(source, dict):
                source = source.get("url")
            if not isinstance(source, (str, Image.Image)):
                raise PromptError(f"{where} needs an image url", param=where)
            try:
                images.append(load_image(source, self.limits))
            except ValueError as exc:
                message = getattr(exc, "message", str(exc))
                raise PromptError(message, param=where) from exc
            if self.labels_images:
                return {"type": "text", "text": _IMAGE_MARKER}
            return {"type": "image"}
        raise PromptError(f"{where}: content part type {kind!r} is not supported", param=where)

    def _process_multimodal(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        try:
            inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        except Exception as exc:
            raise PromptError(f"could not process the images: {exc}", param="messages") from exc
        token_ids = inputs["input_ids"][0].tolist()
        media: list[MediaInput] = []
        if images:
            grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"].tolist()]
            pixel_chunks = inputs["pixel_values"].split([t * h * w for t, h, w in grids])
            spans = _placeholder_runs(token_ids, self.media_tokens.image_token_id)
            if len(spans) != len(images):
                raise PromptError(f"found {len(spans)} image placeholders for {len(images)} images", param="messages")
            for (offset, length), image, grid, pixels in zip(spans, images, grids, pixel_chunks):
                content_hash = hash_to_int(image_content_hash(image))
                media.append(MediaInput("image", MediaSpan(offset, length, content_hash), pixels, grid))
        return self._finish(token_ids, media, text)

    def _process_label_spans(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        """Each image marker becomes "A picture. An image classifier says it shows:" and a span of
        placeholders as long as the image's label text (the encoder input: its token ids)."""
        import torch

        from vlm_engine.models import placard
        from vlm_engine.models.efficientnet_lite import preprocess as classifier_input

        pieces = text.split(_IMAGE_MARKER)
        if len(pieces) != len(images) + 1:
            raise PromptError("image parts could not be placed in the chat template", param="messages")
        spans: list[list[int]] = []
        if images:
            if self._labeller is None:
                self._labeller = placard.ImageLabeller(self.tokenizer)
            spans = self._labeller.span_ids(torch.stack([classifier_input(image) for image in images]))
        encode = self.tokenizer.encode
        token_ids: list[int] = []
        media: list[MediaInput] = []
        for n, piece in enumerate(pieces):
            token_ids += encode(piece, add_special_tokens=False)
            if n == len(images):
                break
            token_ids += encode(placard.FIRST_PICTURE if n == 0 else placard.NEXT_PICTURE, add_special_tokens=False)
            span = MediaSpan(len(token_ids), len(spans[n]), hash_to_int(image_content_hash(images[n])))
            media.append(MediaInput("image", span, torch.tensor(spans[n], dtype=torch.int32), (1, 1, 1)))
            token_ids += [placard.PLACEHOLDER_TOKEN_ID] * len(spans[n])
            token_ids += encode(placard.AFTER_PICTURE, add_special_tokens=False)
        return self._finish(token_ids, media, text)

    def _finish(self, token_ids: list[int], media: list[MediaInput] | None = None, text: str | None = None) -> ProcessedPrompt:
        media = media or []
        prompt = ProcessedPrompt(token_ids=token_ids, media=media, text=text)
        if self.uses_mrope:
            from vlm_engine.models.qwen2_vl import mrope_positions

            prompt.mrope_positions, prompt.mrope_delta = mrope_positions(
                len(token_ids),
                [(m.span.offset, m.span.length, m.grid_thw) for m in media],
                self.media_tokens.spatial_merge_size,
            )
        return prompt


_IMAGE_MARKER = "\x00image\x00"  # where an image sits in the rendered template (label-span models)


def _tool_fields(message: dict[str, Any], i: int) -> dict[str, Any]:
    """An assistant's `tool_calls` and a tool message's `tool_call_id`, in the form chat templates
    read (arguments as an object, as Transformers' tool-use format has them)."""
    extra: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise PromptError(f"messages[{i}].tool_calls must be an array", param=f"messages[{i}].tool_calls")
        converted = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise PromptError(f"messages[{i}].tool_calls[{j}] needs a function name", param=f"messages[{i}].tool_calls")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise PromptError(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", param=f"messages[{i}].tool_calls"
                    ) from None
            converted.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        extra["tool_calls"] = converted
    if isinstance(message.get("tool_call_id"), str):
        extra["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        extra["name"] = message["name"]
    return extra


def _placeholder_runs(token_ids: list[int], placeholder: int | None) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `placeholder` tokens."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(token_ids + [None]):  # type: ignore[operator]
        if token == placeholder and start is None:
            start = i
        elif token != placeholder and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
