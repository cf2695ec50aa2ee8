"""Work items -> OpenAI chat request bodies: media as data URIs (the same body goes to the
in-process engine or to a server), PDF pages rendered by preprocess.pdf and sent as PNG images (one
page per row needs per-page parts; a chat `file` part renders the same pixels)."""

from __future__ import annotations

import base64
import mimetypes
from typing import Any

from vlm_engine.batch.inputs import WorkItem
from vlm_engine.batch.pdf import PDF_LONGEST_SIDE, render_pdf_pages


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def media_parts(item: WorkItem, pdf_longest_side: int = PDF_LONGEST_SIDE) -> list[dict[str, Any]]:
    if item.kind == "pdf":
        pages = [item.page] if item.page is not None else list(range(item.num_pages or 0))
        return [
            {"type": "image_url", "image_url": {"url": _data_uri(png, "image/png")}}
            for png in render_pdf_pages(item.source, pages, pdf_longest_side)
        ]
    with open(item.source, "rb") as f:
        data = f.read()
    if item.kind == "video":
        return [{"type": "video_url", "video_url": {"url": _data_uri(data, "video/mp4")}}]
    mime = mimetypes.guess_type(item.source)[0] or "image/png"
    return [
        {"type": "image_url", "image_url": {"url": _data_uri(data, mime if mime.startswith("image/") else "image/png")}}
    ]


def request_body(
    item: WorkItem,
    model: str,
    max_tokens: int,
    temperature: float,
    fps: float | None = None,
    max_frames: int | None = None,
    pdf_longest_side: int = PDF_LONGEST_SIDE,
) -> dict[str, Any]:
    """The chat request for a media item (an OpenAI batch line already carries its own)."""
    if item.kind == "openai":
        assert item.body is not None
        return {**item.body, "model": item.body.get("model", model)}
    content = media_parts(item, pdf_longest_side) + [{"type": "text", "text": item.prompt or "Describe this."}]
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if item.schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "row", "schema": item.schema, "strict": True},
        }
    kwargs = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    if kwargs and item.kind == "video":
        body["mm_processor_kwargs"] = kwargs
    return body
