"""The HTTP layer: FastAPI routes for the OpenAI API, SSE streaming, auth, health and metrics.

I/O only: requests are validated as JSON, handed to a preprocess worker through `EngineClient`,
and results (already text) come back on a per-request queue. A handler never tokenizes and never
sees a tensor. A client that goes away aborts its engine requests at once (streams: Starlette
cancels the generator on disconnect; non-streaming handlers poll for it while they wait).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlm_engine.server import openai_bodies as B
from vlm_engine.server import protocol as P
from vlm_engine.server.apps import mount_app
from vlm_engine.server.errors import ApiError
from vlm_engine.server.generation import Generation
from vlm_engine.server.http_common import (
    RouteGuards,
    ServerState,
    error_response,
)
from vlm_engine.server.responses import add_responses_routes
from vlm_engine.server.tokenize_routes import add_tokenize_routes

logger = logging.getLogger(__name__)

_STATIC = Path(__file__).parent / "static"  # the operator dashboard page


def build_app(state: ServerState) -> FastAPI:
    config = state.config
    api, web, profile_dir = config.api, config.web, config.observability.profile_dir
    per_prompt = config.engine.media.limit_mm_per_prompt
    client = state.client
    app = FastAPI(title="vlm-engine", docs_url=None, redoc_url=None, openapi_url=None)
    if web.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(web.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    if web.app is not None:
        mount_app(app, web.app)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), code=None)

    guards = RouteGuards(state)
    check_auth, check_serving, read_json = guards.auth, guards.serving, guards.read_json

    async def generate(request: Request, kind: str) -> Response:
        check_auth(request)
        body = await read_json(request)
        check_serving()
        assert client.core_info is not None
        if kind == "chat":
            parsed = P.parse_chat(
                body,
                config.model_name,
                api.max_n,
                client.core_info.max_model_len,
                per_prompt.image,
                per_prompt.video,
            )
        else:
            parsed = P.parse_completion(body, config.model_name, api.max_n)
        guards.room_for(parsed.num_choices)
        request_id = B.new_id("chatcmpl" if kind == "chat" else "cmpl")
        return await Generation(state, request, parsed, request_id).respond()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    add_tokenize_routes(app, state, guards)
    add_responses_routes(app, state, guards)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [B.model_card(config.model_name, state.created)]})

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return JSONResponse({"status": "ok"})
        status = "failed" if state.failure else "draining" if state.draining else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        assert state.metrics is not None
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if profile_dir is not None:  # as vLLM: the routes exist only when profiling is configured

        @app.post("/start_profile")
        async def start_profile(request: Request) -> Response:
            return await profile(request, start=True)

        @app.post("/stop_profile")
        async def stop_profile(request: Request) -> Response:
            return await profile(request, start=False)

    async def profile(request: Request, start: bool) -> Response:
        check_auth(request)
        assert profile_dir is not None
        try:
            answers = await client.profile(start, profile_dir)
        except RuntimeError as exc:
            raise ApiError(409, str(exc)) from None
        except TimeoutError:
            raise ApiError(504, "the engine processes did not answer the profiler request", type="server_error") from None
        errors = [f"{a.process}: {a.error}" for a in answers if a.error is not None]
        if errors:
            raise ApiError(409, "; ".join(errors))
        if start:
            return JSONResponse({"status": "started"})
        # `trace`: the engine core's; `traces`: every process's (core first, then the workers).
        return JSONResponse({"status": "stopped", "trace": answers[0].path, "traces": [a.path for a in answers]})

    @app.get("/dashboard")
    async def dashboard() -> Response:
        # Read per request (a few KB): the page can be edited without restarting the server.
        return Response((_STATIC / "dashboard.html").read_bytes(), media_type="text/html; charset=utf-8")

    return app
