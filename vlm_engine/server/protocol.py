"""The OpenAI wire format: request validation and response / chunk / error bodies.

Responses carry every field the official API returns, nulls included, so clients that read
them through the official SDK's models (strictly or not) see what they expect. Requests are
plain JSON dicts: unknown fields are ignored, known ones are type-checked and range-checked here
(the API server's only input work; messages and media are checked by the preprocess workers).
Every field, unknown ones too, must keep within MAX_JSON_DEPTH and 64-bit integers.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from vlm_engine.sampling_params import SamplingParams
from vlm_engine.structured.spec import (
    StructuredOutput,
    StructuredOutputError,
    from_response_format,
    from_structured_outputs,
)
from vlm_engine.structured.tools import ToolChoice, resolve_tool_choice, validate_tools

SYSTEM_FINGERPRINT = "fp_vlm_engine"
NO_TOOLS = ToolChoice("none")

# Bodies are decoded without a schema, so any field may hold any JSON. Two kinds of value would
# fail far from the field that holds them: integers the msgpack IPC cannot carry to the workers
# and the core (a 500 from the encoder), and deep nesting (recursion in the workers' template,
# grammar and encoder code). Both are the client's doing: a 400 that names the field.
MAX_JSON_DEPTH = 128  # generous: OpenAI allows JSON schemas 10 objects deep
_WIRE_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries
_INT64_RANGE = (-(2**63), 2**63 - 1)  # integer fields (seed + choice index must still fit the wire)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """A validated chat or completions request; each prompt yields `n` choices."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[Any]  # chat: one message list; completions: strings or token-id lists
    n: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    tools: list[dict[str, Any]] | None = None  # what the chat template sees (None: no tools)
    tool_choice: ToolChoice = NO_TOOLS
    mm_processor_kwargs: dict[str, Any] | None = None  # video sampling (fps, max_frames) for the worker
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids in the response
    api: str = "chat_completions"  # which API asked: "chat_completions" | "completions" | "responses" (metrics)

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: `"max_tokens": true` must not pass as 1.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"'{name}' must be of type {_kind_name(kinds)}", param=name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be of type {_kind_name(kinds)}", param=name)
    if kinds is int and not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
        raise ApiError(400, f"'{name}' must be a 64-bit integer, got {_short(value)}", param=name)
    return value


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _number(body: dict[str, Any], name: str, default: float) -> float:
    # Integers too large for a float never get here: _check_json_limits refuses them first.
    return float(_get(body, name, (int, float), default))


def _check_json_limits(body: dict[str, Any]) -> None:
    """Every field (those we ignore too) within MAX_JSON_DEPTH and the wire's integer range."""
    low, high = _WIRE_INT_RANGE
    for name, value in body.items():
        stack = [(value, 1)]  # iterative: the point is not to recurse on hostile depth
        while stack:
            node, depth = stack.pop()
            if isinstance(node, int):
                if not low <= node <= high:
                    raise ApiError(400, f"'{name}' holds an integer outside the 64-bit range", param=name)
            elif isinstance(node, (list, dict)):
                if depth > MAX_JSON_DEPTH:
                    raise ApiError(400, f"'{name}' is nested more than {MAX_JSON_DEPTH} levels deep", param=name)
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop sequences are supported", param="stop")
    return tuple(stop)


def check_body(body: Any, served_model: str) -> dict[str, Any]:
    """A JSON object within the wire's limits that names the served model or none (404 otherwise)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_json_limits(body)
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return body


def check_media_counts(messages: list[Any], max_images: int, max_videos: int) -> None:
    """The per-prompt media limits, counted from the parts (a worker counts PDF pages)."""
    for kinds, limit, noun in (
        (("image_url", "image"), max_images, "images"),
        (("video_url", "video"), max_videos, "videos"),
    ):
        count = _count_parts(messages, kinds)
        if count > limit:
            raise ApiError(400, f"at most {limit} {noun} per prompt are allowed, got {count}", param="messages")


def _common(body: dict[str, Any], served_model: str, max_n: int) -> tuple[str, int, bool, bool, bool]:
    check_body(body, served_model)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"'n' must be between 1 and {max_n}, got {n}", param="n")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {}) if stream else {}
    include_usage = bool(options.get("include_usage", False))
    continuous = bool(options.get("continuous_usage_stats", False))
    return served_model, n, stream, include_usage, continuous


def _constraint(body: dict[str, Any], tool_constraint: StructuredOutput | None = None) -> StructuredOutput | None:
    """The one output constraint of a request: response_format, structured_outputs or a forced tool call."""
    try:
        given = [
            (name, spec)
            for name, spec in (
                ("response_format", from_response_format(body.get("response_format"))),
                ("structured_outputs", from_structured_outputs(body.get("structured_outputs"))),
                ("tool_choice", tool_constraint),
            )
            if spec is not None
        ]
    except StructuredOutputError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise ApiError(400, f"{names} each constrain the output; give only one", param=given[1][0])
    return given[0][1] if given else None


def _sampling(
    body: dict[str, Any], max_tokens: int, logprobs: int | None, constraint: StructuredOutput | None = None
) -> SamplingParams:
    top_k = _get(body, "top_k", int, 0)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),  # SamplingParams raises tiny ones to its floor
            top_p=_number(body, "top_p", 1.0),
            top_k=top_k,
            seed=_get(body, "seed", int),
            stop=_stop(body),
            stop_token_ids=tuple(_token_ids(body.get("stop_token_ids"), "stop_token_ids")),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            logprobs=logprobs,
            structured_output=constraint,
        )
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0] if message else None
        raise ApiError(400, message, param=param) from exc


def _token_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{name}' must be a list of integers", param=name)
    return value


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = _get(body, name, int)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{name}' must be at least 1, got {value}", param=name)
            return value
    return None


def _count_parts(messages: list[Any], types: tuple[str, ...]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in types
    )


def parse_chat(
    body: Any, served_model: str, max_n: int, max_model_len: int, max_images: int, max_videos: int = 0
) -> GenerateRequest:
    model, n, stream, include_usage, continuous = _common(body, served_model, max_n)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    check_media_counts(messages, max_images, max_videos)
    mm_kwargs = _get(body, "mm_processor_kwargs", dict)
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, f"'top_logprobs' must be between 0 and 20, got {top}", param="top_logprobs")
    tools, tool_choice = _tools(body)
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    # No limit given: the engine stops at the context limit, so "as many as fit" is the context size.
    constraint = _constraint(body, tool_choice.constraint)
    sampling = _sampling(body, max_tokens or max_model_len, (top or 0) if want_logprobs else None, constraint)
    return GenerateRequest(
        kind="chat",
        model=model,
        prompts=[messages],
        n=n,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=want_logprobs,
        tools=tools if tool_choice.mode != "none" else None,
        tool_choice=tool_choice,
        mm_processor_kwargs=mm_kwargs,
        return_token_ids=_get(body, "return_token_ids", bool, False),
    )


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    try:
        tools = validate_tools(body["tools"]) if body.get("tools") is not None else None
        parallel = _get(body, "parallel_tool_calls", bool, True)
        return tools, resolve_tool_choice(tools, body.get("tool_choice"), parallel)
    except StructuredOutputError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


def parse_completion(body: Any, served_model: str, max_n: int) -> GenerateRequest:
    model, n, stream, include_usage, continuous = _common(body, served_model, max_n)
    prompts = _prompts(body.get("prompt"))
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise ApiError(400, f"'logprobs' must be between 0 and 20, got {logprobs}", param="logprobs")
    max_tokens = _max_tokens(body, "max_tokens")
    sampling = _sampling(body, max_tokens or 16, logprobs, _constraint(body))  # 16: the OpenAI completions default
    if n * len(prompts) > max_n:
        raise ApiError(400, f"at most {max_n} choices (n x prompts) per request", param="n")
    return GenerateRequest(
        kind="completion",
        model=model,
        prompts=prompts,
        n=n,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs is not None,
        return_token_ids=_get(body, "return_token_ids", bool, False),
        api="completions",
    )


def _prompts(prompt: Any) -> list[Any]:
    """A string, a token-id list, or a batch of either."""
    bad = ApiError(400, "'prompt' must be a string, an array of token ids, or an array of those", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    for item in prompt:
        if isinstance(item, str):
            continue
        if (
            not isinstance(item, list)
            or not item
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):
            raise bad
    return list(prompt)


# ---- responses -----------------------------------------------------------------------------------


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
