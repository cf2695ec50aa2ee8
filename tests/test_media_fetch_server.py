"""Server-side request forgery, through the real server (conftest's `observed_server`, started
without --allow-private-media-urls): an image URL that leads to the server's own loopback
services or to the cloud metadata address is a 400 naming the reason, refused before any
connection is made, and it costs the engine nothing."""

from __future__ import annotations

import httpx
import pytest

from tests.server_helpers import ServerProcess

pytestmark = pytest.mark.slow


def ask(server: ServerProcess, url: str) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("{own}/metrics", "loopback"),
        ("http://localhost:{port}/health", "loopback"),
        ("http://[::ffff:127.0.0.1]:{port}/health", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.0.0.1/internal.png", "private"),
        ("http://0.0.0.0:{port}/health", "unspecified"),
    ],
)
def test_media_urls_to_internal_addresses_are_refused(observed_server: ServerProcess, url: str, reason: str) -> None:
    server = observed_server
    resp = ask(server, url.format(own=server.url, port=server.port))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert f"resolves to a {reason} address" in error["message"]
    assert server.metrics()["vlm_engine:kv_pages_used"] == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
