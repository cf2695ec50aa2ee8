"""The museum-placard webcam page: a browser client of the OpenAI-compatible API only.

Served by `vlm-engine serve --app placard` at /placard; the page itself is plain HTML, CSS and
ES modules under static/ (no build step, nothing fetched from the network)."""

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
