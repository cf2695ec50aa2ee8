"""Media URLs are fetched here, in the API process, asynchronously, before a prompt reaches a worker.

A preprocess worker handles one prompt at a time. If it downloaded `image_url` / `video_url`
parts itself (it did, until this module), one slow or stalling URL held the worker, and every
request queued behind it, for up to the fetch timeout. The API process is already an event loop
that waits on sockets, so downloads happen here, concurrently with everything else (as vLLM's
frontend fetches media): a request whose URL stalls waits alone, under its own timeout and the
request's media time budget. The worker then receives the fetched bytes in place of the URL and
only decodes. A `file` part's `file_url` (a PDF, preprocess/pdf.py) is fetched the same way, under
the file byte cap.

The same checks as before apply, because the same code fetches: `preprocess.media`'s async
fetcher (http(s) only, every redirect hop resolved, checked and pinned, byte caps, per-kind
timeouts). Data URIs and local paths are left to the worker (no network; the worker enforces
their limits). At most `max_concurrent_media_fetches` downloads run at once in this process, so a flood of URLs
cannot open unbounded connections.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from preprocess.errors import MediaError
from preprocess.media import fetch_http_async, is_http_url
from vlm_engine.config import MediaConfig

# content part type -> (the part's field holding the source, the source's key when that field is an object, the
# media kind). A file part's object is OpenAI's `{"file_url": ..., "filename": ...}`; its kind selects the byte cap.
_URL_PARTS = {
    "image_url": ("image_url", "url", "image"),
    "video_url": ("video_url", "url", "video"),
    "file": ("file", "file_url", "file"),
}


@dataclass(frozen=True)
class RemotePart:
    """One content part whose source is an http(s) URL."""

    message: int
    part: int
    kind: str  # "image" | "video" | "file"
    url: str

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def remote_parts(messages: Any) -> list[RemotePart]:
    """The parts of an OpenAI message list that name http(s) URLs (nothing else is touched; the
    worker validates the rest of the shape)."""
    found: list[RemotePart] = []
    if not isinstance(messages, list):
        return found
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) or part["type"] not in _URL_PARTS:
                continue  # malformed parts are the worker's to refuse, with the part named
            field, key, kind = _URL_PARTS[part["type"]]
            source = part.get(field)
            # image_url / video_url may be a bare URL string; a file part's source is always an object.
            url = source.get(key) if isinstance(source, dict) else source if key == "url" else None
            if isinstance(url, str) and is_http_url(url):
                found.append(RemotePart(i, j, kind, url))
    return found


def with_fetched(messages: list[Any], fetched: dict[RemotePart, bytes]) -> list[Any]:
    """A copy of `messages` in which each fetched part carries its bytes instead of its URL (other
    fields of the part, e.g. a video's fps, stay)."""
    out = list(messages)
    for remote, data in fetched.items():
        message = dict(out[remote.message])
        content = list(message["content"])
        part = dict(content[remote.part])
        field, key, _ = _URL_PARTS[part["type"]]
        source = part[field]
        part[field] = {**source, key: data} if isinstance(source, dict) else data
        content[remote.part] = part
        message["content"] = content
        out[remote.message] = message
    return out


class MediaFetcher:
    """Downloads a request's remote media concurrently, bounded per process and per request."""

    def __init__(self, media: MediaConfig) -> None:
        self.limits = media
        self._slots = asyncio.Semaphore(media.max_concurrent_media_fetches)

    async def fetch_all(self, messages: list[Any], deadline: float | None) -> tuple[list[Any], float]:
        """`messages` with every http(s) source replaced by its bytes, and the seconds it took.
        Raises `MediaError` (naming the part in `param`) for the first part that fails, or when the request's media time
        budget (`deadline`, time.monotonic()) runs out first."""
        parts = remote_parts(messages)
        if not parts:
            return messages, 0.0
        t0 = time.monotonic()
        tasks = {part: asyncio.ensure_future(self._fetch(part)) for part in parts}
        try:
            timeout = None if deadline is None else max(0.0, deadline - t0)
            done, pending = await asyncio.wait(tasks.values(), timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks.values():  # the first failure in message order names its part
                if task in done and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if pending:
                stalled = next(part for part, task in tasks.items() if task in pending)
                raise MediaError(
                    f"{stalled.where}: fetching media took longer than this request's media time budget",
                    param=stalled.where,
                )
        finally:
            for task in tasks.values():
                task.cancel()
        return with_fetched(messages, {part: task.result() for part, task in tasks.items()}), time.monotonic() - t0

    async def _fetch(self, part: RemotePart) -> bytes:
        async with self._slots:
            try:
                return await fetch_http_async(part.url, self.limits, part.kind)
            except MediaError as exc:
                # Images name the part in `param` only (as the worker does); videos prefix it too.
                message = exc.message if part.kind == "image" else f"{part.where}: {exc.message}"
                raise MediaError(message, param=part.where) from None
