"""What the server answers: the OpenAI response, chunk and Response-object bodies.

Responses carry every field the official API returns, nulls included, so clients that read them
through the official SDK's models (strictly or not) see what they expect. Requests are checked in
`protocol` and `responses_protocol`; errors are `errors.error_body`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

SYSTEM_FINGERPRINT = "fp_vlm_engine"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[Any], text_offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_completion(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def chat_choice(
    index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None, message: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": message or {"role": "assistant", "content": text, "refusal": None, "annotations": []},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: Any = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
    }
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: Any = None,
    with_usage: bool = True,
) -> dict[str, Any]:
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if with_usage:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "vlm-engine"}


# ---- the Responses API ---------------------------------------------------------------------------


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    response_id: str,
    created_at: float,
    model: str,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": time.time() if status == "completed" else None,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "truncation": "disabled",
        "max_tool_calls": None,
        "usage": usage,
        **echo,
    }


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        # cache_write_tokens: OpenAI bills explicit cache writes; nothing here is billed (0).
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def message_item(
    item_id: str, status: str, text: str | None = None, logprobs: list[Any] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def logprob_entries(entries: list[Any]) -> list[dict[str, Any]]:
    """The engine's logprob entries in output_text's shape (chat's, without `refusal`)."""
    return chat_logprobs(entries)["content"]
