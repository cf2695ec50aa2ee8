"""Static web apps the server can host next to the API (`vlm-engine serve --app NAME`).

An app is a directory of static files mounted at /NAME/; `/` then redirects to it. Apps talk to
the server only through the public HTTP API, like any other client."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles


def _placard_dir() -> Path:
    from apps.placard import STATIC_DIR

    return STATIC_DIR


APPS = {"placard": _placard_dir}


def mount_app(app: FastAPI, name: str) -> None:
    static_dir = APPS[name]()
    prefix = f"/{name}/"

    # Relative URLs in the page resolve against the directory, so /NAME must become /NAME/.
    @app.get(f"/{name}", include_in_schema=False)
    async def _app_dir() -> RedirectResponse:
        return RedirectResponse(prefix)

    @app.get("/", include_in_schema=False)
    async def _root() -> RedirectResponse:
        return RedirectResponse(prefix)

    app.mount(prefix, StaticFiles(directory=static_dir, html=True), name=f"app-{name}")
