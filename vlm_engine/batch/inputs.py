"""What `vlm-engine batch` works on: files, folders, globs, JSONL manifests and OpenAI batch files,
expanded into work items, each with a stable key (content hash + prompt + schema) for resuming."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".mkv", ".avi"}
PDF_SUFFIXES = {".pdf"}
MEDIA_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES | PDF_SUFFIXES


@dataclass
class WorkItem:
    """One row of output: an image, a video, a PDF page (or document), or an OpenAI batch line."""

    source: str
    kind: str  # "image" | "video" | "pdf" | "openai"
    prompt: str | None = None
    schema: dict[str, Any] | None = None
    page: int | None = None  # PDF: 0-based page, None for the whole document
    num_pages: int | None = None
    content_hash: str = ""
    custom_id: str | None = None  # OpenAI batch
    body: dict[str, Any] | None = None  # OpenAI batch: the request body as given
    error: str | None = None  # known before running (unreadable file): becomes an error row
    key: str = field(default="", init=False)

    def finish_key(self) -> None:
        spec = json.dumps(
            [self.content_hash, self.page, self.prompt, self.schema, self.custom_id, self.body], sort_keys=True
        )
        self.key = hashlib.sha256(spec.encode()).hexdigest()[:32]


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _kind_of(path: str) -> str | None:
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if suffix in PDF_SUFFIXES:
        return "pdf"
    return None


def _walk(target: str) -> Iterator[str]:
    """A folder's media files (recursive, sorted); a glob's matches; a file itself."""
    if os.path.isdir(target):
        for root, dirs, files in os.walk(target):
            dirs.sort()
            for name in sorted(files):
                if _kind_of(name) is not None:
                    yield os.path.join(root, name)
    elif glob.has_magic(target):
        for match in sorted(glob.glob(target, recursive=True)):
            yield from _walk(match) if os.path.isdir(match) else [match]
    else:
        yield target


def _media_items(path: str, prompt: str | None, schema: dict[str, Any] | None, pdf_pages: str) -> list[WorkItem]:
    kind = _kind_of(path)
    item = WorkItem(source=path, kind=kind or "unknown", prompt=prompt, schema=schema)
    try:
        item.content_hash = file_hash(path)
    except OSError as exc:
        item.error = f"cannot read the file: {exc.strerror or exc}"
    if kind is None and item.error is None:
        item.error = f"unsupported file type {Path(path).suffix or '(none)'!r}"
    if kind != "pdf" or item.error is not None:
        return [item]
    try:
        from vlm_engine.batch.pdf import pdf_page_count

        pages = pdf_page_count(path)
    except Exception as exc:  # noqa: BLE001 - pypdfium2 raises its own error types for corrupt files
        item.error = f"cannot open the PDF: {exc}"
        return [item]
    item.num_pages = pages
    if pdf_pages == "document":
        return [item]
    return [
        WorkItem(
            source=path,
            kind="pdf",
            prompt=prompt,
            schema=schema,
            page=p,
            num_pages=pages,
            content_hash=item.content_hash,
        )
        for p in range(pages)
    ]


def _jsonl_kind(path: str) -> str | None:
    """'openai' for an OpenAI batch file, 'manifest' for path lines, None for neither."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                first = json.loads(line)
                if isinstance(first, dict) and "custom_id" in first and "body" in first:
                    return "openai"
                if isinstance(first, dict) and "path" in first:
                    return "manifest"
                return None
    return None


def expand_inputs(
    targets: list[str], prompt: str | None, schema: dict[str, Any] | None, pdf_pages: str = "each"
) -> list[WorkItem]:
    items: list[WorkItem] = []
    for target in targets:
        if target.endswith(".jsonl") and os.path.isfile(target):
            kind = _jsonl_kind(target)
            if kind == "openai":
                items += _openai_items(target)
                continue
            if kind == "manifest":
                items += _manifest_items(target, prompt, schema, pdf_pages)
                continue
        for path in _walk(target):
            items += _media_items(path, prompt, schema, pdf_pages)
    for item in items:
        item.finish_key()
    return items


def _manifest_items(path: str, prompt: str | None, schema: dict[str, Any] | None, pdf_pages: str) -> list[WorkItem]:
    base = os.path.dirname(os.path.abspath(path))
    items: list[WorkItem] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            media = entry["path"] if os.path.isabs(entry["path"]) else os.path.join(base, entry["path"])
            item_schema = entry.get("schema", schema)
            if isinstance(item_schema, str):  # a schema file, relative to the manifest
                with open(item_schema if os.path.isabs(item_schema) else os.path.join(base, item_schema)) as sf:
                    item_schema = json.load(sf)
            items += _media_items(media, entry.get("prompt", prompt), item_schema, entry.get("pdf_pages", pdf_pages))
    return items


def _openai_items(path: str) -> list[WorkItem]:
    items: list[WorkItem] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            entry = json.loads(line)
            item = WorkItem(source=path, kind="openai", custom_id=str(entry.get("custom_id")), body=entry.get("body"))
            item.content_hash = hashlib.sha256(line.strip().encode()).hexdigest()
            if entry.get("method", "POST") != "POST" or entry.get("url") not in (
                "/v1/chat/completions",
                "/chat/completions",
            ):
                item.error = f"unsupported batch request {entry.get('method')} {entry.get('url')}; only POST /v1/chat/completions"
            elif not isinstance(item.body, dict):
                item.error = "the batch line has no request body"
            items.append(item)
    return items
