"""OpenAI requests checked into engine requests (the answers: `openai_bodies`; errors: `errors`).

Requests are typed (`request_models`, whose `typed` converts a decoded body and words msgspec's
errors as this server always has); what types cannot say (ranges that depend on the server, fields that
exclude each other) is checked here. Messages and media are checked by the preprocess workers.
Every field, unknown ones too, must keep within MAX_JSON_DEPTH and 64-bit integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server.errors import ApiError
from vlm_engine.server.request_models import ChatBody, CompletionBody, StreamOptions, given, typed
from vlm_engine.structured.spec import (
    StructuredOutput,
    StructuredOutputError,
    from_response_format,
    from_structured_outputs,
)
from vlm_engine.structured.tools import ToolChoice, resolve_tool_choice, validate_tools

NO_TOOLS = ToolChoice("none")

# The wire carries integers in [-2**63, 2**64) (msgpack); deeper nesting would recurse in the
# workers' template, grammar and encoder code. Both are the client's doing: a 400 that names the
# field, checked on every field (unknown ones too) before any is read.
MAX_JSON_DEPTH = 128  # generous: OpenAI allows JSON schemas 10 objects deep
_WIRE_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries
T = TypeVar("T")


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


def check_body(body: Any, served_model: str) -> dict[str, Any]:
    """A JSON object within the wire's limits that names the served model or none (404 otherwise)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
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
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return body


def parse_body(body: Any, served_model: str, model: type[T]) -> T:
    """`check_body`, then the body as `model` (a top-level null is a field not given)."""
    return typed(given(check_body(body, served_model)), model)


def _between(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name)


def check_media_counts(messages: list[Any], max_images: int, max_videos: int) -> None:
    """The per-prompt media limits, counted from the parts (a worker counts PDF pages)."""
    for kinds, limit, noun in (
        (("image_url", "image"), max_images, "images"),
        (("video_url", "video"), max_videos, "videos"),
    ):
        count = sum(
            1
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"]
            if isinstance(part, dict) and part.get("type") in kinds
        )
        if count > limit:
            raise ApiError(400, f"at most {limit} {noun} per prompt are allowed, got {count}", param="messages")


def resolve_tools(tools: Any, tool_choice: Any, parallel: bool) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    """Chat's `tools` and `tool_choice` (checked by structured.tools, in its words)."""
    try:
        tools = validate_tools(tools) if tools is not None else None
        return tools, resolve_tool_choice(tools, tool_choice, parallel)
    except StructuredOutputError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


def _constraint(
    req: ChatBody | CompletionBody, tool_constraint: StructuredOutput | None = None
) -> StructuredOutput | None:
    """The one output constraint of a request: response_format, structured_outputs or a forced tool call."""
    try:
        constraints = [
            (name, spec)
            for name, spec in (
                ("response_format", from_response_format(req.response_format)),
                ("structured_outputs", from_structured_outputs(req.structured_outputs)),
                ("tool_choice", tool_constraint),
            )
            if spec is not None
        ]
    except StructuredOutputError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    if len(constraints) > 1:
        names = " and ".join(n for n, _ in constraints)
        raise ApiError(400, f"{names} each constrain the output; give only one", param=constraints[1][0])
    return constraints[0][1] if constraints else None


def _generate(
    kind: str, req: ChatBody | CompletionBody, served_model: str, prompts: list[Any], max_tokens: int,
    top_logprobs: int | None, constraint: StructuredOutput | None, **fields: Any,
) -> GenerateRequest:  # fmt: skip
    """The engine request: what chat and completions build alike, `fields` the rest."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop sequences are supported", param="stop")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(req.temperature),  # SamplingParams raises tiny ones to its floor
            top_p=float(req.top_p),
            top_k=req.top_k,
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=top_logprobs,
            structured_output=constraint,
        )
    except ValueError as exc:
        message = str(exc)
        raise ApiError(400, message, param=message.split(" ", 1)[0] if message else None) from exc
    options = typed(req.stream_options, StreamOptions, "stream_options") if req.stream else StreamOptions()
    return GenerateRequest(
        kind=kind,
        model=served_model,
        prompts=prompts,
        n=req.n,
        sampling=sampling,
        stream=req.stream,
        include_usage=bool(options.include_usage),
        continuous_usage=bool(options.continuous_usage_stats),
        return_token_ids=req.return_token_ids,
        **fields,
    )


def parse_chat(
    body: Any, served_model: str, max_n: int, max_model_len: int, max_images: int, max_videos: int = 0
) -> GenerateRequest:
    req = parse_body(body, served_model, ChatBody)
    _between("n", req.n, 1, max_n)
    check_media_counts(req.messages, max_images, max_videos)
    top = req.top_logprobs
    if top is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    if top is not None:
        _between("top_logprobs", top, 0, 20)
    tools, tool_choice = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    # No limit given: the engine stops at the context limit, so "as many as fit" is the context size.
    max_tokens = req.max_completion_tokens or req.max_tokens or max_model_len
    return _generate(
        "chat", req, served_model, [req.messages], max_tokens, (top or 0) if req.logprobs else None,
        _constraint(req, tool_choice.constraint), logprobs=req.logprobs,
        tools=tools if tool_choice.mode != "none" else None, tool_choice=tool_choice,
        mm_processor_kwargs=req.mm_processor_kwargs,
    )  # fmt: skip


def parse_completion(body: Any, served_model: str, max_n: int) -> GenerateRequest:
    req = parse_body(body, served_model, CompletionBody)
    _between("n", req.n, 1, max_n)
    prompts = _prompts(req.prompt)
    for name in ("echo", "suffix"):
        if getattr(req, name):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    if req.logprobs is not None:
        _between("logprobs", req.logprobs, 0, 20)
    if req.n * len(prompts) > max_n:
        raise ApiError(400, f"at most {max_n} choices (n x prompts) per request", param="n")
    max_tokens = req.max_tokens or 16  # the OpenAI completions default
    return _generate(
        "completion", req, served_model, prompts, max_tokens, req.logprobs, _constraint(req),
        logprobs=req.logprobs is not None, api="completions",
    )  # fmt: skip


def _prompts(prompt: Any) -> list[Any]:
    """A string, a token-id list, or a batch of either."""

    def ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)  # bool is no id

    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string, an array of token ids, or an array of those", param="prompt")
