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
from dataclasses import dataclass
from typing import Any

from vlm_engine.server import protocol as P
from vlm_engine.server import request_models as M
from vlm_engine.server.errors import ApiError

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

    def error(self, exc: ApiError) -> ApiError:
        return ApiError(exc.status, self.message(exc.message), exc.type, self.param(exc.param), exc.code)


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
    req = P.parse_body(body, served_model, M.ResponsesBody)
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise ApiError(400, why, param=name)
    if req.truncation != "disabled":
        raise ApiError(400, "only 'truncation': 'disabled' is supported", param="truncation")
    instructions = [({"role": "system", "content": req.instructions}, "instructions")] if req.instructions else []
    sent = [*instructions, *((m, "previous_response") for m in previous or []), *input_messages(req.input)]
    messages = [message for message, _ in sent]
    origins = Origins([origin for _, origin in sent])
    tools = _chat_tools(req.tools)
    try:
        parsed = P.parse_chat(
            chat_body(body, messages, tools, req), served_model, 1, max_model_len, max_images, max_videos
        )
    except ApiError as exc:
        raise origins.error(exc) from None
    return ResponsesRequest(
        generate=dataclasses.replace(parsed, api="responses"),
        messages=messages,
        origins=origins,
        history_start=len(instructions),
        echo=_echo(body, req, tools),
        store=req.store,
    )


def chat_body(
    body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    req: M.ResponsesBody | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The chat-completions body that asks for what `body` (typed: `req`) asks for."""
    req = req or M.typed(M.given(body), M.ResponsesBody)
    chat: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", *_PASSED_THROUGH):
        if body.get(name) is not None:
            chat[name] = body[name]
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs
    if tools is not None:
        chat["tools"] = tools
    if isinstance(req.tool_choice, M.FunctionChoice):  # Responses' {"type": "function", "name": N}
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    response_format = _response_format(req.text)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _response_format(text: M.TextConfig | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format`."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if isinstance(fmt, M.JsonSchemaFormat):
        spec = {"name": fmt.name, "schema": fmt.schema, "strict": bool(fmt.strict)}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": "json_object" if isinstance(fmt, M.JsonObjectFormat) else "text"}


def function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's `{"type": "function", "function": {...}}`."""
    return _chat_tools(M.typed(tools, list[M.FunctionTool] | None, "tools"))


def _chat_tools(tools: list[M.FunctionTool] | None) -> list[dict[str, Any]] | None:
    fields = ("name", "description", "parameters", "strict")
    chat = [{k: getattr(t, k) for k in fields if getattr(t, k) is not None} for t in tools or []]
    return [{"type": "function", "function": fn} for fn in chat] if chat else None


# ---- input items -----------------------------------------------------------------------------------


def input_messages(value: str | list[Any]) -> list[tuple[dict[str, Any], str]]:
    """`input` -> chat messages, each with the input item it came from."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    # A message item may leave its type out (the SDK's EasyInputMessage); a tagged union may not.
    value = [{"type": "message", **i} if isinstance(i, dict) and "type" not in i and "role" in i else i for i in value]
    out: list[tuple[dict[str, Any], str]] = []
    for i, item in enumerate(M.typed({"input": value}, M.InputItems).input):
        where = f"input[{i}]"
        if isinstance(item, M.MessageItem):
            out.append((_message(item, where), where))
        elif isinstance(item, M.FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = out[-1][0] if out else None
            if last is not None and last["role"] == "assistant" and not last.get("content"):
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append(({"role": "assistant", "content": None, "tool_calls": [call]}, where))
        elif isinstance(item, M.FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _parts(item.output, f"{where}.output")
            out.append(({"role": "tool", "tool_call_id": item.call_id, "content": output}, where))
    if not out:
        raise ApiError(400, "'input' holds no message", param="input")
    return out


def _message(item: M.MessageItem, where: str) -> dict[str, Any]:
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    parts = _parts(item.content, f"{where}.content")
    if item.role == "assistant" and all(p["type"] == "text" for p in parts):
        return {"role": item.role, "content": "".join(p["text"] for p in parts)}
    return {"role": item.role, "content": parts}


def _parts(parts: list[M.Part], where: str) -> list[dict[str, Any]]:
    """Content parts -> chat's parts."""
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, (M.InputText, M.OutputText)):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, M.Refusal):
            out.append({"type": "text", "text": part.refusal})
        elif part.file_id is not None:
            send = "image_url" if isinstance(part, M.InputImage) else "file_data"
            at = f"{where}[{j}]"
            raise ApiError(400, f"{at}: file_id is not supported (no Files API); send {send}", param=at)
        elif isinstance(part, M.InputImage):
            if part.image_url is None:
                raise ApiError(400, f"{where}[{j}].image_url must be a string", param=f"{where}[{j}].image_url")
            out.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            file = {k: getattr(part, k) for k in ("file_data", "file_url", "filename") if getattr(part, k) is not None}
            out.append({"type": "file", "file": file})
    return out


# ---- what the Response object echoes -------------------------------------------------------------


def _echo(body: dict[str, Any], req: M.ResponsesBody, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    choice = body.get("tool_choice")  # as sent: a FunctionChoice is echoed as its object
    text_format = _response_format(req.text) or {"type": "text"}  # the chat form's json_schema is the echo's
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": float(req.temperature),
        "text": {"format": {"type": text_format["type"], **text_format.get("json_schema", {})}},
        "tool_choice": choice if choice is not None else ("auto" if tools else "none"),
        "tools": [{"type": "function", **t["function"]} for t in tools or []],
        "top_logprobs": req.top_logprobs,
        "top_p": float(req.top_p),
        "user": req.user,
    }
