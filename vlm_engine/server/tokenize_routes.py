"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes, so clients can budget the context.

/tokenize takes a completion form `{"prompt": str, "add_special_tokens": true}` or a chat form
`{"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, "tools"?,
"mm_processor_kwargs"?}`, either with `"return_token_strs"`, and answers `{"count", "max_model_len",
"tokens", "token_strs"}`. /detokenize takes `{"tokens": [ids]}` and answers `{"prompt": text}`.

The API process only checks the body: the work is a job for a preprocess worker (it holds the
tokenizer), sent through `EngineClient.run_job` like a chat prompt (http(s) media fetched here
first), so a messages body counts exactly the prompt a chat completion runs, media placeholders
included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vlm_engine import ipc
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server import openai_bodies as B
from vlm_engine.server import protocol as P
from vlm_engine.server import request_models as M
from vlm_engine.server.errors import ApiError
from vlm_engine.server.http_common import RouteGuards, ServerState, from_engine_error, json_encoder
from vlm_engine.server.request_models import DetokenizeBody, TokenizeChat, TokenizePrompt

_UNUSED_SAMPLING = SamplingParams()  # PreprocessRequest carries one; a job never samples


def add_tokenize_routes(app: FastAPI, state: ServerState, guards: RouteGuards) -> None:
    """Register the routes on `app`."""
    config, client = state.config, state.client
    per_prompt = config.engine.media.limit_mm_per_prompt

    async def run(request: Request, parse: Callable[[Any], ipc.PreprocessRequest]) -> ipc.TokenizeResult | Response:
        guards.auth(request)
        body = await guards.read_json(request)
        guards.serving()
        job = parse(body)
        # Jobs are not generation requests (max_waiting_requests does not count them) but they
        # hold workers all the same: the same bound keeps a flood of them from starving chat.
        if client.num_jobs >= config.api.max_waiting_requests:
            raise ApiError(
                503,
                "too many tokenize requests are waiting; try again later",
                type="server_error",
                code="server_overloaded",
                headers=guards.retry_later,
            )
        answer = await client.run_job(job)
        return from_engine_error(answer) if isinstance(answer, ipc.RequestError) else answer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        answer = await run(
            request, lambda body: parse_tokenize(body, config.model_name, per_prompt.image, per_prompt.video)
        )
        if isinstance(answer, Response):
            return answer
        assert client.core_info is not None  # serving() passed
        body = {
            "count": len(answer.token_ids),
            "max_model_len": client.core_info.max_model_len,
            "tokens": answer.token_ids,
            "token_strs": answer.token_strs,
        }
        return Response(json_encoder.encode(body), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        answer = await run(request, lambda body: parse_detokenize(body, config.model_name))
        if isinstance(answer, Response):
            return answer
        return Response(json_encoder.encode({"prompt": answer.text or ""}), media_type="application/json")


# ---- request bodies ------------------------------------------------------------------------------


def _job(purpose: str, **fields: Any) -> ipc.PreprocessRequest:
    return ipc.PreprocessRequest(B.new_id(purpose), 0, 1, _UNUSED_SAMPLING, purpose=purpose, **fields)


def parse_tokenize(body: Any, served_model: str, max_images: int, max_videos: int) -> ipc.PreprocessRequest:
    body = P.check_body(body, served_model)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "give either 'prompt' or 'messages'", param="prompt" if has_prompt else "messages")
    if has_prompt:
        req = M.typed(M.given(body), TokenizePrompt)
        return _job("tokenize", prompt=req.prompt, add_special_tokens=req.add_special_tokens,
                    return_token_strs=req.return_token_strs)  # fmt: skip
    return _job("tokenize", **_chat_fields(M.typed(M.given(body), TokenizeChat), max_images, max_videos))


def _chat_fields(req: TokenizeChat, max_images: int, max_videos: int) -> dict[str, Any]:
    """The chat form's fields, checked as /v1/chat/completions checks them (the worker checks the
    messages themselves, as it does for chat)."""
    P.check_media_counts(req.messages, max_images, max_videos)
    if req.continue_final_message:
        # The chat prompt a generation runs is never left open; counting one would budget a prompt
        # no request here can send.
        raise ApiError(400, "'continue_final_message' is not supported", param="continue_final_message")
    tools, tool_choice = P.resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)  # as chat
    return {
        "messages": req.messages,
        "tools": tools if tool_choice.mode != "none" else None,  # tool_choice "none" renders no tools
        "mm_processor_kwargs": req.mm_processor_kwargs,
        "add_generation_prompt": req.add_generation_prompt,
        "add_special_tokens": req.add_special_tokens,
        "return_token_strs": req.return_token_strs,
    }


def parse_detokenize(body: Any, served_model: str) -> ipc.PreprocessRequest:
    tokens = P.parse_body(body, served_model, DetokenizeBody).tokens
    negative = next((t for t in tokens if t < 0), None)
    if negative is not None:
        raise ApiError(400, f"token id {negative} is outside the vocabulary", param="tokens")
    return _job("detokenize", prompt=tokens)
