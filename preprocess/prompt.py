"""Chat messages / text / token ids -> `ProcessedPrompt`: the model's own chat template, media
loaded under limits, and the model family's own expansion of media into placeholder spans and
positions (`preprocess.family_prompts.FamilyPrompts`, implemented by each family).

The rendered prompt is exactly what the model's Hugging Face processor produces, so outputs can
be compared with Transformers token for token.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from PIL import Image

from preprocess.errors import MediaError, PromptError
from preprocess.family_prompts import FamilyPrompts
from preprocess.media import DEFAULT_MEDIA, load_image, load_media_bytes
from preprocess.pdf import PdfDocument, file_part_bytes
from preprocess.video import DecodedVideo, FrameCache, load_video
from vlm_engine.config import MediaConfig
from vlm_engine.inputs import MediaInput, ProcessedPrompt, context_exceeded

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class PromptProcessor:
    """Turns requests into `ProcessedPrompt`s for one model, through its family's `FamilyPrompts`,
    under `media` (the engine's MediaConfig: limits, media per prompt, video sampling); built by
    `vlm_engine.models.registry.prompt_processor`, for the in-process engine and the server alike."""

    def __init__(self, family: FamilyPrompts, vocab_size: int, media: MediaConfig = DEFAULT_MEDIA) -> None:
        self.family = family
        self.tokenizer = family.tokenizer
        self.vocab_size = vocab_size
        self.media = media
        self.max_images = media.limit_mm_per_prompt.image
        self.max_videos = media.limit_mm_per_prompt.video
        self.frame_cache = FrameCache(media.video_frame_cache_bytes)
        # (kind, seconds) per media step since the last take_media_timings(): the server's metrics.
        self.media_timings: list[tuple[str, float]] = []
        self._media_deadline: float | None = None  # the request being converted (from_messages)
        self._longest_token: int | None = None  # characters in the longest vocabulary entry (_check_length)

    @property
    def accepts_images(self) -> bool:
        return self.family.accepts_images

    @property
    def accepts_videos(self) -> bool:
        return self.family.accepts_videos

    # ---- entry points ---------------------------------------------------------------------

    def from_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        media_deadline: float | None = None,
        max_prompt_tokens: int | None = None,
        add_generation_prompt: bool = True,
    ) -> ProcessedPrompt:
        """`tools` (OpenAI's list) are rendered by the model's own chat template, as Transformers does.
        `mm_processor_kwargs` may set the video sampling (`fps`, `max_frames`) for every video part
        that does not set its own. `media_deadline` (time.monotonic()) bounds the time spent loading
        and decoding this request's media: checked before each part and between decoded frames.
        `max_prompt_tokens` (the context length) refuses a rendered prompt too long to fit before it
        is tokenized (see `_check_length`). `add_generation_prompt=False` renders the conversation
        without the assistant turn's opening (vLLM's /tokenize option)."""
        self._media_deadline = media_deadline
        try:
            converted = self._convert_messages(messages, self._request_sampling(mm_processor_kwargs))
        finally:
            self._media_deadline = None
        hf_messages, images, videos = converted
        extra = {"tools": tools} if tools else {}
        try:
            text = self.family.template_owner.apply_chat_template(
                hf_messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except Exception as exc:  # template errors are caused by the messages' shape
            raise PromptError(f"could not apply the chat template: {exc}", param="messages") from exc
        self._check_length(len(text), max_prompt_tokens, "messages")
        token_ids, media = self.family.expand(text, images, videos, self._timed)
        return self._finish(token_ids, media, text)

    def from_text(
        self, text: str, max_prompt_tokens: int | None = None, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        if not text:
            raise PromptError("the prompt is empty", param="prompt")
        self._check_length(len(text), max_prompt_tokens, "prompt")
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return self._finish(list(ids), text=text)

    def from_token_ids(self, token_ids: list[int], max_prompt_tokens: int | None = None) -> ProcessedPrompt:
        if not token_ids:
            raise PromptError("the prompt is empty", param="prompt")
        if max_prompt_tokens is not None and len(token_ids) >= max_prompt_tokens:
            raise PromptError(
                context_exceeded(len(token_ids), max_prompt_tokens), param="prompt", code=CONTEXT_EXCEEDED
            )
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        if self.family.placeholder_ids.intersection(token_ids):
            raise PromptError("media placeholder tokens need their media; send images as message parts", param="prompt")
        return self._finish([int(t) for t in token_ids])

    def take_media_timings(self) -> list[tuple[str, float]]:
        timings, self.media_timings = self.media_timings, []
        return timings

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.media_timings.append((kind, time.perf_counter() - t0))

    def _check_length(self, chars: int, max_prompt_tokens: int | None, param: str) -> None:
        """Refuse text that cannot fit the context without tokenizing it: tokenizing a body-sized
        prompt (tens of MB) would hold this worker for many seconds, and the core refuses it anyway.
        No token covers more characters than the longest vocabulary entry (byte-level BPE: one
        character per byte; SentencePiece: one per character, byte fallbacks longer), so
        `chars / longest` is a lower bound on the token count."""
        if max_prompt_tokens is None:
            return
        if self._longest_token is None:
            self._longest_token = max(len(t) for t in self.tokenizer.get_vocab())
        at_least = -(-chars // self._longest_token)
        if at_least >= max_prompt_tokens:
            raise PromptError(
                context_exceeded(at_least, max_prompt_tokens, lower_bound=True), param=param, code=CONTEXT_EXCEEDED
            )

    def _check_budget(self, where: str) -> None:
        if self._media_deadline is not None and time.monotonic() > self._media_deadline:
            raise PromptError(f"{where}: {BUDGET_SPENT}", param=where)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- internals ------------------------------------------------------------------------

    def _request_sampling(self, kwargs: dict[str, Any] | None) -> MediaConfig:
        if not kwargs:
            return self.media
        if not isinstance(kwargs, dict):
            raise PromptError("mm_processor_kwargs must be an object", param="mm_processor_kwargs")
        return self._sampling_from(kwargs, self.media, "mm_processor_kwargs")

    def _sampling_from(self, fields: dict[str, Any], base: MediaConfig, where: str) -> MediaConfig:
        """`base` with the `fps` / `max_frames` of a part or mm_processor_kwargs, within the limits."""
        fps, max_frames = fields.get("fps", base.video_fps), fields.get("max_frames", base.video_max_frames)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 60:
            raise PromptError(f"{where}: fps must be a number in (0, 60], got {fps!r}", param=where)
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise PromptError(f"{where}: max_frames must be a positive integer, got {max_frames!r}", param=where)
        if max_frames > base.max_video_frames:
            raise PromptError(
                f"{where}: max_frames {max_frames} is above this server's limit of {base.max_video_frames}",
                param=where,
            )
        return base.sampled_at(float(fps), max_frames)

    def _convert_messages(
        self, messages: Any, sampling: MediaConfig | None = None
    ) -> tuple[list[dict[str, Any]], list[Image.Image], list[DecodedVideo]]:
        """OpenAI message list -> the Transformers chat format, loading every image and video on the way."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list", param="messages")
        sampling = sampling or self.media
        converted: list[dict[str, Any]] = []
        images: list[Image.Image] = []
        videos: list[DecodedVideo] = []
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
                raise PromptError(
                    f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content"
                )
            parts = [
                converted_part
                for j, part in enumerate(content)
                for converted_part in self._convert_part(part, f"messages[{i}].content[{j}]", images, videos, sampling)
            ]
            if not self.family.content_parts:
                # Text-only templates expect a string; parts are plain text here.
                converted.append({"role": role, "content": "".join(p["text"] for p in parts), **extra})
            else:
                converted.append({"role": role, "content": parts, **extra})
        if self.max_images is not None and len(images) > self.max_images:
            raise PromptError(
                f"at most {self.max_images} images per prompt are allowed, got {len(images)}", param="messages"
            )
        return converted, images, videos

    def _convert_part(
        self, part: Any, where: str, images: list[Image.Image], videos: list[DecodedVideo], sampling: MediaConfig
    ) -> list[dict[str, Any]]:
        """One OpenAI content part -> its chat-template parts: one, or one image per page of a PDF."""
        if not isinstance(part, dict) or "type" not in part:
            raise PromptError(f"{where} must be an object with a type", param=where)
        if part["type"] == "file":
            pages = self._load_pdf_part(part, where, images)
            return [self.family.media_part("image") for _ in range(pages)]
        return [self._convert_single_part(part, where, images, videos, sampling)]

    def _convert_single_part(
        self,
        part: dict[str, Any],
        where: str,
        images: list[Image.Image],
        videos: list[DecodedVideo],
        sampling: MediaConfig,
    ) -> dict[str, Any]:
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
            if not isinstance(source, (str, bytes, Image.Image)):  # bytes: fetched by the API process
                raise PromptError(f"{where} needs an image url", param=where)
            self._check_budget(where)
            try:
                with self._timed("image_decode"):
                    images.append(load_image(source, self.media))
            except ValueError as exc:
                message = getattr(exc, "message", str(exc))
                raise PromptError(message, param=where) from exc
            return self.family.media_part("image")
        if kind in ("video_url", "video"):
            videos.append(self._load_video_part(part, kind, where, sampling, len(videos)))
            return self.family.media_part("video")
        raise PromptError(f"{where}: content part type {kind!r} is not supported", param=where)

    def _load_pdf_part(self, part: dict[str, Any], where: str, images: list[Image.Image]) -> int:
        """`{"type": "file", "file": {"file_data" | "file_url": ...}}`, a PDF: each page, rendered as the
        batch CLI renders it (preprocess.pdf), is appended to `images` as one image. Returns the page count.
        A hostile PDF is bounded by the file byte cap, the image limit (checked on the page count before
        anything is rendered), the render scale (a page's longest side is 1288 pixels whatever it claims)
        and the media time budget (checked between pages)."""
        if not self.accepts_images:
            raise PromptError("this model does not accept images (PDF pages are sent as images)", param=where)
        self._check_budget(where)
        try:
            with self._timed("pdf_render"), PdfDocument(file_part_bytes(part.get("file"), self.media)) as pdf:
                self._check_page_count(pdf.pages, len(images), where)
                for index in range(pdf.pages):
                    self._check_budget(where)
                    # Through the image loader, as the batch CLI's PNG pages go: same checks, same pixels.
                    images.append(load_image(pdf.render(index), self.media))
        except MediaError as exc:
            raise PromptError(f"{where}: {exc.message}", param=where) from exc
        return pdf.pages

    def _check_page_count(self, pages: int, loaded: int, where: str) -> None:
        if pages == 0:
            raise PromptError(f"{where}: the PDF has no pages", param=where)
        if self.max_images is not None and loaded + pages > self.max_images:
            raise PromptError(
                f"{where}: the PDF has {pages} page{'s' if pages != 1 else ''} and each page is one image, "
                f"but at most {self.max_images} images per prompt are allowed ({loaded} already used)",
                param=where,
            )

    def _load_video_part(
        self, part: dict[str, Any], kind: str, where: str, sampling: MediaConfig, loaded: int
    ) -> DecodedVideo:
        """`{"type": "video_url", "video_url": {"url": ..., "fps"?, "max_frames"?}}` or
        `{"type": "video", "video": <path | URL | bytes>, "fps"?, "max_frames"?}`."""
        if not self.accepts_videos:
            raise PromptError("this model does not accept videos", param=where)
        if self.max_videos is not None and loaded >= self.max_videos:
            raise PromptError(f"at most {self.max_videos} videos per prompt are allowed", param=where)
        source = part.get("video_url") if kind == "video_url" else part.get("video")
        fields = {k: part[k] for k in ("fps", "max_frames") if k in part}
        if isinstance(source, dict):
            fields.update({k: source[k] for k in ("fps", "max_frames") if k in source})
            source = source.get("url")
        if not isinstance(source, (str, bytes, bytearray)):
            raise PromptError(f"{where} needs a video url", param=where)
        wanted = self._sampling_from(fields, sampling, where) if fields else sampling
        self._check_budget(where)
        choose, sampler_id = self.family.frame_chooser()
        try:
            with self._timed("video_extraction"):
                data = load_media_bytes(source, self.media, "video")
                return load_video(data, wanted, choose, self.frame_cache, sampler_id, self._media_deadline)
        except MediaError as exc:
            raise PromptError(f"{where}: {exc.message}", param=where) from exc

    def _finish(
        self, token_ids: list[int], media: list[MediaInput] | None = None, text: str | None = None
    ) -> ProcessedPrompt:
        media = media or []
        positions, delta = self.family.positions(token_ids, media)
        return ProcessedPrompt(token_ids, media, positions, delta, text)


CONTEXT_EXCEEDED = "context_length_exceeded"


BUDGET_SPENT = "the request's media time budget ran out (too much media, or media too slow to load)"


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
                raise PromptError(
                    f"messages[{i}].tool_calls[{j}] needs a function name", param=f"messages[{i}].tool_calls"
                )
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise PromptError(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                        param=f"messages[{i}].tool_calls",
                    ) from None
            converted.append(
                {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
            )
        extra["tool_calls"] = converted
    if isinstance(message.get("tool_call_id"), str):
        extra["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        extra["name"] = message["name"]
    return extra
