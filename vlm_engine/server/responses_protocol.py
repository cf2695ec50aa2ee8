"""The Responses API's wire format (`POST /v1/responses`) on top of chat completions.

A Responses request is converted into the chat-completions body that means the same thing
(`chat_body`), and `protocol.parse_chat` validates it and builds the engine request: one
conversion, so the prefix cache, structured output, speculative decoding, tools and the media
limits work exactly as for chat. What differs is only the shape of what goes in (input items,
`instructions`, `text.format`, flat function tools, `previous_response_id`) and of what comes out
(output items, usage names, streamed events), both here.

Supported: `input` as a string or a list of items (messages with `input_text`, `input_image`
(URL or data URI) and `input_file` (PDF `file_data` or `file_url`) parts; assistant messages with
`output_text`; `function_call` and `function_call_output` items; `reasoning` items are dropped),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `top_logprobs`, `text.format`
(`text`, `json_object`, `json_schema`), function `tools` with `tool_choice` and
`parallel_tool_calls`, `stream`, `store`, `previous_response_id`, `metadata`, `user`, and vLLM's
sampling extras (`seed`, `top_k`, `stop`, `stop_token_ids`, `ignore_eos`, `mm_processor_kwargs`).
Refused with a 400: built-in tools, `background`, `truncation: "auto"`, `conversation`,
reusable `prompt`s, `file_id`s and `item_reference`s (there is no Files API or item store).
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vlm_engine.server import protocol as P

# Request fields passed to the chat body unchanged (vLLM's sampling extensions; the Responses API
# has no names of its own for them).
_PASSED_THROUGH = ("seed", "top_k", "stop", "stop_token_ids", "ignore_eos", "mm_processor_kwargs")
_UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "the Conversations API is not supported; use previous_response_id",
    "prompt": "reusable prompts are not supported",
}
# Chat's names in an error -> the Responses field the client sent.
_PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Origins:
    """Per chat message, where it came from ("instructions", "input[3]", "previous_response"): chat's
    errors name `messages[i]`, a Responses client sent `input[j]`."""

    of_message: list[str]

    def param(self, param: str | None) -> str | None:
        if param is None:
            return None
        match = re.match(r"messages\[(\d+)\]", param)
        if match is None:
            return _PARAM_NAMES.get(param, param)
        index = int(match.group(1))
        origin = self.of_message[index] if index < len(self.of_message) else "input"
        return origin + param[match.end() :]

    def message(self, message: str) -> str:
        return re.sub(r"messages\[\d+\][\w.\[\]]*", lambda m: self.param(m.group(0)) or m.group(0), message)

    def error(self, exc: P.ApiError) -> P.ApiError:
        return P.ApiError(exc.status, self.message(exc.message), exc.type, self.param(exc.param), exc.code)


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the engine request plus what the response echoes."""

    generate: P.GenerateRequest  # kind "chat", api "responses"
    messages: list[dict[str, Any]]  # the chat conversation sent to the engine, instructions first
    origins: Origins
    history_start: int  # messages[history_start:] is what a follow-up continues (instructions are not carried)
    echo: dict[str, Any]  # the request fields a Response object carries
    store: bool

    @property
    def stream(self) -> bool:
        return self.generate.stream


def parse_responses(
    body: Any,
    served_model: str,
    max_model_len: int,
    max_images: int,
    max_videos: int,
    previous: list[dict[str, Any]] | None = None,
) -> ResponsesRequest:
    """Validate a `POST /v1/responses` body. `previous` is the stored conversation of
    `previous_response_id` (looked up by the caller, which answers 404 for an unknown id)."""
    P.check_body(body, served_model)
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise P.ApiError(400, why, param=name)
    truncation = P._get(body, "truncation", str, "disabled")
    if truncation != "disabled":
        raise P.ApiError(400, "only 'truncation': 'disabled' is supported", param="truncation")
    instructions = P._get(body, "instructions", str)
    _metadata(body.get("metadata"))
    P._get(body, "user", str)
    messages: list[dict[str, Any]] = []
    origins_of: list[str] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins_of.append("instructions")
    history_start = len(messages)
    for message in previous or []:
        messages.append(message)
        origins_of.append("previous_response")
    for message, origin in input_messages(body.get("input")):
        messages.append(message)
        origins_of.append(origin)
    origins = Origins(origins_of)
    tools = function_tools(body.get("tools"))
    store = P._get(body, "store", bool, True)
    try:
        parsed = P.parse_chat(
            chat_body(body, messages, tools), served_model, 1, max_model_len, max_images, max_videos
        )
    except P.ApiError as exc:
        raise origins.error(exc) from None
    return ResponsesRequest(
        generate=dataclasses.replace(parsed, api="responses"),
        messages=messages,
        origins=origins,
        history_start=history_start,
        echo=_echo(body, instructions, tools),
        store=store,
    )


def _metadata(value: Any) -> None:
    """OpenAI's bounds: at most 16 string values, keys up to 64 and values up to 512 characters."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise P.ApiError(400, "'metadata' must be an object of at most 16 string values", param="metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise P.ApiError(
                400, "'metadata' keys are at most 64 characters and values strings of at most 512", param="metadata"
            )


def chat_body(body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The chat-completions body that asks for what `body` asks for."""
    chat: dict[str, Any] = {"messages": messages, "stream": P._get(body, "stream", bool, False)}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for name in ("temperature", "top_p", "parallel_tool_calls", *_PASSED_THROUGH):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    top = P._get(body, "top_logprobs", int)
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    if tools is not None:
        chat["tools"] = tools
    tool_choice = _chat_tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise P.ApiError(400, "'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise P.ApiError(400, "'text.format' must be an object", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise P.ApiError(400, "'text.format.schema' must be a JSON schema object", param="text.format.schema")
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise P.ApiError(400, "'text.format.name' must be a non-empty string", param="text.format.name")
        spec = {"name": name, "schema": schema, "strict": bool(fmt.get("strict", False))}
        return {"type": "json_schema", "json_schema": spec}
    raise P.ApiError(
        400, f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="text.format"
    )


def text_config(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The `text` field of a Response object."""
    if response_format is None or response_format["type"] == "text":
        return {"format": {"type": "text"}}
    if response_format["type"] == "json_object":
        return {"format": {"type": "json_object"}}
    spec = response_format["json_schema"]
    return {"format": {"type": "json_schema", "name": spec["name"], "schema": spec["schema"], "strict": spec["strict"]}}


# ---- tools -----------------------------------------------------------------------------------------


def function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's `{"type": "function", "function": {...}}`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise P.ApiError(400, "'tools' must be an array", param="tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise P.ApiError(400, f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind != "function":
            raise P.ApiError(400, f"{where}: only function tools are supported, got type {kind!r}", param=where)
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' `{"type": "function", "name": N}` -> chat's `{"type": "function", "function": {"name": N}}`."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise P.ApiError(
        400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )  # fmt: skip


# ---- input items -----------------------------------------------------------------------------------


def input_messages(value: Any) -> list[tuple[dict[str, Any], str]]:
    """`input` -> chat messages, each with the input item it came from."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    if not isinstance(value, list) or not value:
        raise P.ApiError(400, "'input' must be a string or a non-empty array of items", param="input")
    out: list[tuple[dict[str, Any], str]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append((_message(item, where), where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1][0] if out else None
            if last is not None and last["role"] == "assistant" and not _has_text(last):
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append(({"role": "assistant", "content": None, "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            out.append((_function_call_output(item, where), where))
        elif kind == "reasoning":
            continue  # the models served here do not reason in separate items; nothing to render
        else:
            raise P.ApiError(400, f"{where}: input item type {kind!r} is not supported", param=where)
    if not out:
        raise P.ApiError(400, "'input' holds no message", param="input")
    return out


def _has_text(message: dict[str, Any]) -> bool:
    return bool(message.get("content"))


_ROLES = ("user", "assistant", "system", "developer")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise P.ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise P.ApiError(400, f"{where}.content must be a string or an array of parts", param=f"{where}.content")
    parts = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    if role == "assistant" and all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, where: str) -> dict[str, Any]:
    """One content part -> chat's part."""
    if not isinstance(part, dict):
        raise P.ApiError(400, f"{where} must be an object", param=where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _string(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _string(part, "refusal", where)}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise P.ApiError(400, f"{where}: file_id is not supported (no Files API); send image_url", param=where)
        return {"type": "image_url", "image_url": {"url": _string(part, "image_url", where)}}
    if kind == "input_file":
        if part.get("file_id") is not None:
            raise P.ApiError(400, f"{where}: file_id is not supported (no Files API); send file_data", param=where)
        file = {k: part[k] for k in ("file_data", "file_url", "filename") if part.get(k) is not None}
        return {"type": "file", "file": file}
    raise P.ApiError(400, f"{where}: content part type {kind!r} is not supported", param=where)


def _string(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise P.ApiError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _string(item, "arguments", where)}}


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        content: Any = [_part(part, f"{where}.output[{j}]") for j, part in enumerate(output)]
    elif isinstance(output, str):
        content = output
    else:
        raise P.ApiError(400, f"{where}.output must be a string or an array of parts", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content}


# ---- the Response object ---------------------------------------------------------------------------


def _echo(body: dict[str, Any], instructions: str | None, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    choice = body.get("tool_choice")
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": _or(body.get("parallel_tool_calls"), True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": float(_or(body.get("temperature"), 1.0)),
        "text": text_config(_response_format(body.get("text"))),
        "tool_choice": choice if choice is not None else ("auto" if tools else "none"),
        "tools": [{"type": "function", **t["function"]} for t in tools or []],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": float(_or(body.get("top_p"), 1.0)),
        "user": body.get("user"),
    }


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


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


def message_item(item_id: str, status: str, text: str | None = None, logprobs: list[Any] | None = None) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def logprob_entries(entries: list[Any]) -> list[dict[str, Any]]:
    """The engine's logprob entries in output_text's shape (chat's, without `refusal`)."""
    return P.chat_logprobs(entries)["content"]
