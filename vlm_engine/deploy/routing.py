"""Cache-affinity routing for Ray Serve replicas: which replica should take a request.

The key is Ray's own: Serve's `PrefixCacheAffinityRouter` keeps a prefix tree of the text each
replica was sent and routes a request to the replica whose text shares the longest prefix with
it (load permitting). Its text of a chat request is only the messages' text parts, so two
requests about different images with the same question look identical to it, and the same
image with different wording looks unrelated. `routing_key` writes the request as our engine's
prefix cache sees it: roles, text, and each image, video or file as a marker holding a content
hash, in prompt order. A request whose prompt starts like an earlier one (same images, same
conversation so far) then goes where its KV pages and encoder outputs are.

`ray_router.MediaPrefixAffinityRouter` is that router with this key, and with one rule of ours: a
request pinned to a replica (a Responses follow-up whose stored response lives there) goes there.
This module imports nothing of Ray, so the key is testable without it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

# Marks media in a key; a character no prompt text is expected to hold, so text never matches it.
_MEDIA = "\x1e"
_MEDIA_PARTS = {
    "image_url": "image_url",
    "input_image": "image_url",
    "video_url": "video_url",
    "file": "file",
    "input_file": None,  # the Responses item holds its fields directly
    "image": "image",
    "video": "video",
}


@dataclass(frozen=True)
class RoutedRequest:
    """One HTTP request on its way from the ingress to a replica's server."""

    method: str
    path: str  # with the query string
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)  # authorization and content-type only
    routing_key: str = ""  # see `routing_key`; empty: no affinity (load only)
    pinned_replica: str | None = None  # a Serve replica id (full string) that must take it


def media_hash(source: Any) -> str:
    """A content hash of one media reference: the data URI's payload or the URL. The same bytes
    always give the same hash, so the same picture sent twice keys the same."""
    text = source if isinstance(source, str) else repr(source)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _part_key(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return ""
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind in _MEDIA_PARTS:
        inner = part.get(_MEDIA_PARTS[kind]) if _MEDIA_PARTS[kind] else part
        if isinstance(inner, dict):
            inner = inner.get("url") or inner.get("file_data") or inner.get("file_url") or inner.get("image_url")
        return f"{_MEDIA}{kind.removeprefix('input_')}:{media_hash(inner)}{_MEDIA}"
    return ""


def _content_key(content: Any) -> str:
    if isinstance(content, list):
        return "".join(_part_key(p) for p in content)
    return content if isinstance(content, str) else ""


def _messages_key(messages: Any) -> str:
    if isinstance(messages, str):
        return "user\n" + messages
    if not isinstance(messages, list):
        return ""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("type") in ("function_call", "function_call_output"):  # Responses items
            out.append(f"{m['type']}\n{m.get('name', '')}{m.get('arguments', '')}{m.get('output', '')}\n")
            continue
        out.append(f"{m.get('role', '')}\n{_content_key(m.get('content'))}\n")
    return "".join(out)


def routing_key(body: Any) -> str:
    """The request as a prefix: chat `messages`, Responses `instructions` + `input`, or a
    completions `prompt` (text, or token ids written out)."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body:
        return _messages_key(body["messages"])
    if "input" in body:
        instructions = body.get("instructions")
        head = f"system\n{instructions}\n" if isinstance(instructions, str) else ""
        return head + _messages_key(body["input"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        return prompt[0] if isinstance(prompt[0], str) else " ".join(map(str, prompt))
    return ""


def pinned_replica(pending_request: Any) -> str | None:
    for arg in getattr(pending_request, "args", None) or []:
        if isinstance(arg, RoutedRequest):
            return arg.pinned_replica
    return None


def key_of(pending_request: Any) -> str:
    for arg in getattr(pending_request, "args", None) or []:
        if isinstance(arg, RoutedRequest):
            # Ray's tree divides by the key's length: an empty key must not reach it.
            return arg.routing_key or " "
    return " "
