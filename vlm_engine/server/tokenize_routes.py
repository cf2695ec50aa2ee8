"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes (being written: see issue 40)."""

from __future__ import annotations

from fastapi import FastAPI

from vlm_engine.server.http_common import RouteGuards, ServerState


def add_tokenize_routes(app: FastAPI, state: ServerState, guards: RouteGuards) -> None:
    """Register the routes on `app`."""
