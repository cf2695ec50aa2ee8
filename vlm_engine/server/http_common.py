"""What every route module of the API server shares: the server's state, the request guards
(auth, serving, JSON body limits), OpenAI-shaped error responses and SSE framing."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from vlm_engine import ipc
from vlm_engine.server import openai_bodies as B
from vlm_engine.server import protocol as P
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.engine_client import EngineClient
from vlm_engine.server.errors import ApiError, error_body
from vlm_engine.server.metrics import ServerMetrics

json_encoder = msgspec.json.Encoder()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    metrics: ServerMetrics | None = None  # set by the launcher (see server.metrics.observe_requests)
    created: int = field(default_factory=B.now)
    draining: bool = False
    failure: str | None = None  # set when a child process died

    @property
    def healthy(self) -> bool:
        return self.client.ready and not self.draining and self.failure is None


# JSON lets U+0085, U+2028 and U+2029 stand raw in strings, and msgspec writes them raw, but many
# SSE clients split lines with str.splitlines(), which breaks a chunk at them (httpx's iter_lines
# does; a model's text can hold them). Escaped, the JSON means the same and every client reads it.
_LINE_BREAKS_IN_JSON = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (the Responses API does, chat completions do not)."""
    data = json_encoder.encode(obj)
    for raw, escaped in _LINE_BREAKS_IN_JSON:
        if raw in data:
            data = data.replace(raw, escaped)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def error_response(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def from_engine_error(err: ipc.RequestError) -> JSONResponse:
    return error_response(err.status, err.message, err.type, err.param, err.code)


class RouteGuards:
    """The checks every route makes before it does work."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.retry_later = {"Retry-After": str(state.config.api.retry_after_s)}  # on the 503s a client should retry

    def auth(self, request: Request) -> None:
        api_key = self.state.config.api.api_key
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", param=None, code="invalid_api_key")

    def serving(self) -> None:
        state = self.state
        if state.failure is not None:
            raise ApiError(503, f"the server is failing: {state.failure}", type="server_error")
        if state.draining:
            raise ApiError(503, "the server is shutting down", type="server_error")
        if not state.client.ready:
            raise ApiError(503, "the model is still loading", type="server_error", headers=self.retry_later)

    def room_for(self, num_choices: int) -> None:
        """503 when accepting `num_choices` more engine requests would overfill the waiting queue."""
        if self.state.client.num_waiting + num_choices > self.state.config.api.max_waiting_requests:
            raise ApiError(
                503,
                "too many requests are waiting; try again later",
                type="server_error",
                code="server_overloaded",
                headers=self.retry_later,
            )

    async def read_json(self, request: Request) -> Any:
        limit = self.state.config.api.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
        body = await request.body()
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise ApiError(400, "the request body is not valid JSON") from None
        except RecursionError:  # the decoder recurses per nesting level; ~1,000 levels exhaust it
            raise ApiError(
                400, f"the request body is nested too deeply (at most {P.MAX_JSON_DEPTH} levels)"
            ) from None
